"""``stream/retry.py``: the worker's one retry loop, without services."""

from __future__ import annotations

import asyncio

import pytest

from mcp_budget_governor.stream.retry import (
    MAX_BACKOFF,
    Stopping,
    backoff,
    sleep_unless_stopping,
    until_done,
)


def test_backoff_doubles_then_stays_at_the_cap_however_long_the_outage() -> None:
    assert [backoff(n) for n in (1, 2, 3, 4)] == [0.2, 0.4, 0.8, 1.6]
    assert backoff(6) == MAX_BACKOFF
    # 0.1 * 2**1100 is past a float's range: an uncapped exponent raised
    # OverflowError after about 1,024 failed attempts (some 85 minutes at 5 s).
    assert backoff(1_100) == backoff(10**6) == MAX_BACKOFF


async def test_until_done_retries_every_failure_and_reports_each() -> None:
    outcomes: list[Exception | str] = [ConnectionError("down"), ValueError("odd"), "applied"]
    reported: list[tuple[str, int, float]] = []

    async def attempt() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def failed(exc: Exception, number: int, delay: float) -> None:
        reported.append((type(exc).__name__, number, delay))

    assert await until_done(attempt, asyncio.Event(), failed, base=0.0001) == "applied"
    assert reported == [("ConnectionError", 1, 0.0002), ("ValueError", 2, 0.0004)]


async def test_a_stop_ends_the_wait_and_the_attempt_is_not_made_again() -> None:
    stopping = asyncio.Event()
    calls = 0

    async def attempt() -> None:
        nonlocal calls
        calls += 1
        stopping.set()  # told to stop while this attempt fails
        raise ConnectionError("down")

    with pytest.raises(Stopping):
        await until_done(attempt, stopping, lambda *_: None)
    assert calls == 1


async def test_stopping_from_inside_an_attempt_is_not_retried() -> None:
    reported: list[int] = []

    async def attempt() -> None:
        raise Stopping

    with pytest.raises(Stopping):
        await until_done(attempt, asyncio.Event(), lambda exc, n, d: reported.append(n))
    assert reported == []


async def test_sleep_unless_stopping_returns_when_not_stopped() -> None:
    await sleep_unless_stopping(asyncio.Event(), 0.0)
    stopped = asyncio.Event()
    stopped.set()
    with pytest.raises(Stopping):
        await sleep_unless_stopping(stopped, 60.0)  # set already: no wait
