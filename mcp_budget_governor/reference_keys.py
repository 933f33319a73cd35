"""The key strings and window arithmetic of mcp-budget-governor 0.1.0.

Its counters were plain Redis strings named ``mcpbg:<limit>:<scope>:<bucket>``
(``mcpbg:calls:user=u_42:20260805``), each bucket a UTC minute, hour or day.
Ours live at ``mcpbg:v1:...`` (``keys.counter_key``). These functions name the
reference's keys, so a migration can read what it counted
(``mcpbg migrate --from-reference``), and keep its ``keys`` functions working;
:mod:`mcp_budget_governor.keys` exports them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from .errors import InvalidInputError
from .windows import Window

#: The first segment of every reference key.
NAMESPACE = "mcpbg"

#: The shortest expiry a reference counter got: a key must outlive the call that wrote it.
MIN_TTL_SECONDS = 60

_FORMATS = {Window.MINUTE: "%Y%m%d%H%M", Window.HOUR: "%Y%m%d%H", Window.DAY: "%Y%m%d"}
_LENGTHS = {timedelta(minutes=1): Window.MINUTE, timedelta(hours=1): Window.HOUR}


def _window(window: Any) -> Window:
    if window not in _FORMATS:
        raise InvalidInputError("window", window, "the reference's windows are minute, hour, day")
    return Window(window)


def now_utc() -> datetime:
    """The current instant, timezone-aware (UTC)."""
    return datetime.now(UTC)


def bucket(window: Any, moment: datetime) -> str:
    """The reference's bucket of ``moment`` (converted to UTC first).

    >>> bucket(Window.HOUR, datetime(2026, 8, 5, 14, 30, tzinfo=UTC))
    '2026080514'
    """
    return moment.astimezone(UTC).strftime(_FORMATS[_window(window)])


def window_end(window: Any, moment: datetime) -> datetime:
    """When the bucket holding ``moment`` ends (UTC)."""
    w = _window(window)
    start = datetime.strptime(bucket(w, moment), _FORMATS[w]).replace(tzinfo=UTC)
    step = {Window.MINUTE: timedelta(minutes=1), Window.HOUR: timedelta(hours=1)}
    return start + step.get(w, timedelta(days=1))


def retry_after_seconds(window: Any, moment: datetime) -> int:
    """Whole seconds until the bucket ends (not floored: the truth, to the second)."""
    return max(0, int((window_end(window, moment) - moment).total_seconds()))


def ttl_seconds(window: Any, moment: datetime) -> int:
    """The expiry a reference counter got: :func:`retry_after_seconds`, at least
    :data:`MIN_TTL_SECONDS`."""
    return max(MIN_TTL_SECONDS, math.floor((window_end(window, moment) - moment).total_seconds()))


def reference_key(limit: Any, scope_map: Mapping[Any, str], moment: datetime) -> str:
    """The reference's key of ``limit``'s counter for ``scope_map`` (Scope -> value) at
    ``moment``. A missing value raises ``KeyError``.

    >>> from mcp_budget_governor import Limit, Scope
    >>> lim = Limit("calls", cap=1, window=Window.DAY, scope=Scope.USER)
    >>> reference_key(lim, {Scope.USER: "u_42"}, datetime(2026, 8, 5, tzinfo=UTC))
    'mcpbg:calls:user=u_42:20260805'
    """
    parts = []
    for dim in limit.dimensions:
        if dim not in scope_map:
            raise KeyError(
                f"limit {limit.name!r} is scoped to {dim.value!r}, which the context lacks"
            )
        parts.append(f"{dim.value}={scope_map[dim]}")
    return f"{NAMESPACE}:{limit.name}:{':'.join(parts) or 'global'}:{bucket(limit.window, moment)}"
