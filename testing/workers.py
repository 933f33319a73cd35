"""Code that runs in child processes of the multi-process tests (importable by spawn)."""

from __future__ import annotations

import asyncio
import time

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Window


def burst_policy(cap: int) -> Policy:
    return Policy.of(
        Limit("daily", cap=10_000, window=Window.DAY, scope=Scope.USER),
        Limit("burst", cap=cap, window=Window.DAY, scope=Scope.USER),
        Limit("tenant", cap=10_000, window=Window.DAY, scope=Scope.TENANT),
    )


def concurrent_checks(url: str, cap: int, calls: int, start_at: float) -> int:
    """Fire ``calls`` concurrent checks from one process; return how many were admitted."""

    async def main() -> int:
        gov = Governor(burst_policy(cap), RedisBackend.from_url(url, timeout=5.0))
        ctx = Context(user="shared", tenant="t")
        await gov.usage("burst", ctx)  # open a connection before the start line
        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        decisions = await asyncio.gather(*(gov.check(ctx) for _ in range(calls)))
        await gov.aclose()
        return sum(d.admitted for d in decisions)

    return asyncio.run(main())
