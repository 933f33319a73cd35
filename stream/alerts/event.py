"""The alert event: :class:`Alert`, its CloudEvents form ``mcpbg.alert.v1`` and its schema."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from mcp_budget_governor.events import LimitName, MalformedEventError, rfc3339
from mcp_budget_governor.keys import PREFIX
from mcp_budget_governor.money import Unit
from mcp_budget_governor.windows import Window

from .levels import FORECAST, AlertKind, marker_key

#: The CloudEvents ``type`` of an alert.
ALERT_TYPE = "mcpbg.alert.v1"
#: The CloudEvents ``source`` of the alerts the evaluator emits.
ALERT_SOURCE = "/mcpbg/alerts"
#: UUIDv5 namespace of alert ids: an alert's id is a function of its marker.
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:mcpbg:alert")


@dataclass(frozen=True, slots=True)
class Alert:
    """One crossing of one level by one counter.

    - ``kind``: ``threshold`` (an ``alert_at`` level, or the 100 % of a shadow
      limit), ``breaker`` (a breaker limit reached its cap) or ``forecast`` (at
      this period's rate the counter is projected to reach its cap before the
      period ends; ``level`` is the percentage used so far; once per period).
    - ``limit``, ``scope`` (the key's scope segment, ``user=alice`` or
      ``global``), ``key`` (the counter), ``bucket`` and ``window``: which
      counter; ``level``: the percentage crossed.
    - ``used`` and ``cap`` in ``unit`` (integer USD micros for money): the
      total read when the crossing was seen, and the limit's cap.
    - ``shadow``: the limit never refuses (``on_exceed=ALERT``).
    - ``at``: when the evaluator saw it (epoch seconds, to the microsecond).
    """

    kind: AlertKind
    limit: str
    scope: str
    key: str
    bucket: str
    window: Window
    level: int
    used: int
    cap: int
    unit: Unit
    shadow: bool
    at: float

    @property
    def marker(self) -> str:
        """The store key that makes this alert fire once (see :func:`marker_key`)."""
        return marker_key(self.key, FORECAST if self.kind == FORECAST else self.level)

    @property
    def id(self) -> str:
        """A UUIDv5 of the marker: the same alert always has the same id."""
        return str(uuid.uuid5(_ID_NAMESPACE, self.marker))

    def data(self) -> dict[str, Any]:
        """The CloudEvent's ``data``: every field but ``at`` (which is its ``time``)."""
        return {
            "kind": self.kind,
            "limit": self.limit,
            "scope": self.scope,
            "key": self.key,
            "bucket": self.bucket,
            "window": self.window.value,
            "level": self.level,
            "used": self.used,
            "cap": self.cap,
            "unit": self.unit.value,
            "shadow": self.shadow,
        }

    def to_cloudevent(self, source: str = ALERT_SOURCE) -> dict[str, Any]:
        """The structured CloudEvents 1.0 form, as a dict."""
        return {
            "specversion": "1.0",
            "id": self.id,
            "source": source,
            "type": ALERT_TYPE,
            "time": rfc3339(self.at),
            "subject": self.key,
            "datacontenttype": "application/json",
            "data": self.data(),
        }

    def to_json(self, source: str = ALERT_SOURCE) -> bytes:
        """:meth:`to_cloudevent` as compact UTF-8 JSON (what the sinks send)."""
        return orjson.dumps(self.to_cloudevent(source))

    def describe(self) -> str:
        """A short human name: ``threshold 80% of spend user=alice 20261129``."""
        return f"{self.kind} {self.level}% of {self.limit} {self.scope} {self.bucket}"


# -- the schema (for consumers: webhook receivers, alert-topic readers) -------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AlertData(_Model):
    """The ``data`` of an ``mcpbg.alert.v1`` event."""

    kind: Literal["threshold", "breaker", "forecast"]
    limit: LimitName
    scope: Annotated[str, StringConstraints(min_length=1)]
    key: Annotated[str, StringConstraints(pattern=f"^{PREFIX}:")]
    bucket: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    window: Window
    level: Annotated[int, Field(strict=True, ge=1, le=1000)]
    used: Annotated[int, Field(strict=True)]
    cap: Annotated[int, Field(strict=True, ge=0)]
    unit: Unit
    shadow: bool


class AlertEvent(_Model):
    """An alert as a CloudEvents 1.0 structured event."""

    specversion: Literal["1.0"]
    id: Annotated[str, StringConstraints(min_length=1)]
    source: Annotated[str, StringConstraints(min_length=1)]
    type: Literal["mcpbg.alert.v1"]
    time: datetime
    subject: str | None = None
    datacontenttype: Literal["application/json"] = "application/json"
    data: AlertData


def parse_alert(raw: bytes | str) -> Alert:
    """Read back what :meth:`Alert.to_json` wrote; raises :class:`MalformedEventError`."""
    try:
        event = AlertEvent.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "event"
        raise MalformedEventError(f"{where}: {first['msg']}", raw) from None
    d = event.data
    return Alert(
        d.kind,
        d.limit,
        d.scope,
        d.key,
        d.bucket,
        d.window,
        d.level,
        d.used,
        d.cap,
        d.unit,
        d.shadow,
        event.time.timestamp(),
    )
