"""Spend forecast: when a counter reaches its cap at the rate it has been spent this period.

The rate is the period's own: what was counted since the period began, over the
time since then, so a forecast needs nothing but the counter and its bucket.
Pure: ``mcpbg budgets`` shows it, the stream worker alerts on it.

>>> day = (0.0, 86_400.0)
>>> exhausts_at(spent=500, cap=1_000, start=day[0], end=day[1], now=21_600.0)  # 6 h: half
43200.0
>>> projected_before_end(500, 1_000, *day, now=21_600.0)
True
>>> projected_before_end(100, 1_000, *day, now=21_600.0)  # 2.4 days at this rate
False
"""

from __future__ import annotations


def exhausts_at(
    spent: int, cap: int, start: float | None, end: float | None, now: float
) -> float | None:
    """The Unix time the counter reaches ``cap`` at its rate since ``start``; None when
    there is no rate yet (nothing spent, the period just began), no calendar period
    (a session, a concurrency cap), or it is spent already."""
    if start is None or end is None or spent <= 0 or now <= start or spent >= cap:
        return None
    rate = spent / (now - start)
    return now + (cap - spent) / rate


def projected_before_end(
    spent: int, cap: int, start: float | None, end: float | None, now: float
) -> bool:
    """Whether the counter is projected to reach ``cap`` before its period ends."""
    at = exhausts_at(spent, cap, start, end, now)
    return at is not None and end is not None and at < end
