"""The latest alerts in Redis: a capped stream the worker appends to, ``mcpbg serve`` reads.

:class:`RedisLogSink` is one more sink: ``XADD mcpbg:v1:_alerts MAXLEN <keep>``
with the alert's CloudEvent JSON, so the key holds the ``keep`` newest alerts
(setting ``alert_keep``) and never grows past them. :func:`latest_alerts` is
the bounded read behind ``GET /v1/alerts``: ``XREVRANGE ... COUNT n``, one
round trip, newest first. The Kafka alert topic stays the full record; its tail
cannot be read in a bounded way without ``end_offsets`` (see topic_reader.py).
"""

from __future__ import annotations

import logging
from typing import Any

from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.events import MalformedEventError, rfc3339
from mcp_budget_governor.keys import INTERNAL_PREFIX

from .event import Alert, parse_alert

__all__ = ["ALERT_LOG_KEY", "RedisLogSink", "alert_row", "latest_alerts"]

log = logging.getLogger(__package__)

#: The Redis stream holding the latest alerts (internal: no counter scan sees it).
ALERT_LOG_KEY = f"{INTERNAL_PREFIX}alerts"


class RedisLogSink:
    """Appends each alert to the capped stream :data:`ALERT_LOG_KEY` (``keep`` entries).

    ``client`` is a ``redis.asyncio`` client (the worker's backend's); the trim is
    exact, so the stream never holds more than ``keep`` alerts."""

    def __init__(self, client: Any, keep: int, key: str = ALERT_LOG_KEY) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidInputError("alert_keep", keep, "expected a positive integer")
        self.client = client
        self.keep = keep
        self.key = key

    @property
    def name(self) -> str:
        return f"redis stream {self.key}"

    async def send(self, alert: Alert) -> None:
        await self.client.xadd(
            self.key, {"event": alert.to_json()}, maxlen=self.keep, approximate=False
        )

    async def aclose(self) -> None:
        return None  # the client belongs to the worker's backend


def alert_row(alert: Alert, id_: str | None = None) -> dict[str, Any]:
    """An alert as the API shows it: its fields, ``id`` and ``time`` (RFC 3339)."""
    return {"id": id_ or alert.id, "time": rfc3339(alert.at), **alert.data()}


async def latest_alerts(
    client: Any, n: int, *, limit: str | None = None, key: str = ALERT_LOG_KEY
) -> list[dict[str, Any]]:
    """The ``n`` newest alerts kept in Redis (of ``limit`` only, if given), newest first.

    Reads at most the whole capped stream; an entry that does not parse is
    skipped with a WARNING (another writer's, or a newer version's)."""
    rows: list[dict[str, Any]] = []
    # With a limit filter the whole (capped) stream may be needed; else n entries.
    entries = await client.xrevrange(key, count=None if limit else n)
    for entry_id, fields in entries:
        raw = fields.get(b"event", fields.get("event"))
        try:
            alert = parse_alert(raw or b"")
        except MalformedEventError as exc:
            log.warning("alerts: %s entry %s is not an alert (%s)", key, entry_id, exc)
            continue
        if limit is not None and alert.limit != limit:
            continue
        rows.append(alert_row(alert))
        if len(rows) >= n:
            break
    return rows
