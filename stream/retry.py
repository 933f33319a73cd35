"""Retry until done, with capped exponential backoff, unless the worker is told to stop.

The worker never skips a batch: applying it, reading the watermarks at an
assignment and rebuilding an emptied Redis are each retried until they
succeed; a stop request ends the wait with :class:`Stopping`.

>>> import asyncio
>>> tries = []
>>> async def flaky() -> str:
...     tries.append(1)
...     if len(tries) < 3:
...         raise ConnectionError("down")
...     return "done"
>>> asyncio.run(until_done(flaky, asyncio.Event(), lambda exc, n, delay: None, base=0.001))
'done'
>>> len(tries), [backoff(n) for n in (1, 2, 3, 10, 10_000)]
(3, [0.2, 0.4, 0.8, 5.0, 5.0])
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["MAX_BACKOFF", "Stopping", "backoff", "sleep_unless_stopping", "until_done"]

T = TypeVar("T")

#: The longest pause between two retries (seconds).
MAX_BACKOFF = 5.0
#: The first pause is twice this (seconds).
BASE = 0.1
# 2**6 * BASE is past MAX_BACKOFF already; capping the exponent keeps a retry
# loop of days (a long outage) from overflowing a float.
_MAX_EXPONENT = 32


class Stopping(Exception):
    """The worker was told to stop while something was being retried."""


def backoff(attempt: int, base: float = BASE, cap: float = MAX_BACKOFF) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1, 2, ...): doubling, capped."""
    return min(base * 2.0 ** min(attempt, _MAX_EXPONENT), cap)


async def sleep_unless_stopping(stopping: asyncio.Event, delay: float) -> None:
    """Wait ``delay`` seconds; raise :class:`Stopping` once ``stopping`` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), delay)
    if stopping.is_set():
        raise Stopping


async def until_done(
    attempt: Callable[[], Awaitable[T]],
    stopping: asyncio.Event,
    failed: Callable[[Exception, int, float], None],
    *,
    base: float = BASE,
) -> T:
    """Await ``attempt()`` until it returns; after each failure call
    ``failed(exc, attempt_number, delay)`` (to log it) and wait ``delay``.

    :class:`Stopping` from ``attempt`` or from the wait ends it (re-raised);
    cancellation too (it is not an ``Exception``).
    """
    number = 0
    while True:
        try:
            return await attempt()
        except Stopping:
            raise
        except Exception as exc:  # every failure: retry, the caller's rule
            number += 1
            delay = backoff(number, base)
            failed(exc, number, delay)
            await sleep_unless_stopping(stopping, delay)
