"""Invariant 1: N concurrent calls from P processes against cap C admit exactly min(N, C)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from mcp_budget_governor import Backend, Context, Governor
from testing.workers import burst_policy, concurrent_checks


@pytest.mark.slow
def test_four_processes_125_concurrent_checks_cap_50_admit_exactly_50(redis_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0  # every process is connected and waiting by then
    with ctx.Pool(4) as pool:
        admitted = pool.starmap(concurrent_checks, [(redis_url, 50, 125, start_at)] * 4)
    assert sum(admitted) == 50
    assert all(0 <= a <= 50 for a in admitted)

    async def usage() -> tuple[int, int]:
        from mcp_budget_governor import RedisBackend

        gov = Governor(burst_policy(50), RedisBackend.from_url(redis_url))
        c = Context(user="shared", tenant="t")
        result = (await gov.usage("burst", c), await gov.usage("daily", c))
        await gov.aclose()
        return result

    # Rejected calls charged nothing: the daily counter saw exactly the admitted 50.
    assert asyncio.run(usage()) == (50, 50)


@pytest.mark.parametrize("calls", [10, 50, 500])
async def test_concurrent_checks_in_one_process(backend: Backend, calls: int) -> None:
    gov = Governor(burst_policy(50), backend)
    ctx = Context(user="shared", tenant="t")
    decisions = await asyncio.gather(*(gov.check(ctx) for _ in range(calls)))
    assert sum(d.admitted for d in decisions) == min(calls, 50)
    assert await gov.usage("daily", ctx) == min(calls, 50)
