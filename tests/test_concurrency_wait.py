"""Waiting for a concurrency slot (``admitted(wait=)``): first come, first served.

Every backend (``backend`` fixture: memory, real Redis, real Postgres): a refused
waiting call holds a place in the lease set's queue (``keys.queue_key``; on
Postgres ``mcpbg_wait``); a slot that frees goes to the oldest waiter, never to a
caller that came later, waiting or not; past its wait a call gets the refusal (429
with a retry hint) and leaves the queue. Across processes on one Redis or one
Postgres the admission order is the arrival order.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from fastmcp import Client, FastMCP
from fastmcp.server.middleware import MiddlewareContext

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    MemoryBackend,
    Policy,
    PostgresBackend,
    RedisBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware
from mcp_budget_governor.keys import lease_key, queue_key
from testing.buckets import room

U1 = Context(user="u_1", tool="search")
LEASES = lease_key("parallel", "user=u_1")


def parallel(cap: int = 1) -> Limit:
    return Limit("parallel", cap=cap, scope=Scope.USER, unit=Unit.CONCURRENT)


async def queued(backend: Backend) -> int:
    """How many tickets wait in u_1's queue (expired ones included)."""
    if isinstance(backend, MemoryBackend):
        return len(backend._queues.get(LEASES, {}))
    if isinstance(backend, PostgresBackend):
        rows = await backend._rows("SELECT count(*) FROM mcpbg_wait WHERE key = %s", (LEASES,))
        return int(rows[0][0])
    assert isinstance(backend, RedisBackend)
    return int(await backend.client.zcard(queue_key(LEASES)))


async def until_queued(backend: Backend, n: int) -> None:
    for _ in range(2000):
        if await queued(backend) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} waiters never queued")


def test_wait_is_checked() -> None:
    gov = Governor(Policy.of(parallel()))
    for bad in (-1, "5", True, 1e9, float("nan")):
        with pytest.raises(InvalidInputError, match="wait"):
            gov.admitted(U1, wait=bad)


async def test_a_waiting_call_gets_the_slot_when_it_frees(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel()), backend)
    holder = await gov.check(U1)
    assert holder.admitted

    async def wait_for_it() -> bool:
        async with gov.admitted(U1, wait=60) as decision:
            return decision.admitted

    waiter = asyncio.ensure_future(wait_for_it())
    await until_queued(backend, 1)
    assert not waiter.done()
    await gov.release(holder)
    assert await waiter
    assert await queued(backend) == 0  # an admitted waiter leaves the queue
    (n,) = await backend.in_progress([LEASES])  # type: ignore[attr-defined]
    assert n == 0


async def test_past_the_wait_a_429_with_a_retry_hint_and_the_queue_left(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel()), backend)
    holder = await gov.check(U1)
    async with gov.admitted(U1, wait=0.2) as decision:
        assert not decision.admitted
        assert (decision.status, decision.reason) == (429, "budget_exceeded:user/concurrent")
        assert decision.retry_after is not None and decision.retry_after >= 1
    assert await queued(backend) == 0
    await gov.release(holder)


async def test_a_spend_refusal_is_not_waited_for(backend: Backend) -> None:
    burst = Limit("burst", cap=1, window=Window.MINUTE, scope=Scope.USER)
    gov = Governor(Policy.of(parallel(cap=3), burst), backend)
    await room(60, needed=10)  # both checks in one minute: the second one is refused
    assert (await gov.check(U1)).admitted
    # A window that only ends with the minute: no slot of "parallel" will help.
    decision = await gov.check(U1, wait=60)
    assert decision.limit == "burst"
    assert await queued(backend) == 0


async def test_a_freed_slot_goes_to_the_waiter_not_to_a_later_caller(backend: Backend) -> None:
    """At the script level, no polling race: a queued ticket keeps a freed slot from
    a caller that did not wait, and from a waiter who came later."""
    gov = Governor(Policy.of(parallel()), backend)
    holder = await gov.check(U1)
    ops = gov._plan(U1, gov._clock()).ops
    first, second = "first/60000", "second/60000"
    for ticket in (first, second):
        refused = await backend.charge(ops, lease="l-" + ticket, lease_ttl=30, ticket=ticket)  # type: ignore[call-arg]
        assert not refused.admitted
    assert await queued(backend) == 2
    await gov.release(holder)
    assert not (await gov.check(U1)).admitted  # the waiters come first
    later = await backend.charge(ops, lease="l-second", lease_ttl=30, ticket=second)  # type: ignore[call-arg]
    assert not later.admitted  # the second waiter is behind the first
    got = await backend.charge(ops, lease="l-first", lease_ttl=30, ticket=first)  # type: ignore[call-arg]
    assert got.admitted
    assert await queued(backend) == 1
    await backend.release([LEASES], "l-first")  # type: ignore[attr-defined]
    assert (await backend.charge(ops, lease="l-second", lease_ttl=30, ticket=second)).admitted  # type: ignore[call-arg]
    assert await queued(backend) == 0


async def test_an_expired_ticket_holds_no_place(backend: Backend) -> None:
    gov = Governor(Policy.of(parallel()), backend)
    holder = await gov.check(U1)
    ops = gov._plan(U1, gov._clock()).ops
    assert not (await backend.charge(ops, lease="x", lease_ttl=30, ticket="gone/1")).admitted  # type: ignore[call-arg]
    await gov.release(holder)
    await asyncio.sleep(0.05)  # its 1 ms wait is over: the place is free again
    assert (await gov.check(U1)).admitted


WAITER = textwrap.dedent(
    """
    import asyncio, sys
    from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Unit
    from testing.stores import backend_for

    async def main():
        url, name, order = sys.argv[1], sys.argv[2], sys.argv[3]
        backend = backend_for(url)
        pol = Policy.of(Limit("parallel", cap=1, scope=Scope.USER, unit=Unit.CONCURRENT))
        gov = Governor(pol, backend)
        async with gov.admitted(Context(user="u_1"), wait=120) as decision:
            assert decision.admitted, decision
            with open(order, "a") as f:  # one holder at a time: the cap is 1
                f.write(name + "\\n")
            await asyncio.sleep(0.05)
        await backend.aclose()

    asyncio.run(main())
    """
)


@pytest.mark.slow
async def test_across_processes_slots_go_in_arrival_order(store_url: str, tmp_path: Any) -> None:
    from testing.stores import backend_for

    redis_url = store_url
    order = tmp_path / "order"
    backend = backend_for(redis_url)
    gov = Governor(Policy.of(parallel()), backend)
    holder = await gov.check(U1)
    names = [f"p{i}" for i in range(4)]
    procs: list[subprocess.Popen[Any]] = []
    try:
        for i, name in enumerate(names):  # each joins the queue before the next starts
            argv = [sys.executable, "-c", WAITER, redis_url, name, str(order)]
            procs.append(subprocess.Popen(argv))  # noqa: ASYNC220
            await until_queued(backend, i + 1)
        # A caller that does not wait is refused while they queue, slot or not.
        assert not (await gov.check(Context(user="u_1"))).admitted
        await gov.release(holder)
        for p in procs:
            assert await asyncio.to_thread(p.wait, 120) == 0
        assert order.read_text().split() == names
        assert await queued(backend) == 0
        (n,) = await backend.in_progress([LEASES])
        assert n == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        await backend.aclose()


async def test_fastmcp_calls_that_wait_all_run_never_more_than_the_cap(backend: Backend) -> None:
    def user(context: MiddlewareContext[Any]) -> Context:
        return Context(user="u_1")

    gov = Governor(Policy.of(parallel(cap=3)), backend)
    mcp = FastMCP("governed", mask_error_details=True)
    mcp.add_middleware(BudgetMiddleware(gov, identify=user, wait=120))
    state = {"running": 0, "peak": 0}

    @mcp.tool
    async def slow() -> str:
        state["running"] += 1
        state["peak"] = max(state["peak"], state["running"])
        try:
            await asyncio.sleep(0.02)
        finally:
            state["running"] -= 1
        return "ok"

    async with Client(mcp) as client:
        answers = await asyncio.gather(*(client.call_tool("slow", {}) for _ in range(30)))
    assert [a.data for a in answers] == ["ok"] * 30  # waiting, nobody is refused
    assert 1 < state["peak"] <= 3
    assert await queued(backend) == 0
    with pytest.raises(InvalidInputError, match="wait"):
        BudgetMiddleware(gov, wait=-1)


async def test_only_the_outcome_of_a_wait_reaches_the_ledger(backend: Backend) -> None:
    from mcp_budget_governor.ledger import EntryType
    from mcp_budget_governor.producers.memory_ledger import MemoryLedger

    ledger = MemoryLedger()
    gov = Governor(Policy.of(parallel()), backend, ledger=ledger)
    holder = await gov.check(U1)
    assert not (await gov.check(U1, wait=0.3)).admitted  # many retries, one refusal

    async def later() -> None:
        await until_queued(backend, 1)
        await gov.release(holder)

    releasing = asyncio.ensure_future(later())
    async with gov.admitted(U1, wait=60) as decision:
        assert decision.admitted
    await releasing
    assert [e.type for e in ledger.entries] == [
        EntryType.ADMITTED,
        EntryType.REJECTED,
        EntryType.ADMITTED,
    ]
