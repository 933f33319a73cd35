"""Keep a real-time test inside one bucket of a fixed window.

A test on the wall clock that counts calls against a per-minute cap fails when
the minute turns mid-run: the new bucket admits the cap again. ``room`` sleeps
into the next bucket first when the current one has too little time left.

>>> seconds_to_wait(60, needed=10, now=1_800_000_055.0)  # 5 s left of the minute
5.05
>>> seconds_to_wait(60, needed=10, now=1_800_000_010.0)
0.0
"""

from __future__ import annotations

import asyncio
import time

MARGIN = 0.05  # past the boundary, so the first call is surely in the new bucket


def seconds_to_wait(window: int, needed: float, now: float | None = None) -> float:
    """How long to sleep so that ``needed`` seconds fit in one UTC bucket of ``window``
    seconds (a minute's or an hour's buckets start on multiples of it)."""
    now = time.time() if now is None else now
    left = window - now % window
    return round(left + MARGIN, 6) if left < needed else 0.0


async def room(window: int, needed: float) -> None:
    """Sleep, if need be, until ``needed`` seconds fit in the current bucket of ``window``."""
    await asyncio.sleep(seconds_to_wait(window, needed))
