"""Code that runs in child processes of the multi-process tests (importable by spawn)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    Policy,
    PostgresBackend,
    RedisBackend,
    Scope,
    Window,
)


def shared_backend(url: str, timeout: float = 5.0) -> Backend:
    """The shared store a URL names: Postgres for postgresql://, else Redis."""
    if url.startswith(("postgresql:", "postgres:")):
        return PostgresBackend.from_url(url)  # every setting at its default (issue 31)
    return RedisBackend.from_url(url, timeout=timeout)


def burst_policy(cap: int) -> Policy:
    return Policy.of(
        Limit("daily", cap=10_000, window=Window.DAY, scope=Scope.USER),
        Limit("burst", cap=cap, window=Window.DAY, scope=Scope.USER),
        Limit("tenant", cap=10_000, window=Window.DAY, scope=Scope.TENANT),
    )


def concurrent_checks(url: str, cap: int, calls: int, start_at: float) -> int:
    """Fire ``calls`` concurrent checks from one process; return how many were admitted."""

    async def main() -> int:
        gov = Governor(burst_policy(cap), shared_backend(url))
        ctx = Context(user="shared", tenant="t")
        await gov.usage("burst", ctx)  # open a connection before the start line
        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        decisions = await asyncio.gather(*(gov.check(ctx) for _ in range(calls)))
        await gov.aclose()
        # The store decided every check: no fail mode, no busy refusal.
        assert not any(d.degraded or d.status == 503 for d in decisions)
        return sum(d.admitted for d in decisions)

    return asyncio.run(main())


def cluster_policy(tag: str = "") -> Policy:
    """A per-user cap of 50 and a global cap of 80 (the cluster tests; ``tag`` names a run)."""
    return Policy.of(
        Limit(f"cl_user{tag}", cap=50, window=Window.DAY, scope=Scope.USER),
        Limit(f"cl_global{tag}", cap=80, window=Window.DAY),
    )


def cluster_checks(
    url: str, tag: str, users: list[str], calls: int, start_at: float
) -> dict[str, int]:
    """Fire ``calls`` concurrent checks (users in turn) from one process; admitted per user."""

    async def main() -> dict[str, int]:
        gov = Governor(cluster_policy(tag), RedisBackend.from_url(url, timeout=5.0))
        await gov.usage(f"cl_global{tag}")  # connect before the start line
        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        ctxs = [Context(user=users[i % len(users)]) for i in range(calls)]
        decisions = await asyncio.gather(*(gov.check(c) for c in ctxs))
        await gov.aclose()
        out = dict.fromkeys(users, 0)
        for c, d in zip(ctxs, decisions, strict=True):
            out[c.user or ""] += d.admitted
        return out

    return asyncio.run(main())


def user_and_global_policy(per_user: int, total: int) -> Policy:
    return Policy.of(
        Limit("per_user", cap=per_user, window=Window.DAY, scope=Scope.USER),
        Limit("global", cap=total, window=Window.DAY),
    )


def user_and_global_checks(url: str, user: str, calls: int, start_at: float) -> int:
    """``calls`` concurrent checks of one user against a per-user 50 and a global 80."""

    async def main() -> int:
        gov = Governor(user_and_global_policy(50, 80), shared_backend(url))
        ctx = Context(user=user)
        await gov.usage("per_user", ctx)  # connected before the start line
        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        decisions = await asyncio.gather(*(gov.check(ctx) for _ in range(calls)))
        await gov.aclose()
        assert not any(d.degraded or d.status == 503 for d in decisions)
        return sum(d.admitted for d in decisions)

    return asyncio.run(main())


def outage_policies() -> tuple[Policy, Policy]:
    """A fail-open per-user limit and a fail-closed per-user limit, each alone."""
    from mcp_budget_governor import FailMode

    big = 10**9
    return (
        Policy.of(Limit("o_user", cap=big, window=Window.DAY, scope=Scope.USER,
                        fail_mode=FailMode.OPEN)),
        Policy.of(Limit("c_user", cap=big, window=Window.DAY, scope=Scope.USER,
                        fail_mode=FailMode.CLOSED)),
    )  # fmt: skip


def outage_checks(
    url: str, name: str, ready: Any, go: Any, seconds: float, callers: int = 16
) -> list[tuple[float, str, bool, bool, int]]:
    """Checks by ``callers`` concurrent callers of one process for ``seconds`` after
    ``go`` (a manager Event; ``ready``, a manager Queue, hears when this process is
    connected), each against a fail-open and a fail-closed limit (user ``name``),
    every setting at its default: ``(time, which, admitted, degraded, status)`` per
    decision."""

    async def main() -> list[tuple[float, str, bool, bool, int]]:
        open_policy, closed_policy = outage_policies()
        govs = {
            "open": Governor(open_policy, PostgresBackend.from_url(url)),
            "closed": Governor(closed_policy, PostgresBackend.from_url(url)),
        }
        ctx = Context(user=name)
        for gov in govs.values():
            await gov.usage(next(iter(gov.policy)).name, ctx)  # connected before the start
        ready.put(name)
        await asyncio.to_thread(go.wait)
        end_at = time.time() + seconds
        seen: list[tuple[float, str, bool, bool, int]] = []

        async def caller() -> None:
            while time.time() < end_at:
                for which, gov in govs.items():
                    d = await gov.check(ctx)
                    seen.append((time.time(), which, d.admitted, d.degraded, d.status))
                await asyncio.sleep(0.01)

        await asyncio.gather(*(caller() for _ in range(callers)))
        for gov in govs.values():
            await gov.aclose()
        return seen

    return asyncio.run(main())
