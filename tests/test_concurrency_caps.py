"""Concurrency caps: leases taken in the admission script, given back at the end of a call.

Both backends (``backend`` fixture, real Redis); a SIGKILLed process's lease
comes back after ``lease_ttl``; a real FastMCP client drives 100 calls at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from fastmcp import Client, FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.server.middleware import MiddlewareContext

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    Policy,
    PolicyError,
    RedisBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware
from mcp_budget_governor.keys import lease_key
from mcp_budget_governor.planning import check_plan
from testing.buckets import room

U1 = Context(user="u_1", tool="search")


def parallel(cap: int = 3, **kw: Any) -> Limit:
    return Limit("parallel", cap=cap, scope=Scope.USER, unit=Unit.CONCURRENT, **kw)


async def held(backend: Backend, user: str = "u_1") -> int:
    (n,) = await backend.in_progress([lease_key("parallel", f"user={user}")])  # type: ignore[attr-defined]
    return int(n)


async def until_none_held(backend: Backend, patience: float = 30.0) -> None:
    """Wait (polling: expiry is a clock, not an event) until every lease of u_1 is gone."""
    deadline = time.monotonic() + patience
    while await held(backend):
        assert time.monotonic() < deadline, "leases never expired"
        await asyncio.sleep(0.05)


def test_a_concurrency_cap_has_no_window() -> None:
    assert parallel().window is None
    with pytest.raises(PolicyError, match=r"Limit\('parallel'\)\.window: a concurrency cap"):
        parallel(window=Window.DAY)
    with pytest.raises(PolicyError, match=r"Limit\('spend'\)\.window: unknown Window"):
        Limit("spend", cap=1)


def test_leases_never_reach_the_ledger() -> None:
    pol = Policy.of(parallel(), Limit("burst", cap=9, window=Window.MINUTE, scope=Scope.USER))
    plan = check_plan(pol, U1, time.time())
    assert [c.limit for c in plan.charges] == ["burst"]
    assert plan.leases == (lease_key("parallel", "user=u_1"),)


async def test_never_more_than_the_cap_in_progress_and_all_given_back(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel(cap=3)), backend)
    running = peak = done = refused = 0

    async def one() -> None:
        nonlocal running, peak, done, refused
        while True:
            async with gov.admitted(U1) as decision:
                if decision.admitted:
                    running += 1
                    peak = max(peak, running)
                    # Hold the slot until the cap is full (or a second passed: the last
                    # callers): a slow store's round trips must not keep the peak below it.
                    waited = 0
                    while running < 3 and done < 27 and waited < 500:
                        await asyncio.sleep(0.002)
                        waited += 1
                    running -= 1
                    done += 1
                    return
                refused += 1
                assert decision.reason == "budget_exceeded:user/concurrent"
                assert decision.status == 429 and decision.retry_after == 1
            await asyncio.sleep(0.001)

    await asyncio.gather(*(one() for _ in range(30)))
    assert done == 30 and peak == 3 and refused > 0
    assert await held(backend) == 0


async def test_an_exception_and_a_cancellation_give_the_lease_back(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel(cap=1)), backend)

    async def broken() -> None:
        async with gov.admitted(U1) as decision:
            assert decision.admitted and await held(backend) == 1
            raise ValueError("the tool broke")

    with pytest.raises(ValueError, match="the tool broke"):
        await broken()
    assert await held(backend) == 0

    started = asyncio.Event()

    async def stuck() -> None:
        async with gov.admitted(U1) as decision:
            assert decision.admitted
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(stuck())
    await started.wait()
    assert not (await gov.check(U1)).admitted  # the stuck call holds the only slot
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the shielded release may finish one step later
    assert await held(backend) == 0
    assert (await gov.check(U1)).admitted


async def test_per_value_caps_apply_to_concurrency_caps(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel(cap=1, caps={"vip": 3})), backend)
    vip = Context(user="vip")
    decisions = [await gov.check(vip) for _ in range(4)]
    assert [d.admitted for d in decisions] == [True, True, True, False]
    for d in decisions:
        await gov.release(d)
    assert await held(backend, "vip") == 0


async def test_all_or_nothing_with_the_other_limits(backend: Backend) -> None:
    burst = Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER)
    gov = Governor(Policy.of(parallel(cap=1), burst), backend)
    await room(60, needed=10)  # "burst" counts per minute: every check in one bucket
    first = await gov.check(U1)
    assert first.admitted
    # Refused by the concurrency cap: the burst counter is not charged.
    second = await gov.check(U1)
    assert second.limit == "parallel" and await gov.usage("burst", U1) == 1
    assert await gov.usage("parallel", U1) == 1 and await gov.is_tripped("parallel", U1)
    await gov.release(first)
    await gov.release(first)  # twice: nothing more happens
    third = await gov.check(U1)
    assert third.admitted and await gov.usage("burst", U1) == 2
    await gov.release(third)
    # Refused by the burst cap: no lease is taken.
    fourth = await gov.check(U1)
    assert fourth.limit == "burst" and fourth.lease is None
    assert await held(backend) == 0


async def test_renewal_keeps_a_long_calls_lease(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel(cap=1)), backend, lease_ttl=0.3)
    async with gov.admitted(U1) as decision:
        assert decision.admitted
        for _ in range(5):  # 1.5 s: five lease lifetimes, renewed every 0.1 s
            await asyncio.sleep(0.3)
            assert await held(backend) == 1
            assert not (await gov.check(U1)).admitted
    assert await held(backend) == 0
    # Not renewed, a lease goes: nothing lingers for a call that never ends it.
    stale = await gov.check(U1)
    assert stale.admitted
    await until_none_held(backend)
    assert not await gov.renew(stale)  # an expired lease is never revived


HOLDER = textwrap.dedent(
    """
    import asyncio, sys, time
    from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Unit

    async def main():
        backend = RedisBackend.from_url(sys.argv[1], timeout=2.0)
        pol = Policy.of(Limit("parallel", cap=3, scope=Scope.USER, unit=Unit.CONCURRENT))
        gov = Governor(pol, backend, lease_ttl=float(sys.argv[2]))
        d = await gov.check(Context(user="u_1"))
        print("held" if d.admitted else "refused", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_a_sigkilled_process_gives_its_lease_back_after_the_ttl(redis_url: str) -> None:
    procs = [
        subprocess.Popen(  # noqa: ASYNC220 (started once, before anything awaits them)
            [sys.executable, "-c", HOLDER, redis_url, "1.5"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    try:
        for p in procs:
            assert p.stdout is not None
            assert (await asyncio.to_thread(p.stdout.readline)).strip() == "held"
        gov = Governor(Policy.of(parallel(cap=3)), backend, lease_ttl=1.5)
        assert (await gov.check(U1)).limit == "parallel"  # three processes hold the cap
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        assert await held(backend) == 3  # dead, not yet expired: nobody gave them back
        await until_none_held(backend)
        assert (await gov.check(U1)).admitted
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        await backend.aclose()


def _user(context: MiddlewareContext[Any]) -> Context | None:
    fc = context.fastmcp_context
    rc = fc.request_context if fc is not None else None
    user = (rc.meta or {}).get("user") if rc is not None else None
    return Context(user=user) if isinstance(user, str) else None


async def test_100_concurrent_fastmcp_calls_against_cap_5(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel(cap=5)), backend)
    mcp = FastMCP("governed", mask_error_details=True)
    mcp.add_middleware(BudgetMiddleware(gov, identify=_user))
    state = {"running": 0, "peak": 0, "ran": 0}

    @mcp.tool
    async def slow() -> str:
        state["running"] += 1
        state["peak"] = max(state["peak"], state["running"])
        try:
            await asyncio.sleep(0.02)
        finally:
            state["running"] -= 1
        state["ran"] += 1
        return "ok"

    async def one(client: Client[Any]) -> str:
        try:
            return str((await client.call_tool("slow", {}, meta={"user": "u_1"})).data)
        except ToolError as exc:
            return str(exc)

    async with Client(mcp) as client:
        answers = await asyncio.gather(*(one(client) for _ in range(100)))
    ok = answers.count("ok")
    assert 1 < state["peak"] <= 5 and state["ran"] == ok  # calls did overlap
    assert ok >= 5 and ok + sum("user/concurrent" in a for a in answers) == 100
    assert await held(backend) == 0


async def test_a_check_holding_a_lease_enforces_run_time_plans_and_caps(
    backend: Backend,
) -> None:
    """The lease sets' queues come after the plans hash in the script's keys: a check
    with a concurrency cap still finds the run-time plan and cap of its other limits."""
    from mcp_budget_governor import Plan

    calls = Limit("calls", cap=3, window=Window.DAY, scope=Scope.TENANT)
    pol = Policy.of(parallel(cap=1000), calls, plans=[Plan("pro", caps={"calls": 6})])
    gov = Governor(pol, backend)
    await gov.assign_plan("pro", tenant="delta")
    await gov.set_cap("calls", 4, tenant="gamma")
    for tenant, cap in (("delta", 6), ("gamma", 4), ("other", 3)):
        ctx = Context(tenant=tenant, user=f"u_{tenant}")
        decisions = [await gov.check(ctx) for _ in range(cap + 2)]
        assert sum(d.admitted for d in decisions) == cap, tenant
        assert decisions[-1].limit == "calls"
        for d in decisions:
            await gov.release(d)


async def test_the_budgets_report_shows_calls_in_progress(backend: Backend) -> None:
    from mcp_budget_governor.projections.budgets import budget_report, table_rows

    burst = Limit("burst", cap=9, window=Window.MINUTE, scope=Scope.USER)
    pol = Policy.of(parallel(cap=3, caps={"vip": 7}), burst)
    gov = Governor(pol, backend)
    await room(60, needed=10)  # the reports list this minute's "burst" counters only
    decisions = [await gov.check(U1), await gov.check(U1), await gov.check(Context(user="vip"))]
    for report in (
        await budget_report(pol, backend),
        await budget_report(pol, backend, user="u_1"),
    ):
        rows = {(r.name, r.values): r for r in report.rows}
        mine = rows[("parallel", ("u_1",))]
        assert (mine.spent, mine.cap, mine.remaining) == (2, 3, 1)
        assert mine.as_json()["window"] == "concurrent"
        assert mine.key == lease_key("parallel", "user=u_1")
        assert rows[("burst", ("u_1",))].spent == 2
        cells = dict(
            zip(("name", "scope", "key", "window", "period"), table_rows(report)[0], strict=False)
        )
        assert (cells["window"], cells["period"]) == ("concurrent", "in progress")
    everyone = await budget_report(pol, backend)
    vip = next(r for r in everyone.rows if r.values == ("vip",) and r.name == "parallel")
    assert (vip.spent, vip.cap) == (1, 7)
    for d in decisions:
        await gov.release(d)
    after = await budget_report(pol, backend)
    assert all(r.name != "parallel" for r in after.rows)  # no call in progress, no row


def test_a_policy_file_declares_a_concurrency_cap_without_a_window() -> None:
    from mcp_budget_governor.policy_file import PolicyFileError, loads

    pol = loads('[[limits]]\nname = "parallel"\ncap = 5\nscope = "user"\nunit = "concurrent"\n')
    assert pol["parallel"].concurrent and pol["parallel"].window is None
    with pytest.raises(PolicyFileError, match=r"limits\[0\]\.window.*no window"):
        loads('[[limits]]\nname = "p"\ncap = 5\nunit = "concurrent"\nwindow = "day"\n')


async def test_unreachable_counters_follow_the_fail_mode() -> None:
    dead = RedisBackend.from_url("redis://127.0.0.1:1/0", timeout=0.2)
    try:
        gov = Governor(Policy.of(parallel(cap=2)), dead)
        first, second, third = [await gov.check(U1) for _ in range(3)]
        # Fail-open: the per-replica fallback holds the cap and its leases.
        assert first.admitted and first.degraded and second.admitted
        assert third.limit == "parallel" and third.degraded
        await gov.release(first)  # the shared store is down: never raises
        assert (await gov.check(U1)).admitted
        closed = Governor(Policy.of(parallel(cap=2, fail_mode="closed")), dead)
        refused = await closed.check(U1)
        assert refused.status == 503 and refused.reason == "budget_unavailable:user/concurrent"
    finally:
        await dead.aclose()
