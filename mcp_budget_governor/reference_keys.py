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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from .context import Context
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
    ``moment``, the scope's dimensions in their declared order. A missing value
    raises ``KeyError``.

    >>> from mcp_budget_governor import Limit, Scope
    >>> lim = Limit("calls", cap=1, window=Window.DAY, scope=Scope.USER)
    >>> reference_key(lim, {Scope.USER: "u_42"}, datetime(2026, 8, 5, tzinfo=UTC))
    'mcpbg:calls:user=u_42:20260805'
    """
    parts = []
    for dim in limit.declared_dimensions:  # the reference kept the declared order
        if dim not in scope_map:
            raise KeyError(
                f"limit {limit.name!r} is scoped to {dim.value!r}, which the context lacks"
            )
        parts.append(f"{dim.value}={scope_map[dim]}")
    return f"{NAMESPACE}:{limit.name}:{':'.join(parts) or 'global'}:{bucket(limit.window, moment)}"


@dataclass(frozen=True, slots=True)
class ReferenceCounter:
    """A counter of the reference's, read as ours: the ``limit`` of a policy, the
    context its key names, and the instant its bucket starts (UTC)."""

    key: str
    limit: Any  # a Limit (limits imports keys, which imports this module)
    ctx: Context
    start: datetime


def parse_reference_key(key: str, policy: Any) -> ReferenceCounter | None:
    """The counter ``key`` names if it is a reference key of a limit of ``policy`` with
    the same window and scope dimensions; None otherwise (ours, another limit's, a
    window or scope that changed, a value that cannot be a context's).

    >>> from mcp_budget_governor import Limit, Policy, Scope
    >>> p = Policy.of(Limit("calls", cap=9, window=Window.DAY, scope=(Scope.USER, Scope.TOOL)))
    >>> c = parse_reference_key("mcpbg:calls:tool=search:user=u:42:20260805", p)
    >>> c.ctx.user, c.ctx.tool, c.start.isoformat()
    ('u:42', 'search', '2026-08-05T00:00:00+00:00')
    >>> parse_reference_key("mcpbg:v1:calls:user=u:20260805", p) is None
    True
    """
    prefix = NAMESPACE + ":"
    if not key.startswith(prefix) or key.startswith(prefix + "v1:"):
        return None
    name, _, rest = key[len(prefix) :].partition(":")
    middle, _, stamp = rest.rpartition(":")
    if name not in policy:
        return None
    limit = policy[name]
    window = {8: Window.DAY, 10: Window.HOUR, 12: Window.MINUTE}.get(len(stamp))
    if window is None or limit.window is not window or not stamp.isdigit():
        return None
    try:
        start = datetime.strptime(stamp, _FORMATS[window]).replace(tzinfo=UTC)
    except ValueError:
        return None
    dims = {d.value for d in limit.dimensions}
    values: dict[str, str] = {}
    if not dims:
        if middle != "global":
            return None
    else:
        # "user=u:42:tool=search": a fragment starts where a dimension's name and "="
        # follow a colon; anything else is part of the value before it.
        names = "|".join(sorted(dims))
        for found in re.finditer(rf"(?:^|:)({names})=(.*?)(?=:(?:{names})=|$)", middle):
            values[found.group(1)] = found.group(2)
        rebuilt = ":".join(f"{d}={v}" for d, v in values.items())  # in the key's order
        if set(values) != dims or rebuilt != middle:
            return None
    try:
        ctx = Context(**values)
    except InvalidInputError:
        return None
    return ReferenceCounter(key, limit, ctx, start)
