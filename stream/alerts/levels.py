"""Alert levels: which percentages of a limit's cap alert, and their fired-level markers."""

from __future__ import annotations

from typing import Final, Literal

from mcp_budget_governor.keys import PREFIX
from mcp_budget_governor.limits import Limit, OnExceed

#: Prefix of the fired-level markers (``<prefix>:<limit>:<scope>:<bucket>:<level>``).
ALERTED_PREFIX = f"{PREFIX}:_alerted"

AlertKind = Literal["threshold", "breaker", "forecast"]

#: The marker suffix of the forecast alert: once per counter (limit, scope, period).
FORECAST: Final = "forecast"


def marker_key(counter_key: str, level: int | str) -> str:
    """The store key recording that ``level`` fired for ``counter_key``.

    >>> marker_key("mcpbg:v1:spend:user=alice:20261129", 80)
    'mcpbg:v1:_alerted:spend:user=alice:20261129:80'
    """
    rest = counter_key.removeprefix(f"{PREFIX}:")
    return f"{ALERTED_PREFIX}:{rest}:{level}"


def alert_levels(limit: Limit) -> tuple[tuple[int, AlertKind], ...]:
    """The levels (percent, ascending) at which ``limit`` alerts, with their kind.

    >>> from mcp_budget_governor import Limit, Window
    >>> alert_levels(Limit("spend", cap=10, window=Window.DAY, breaker=True, alert_at=[50]))
    ((50, 'threshold'), (100, 'breaker'))
    """
    levels = set(limit.alert_at)
    if limit.breaker or limit.on_exceed is OnExceed.ALERT:
        levels.add(100)
    return tuple(
        (level, "breaker" if limit.breaker and level == 100 else "threshold")
        for level in sorted(levels)
    )


def crossed(used: int, cap: int, level: int) -> bool:
    """Whether a counter at ``used`` has reached ``level`` percent of ``cap``.

    Nothing is crossed at zero use (a cap of 0 is not an alert until used).

    >>> crossed(799, 1000, 80), crossed(800, 1000, 80), crossed(0, 0, 100), crossed(1, 0, 100)
    (False, True, False, True)
    """
    return used > 0 and used * 100 >= level * cap
