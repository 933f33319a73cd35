"""A plain check without a ledger, on Redis, awaits its reply in its caller's task.

Its charge is written at once (``RedisScripts.charge_held``), so it reaches the
counters whatever the caller does next; the reply comes back in a
:class:`~mcp_budget_governor.shielding.Held` future, which a cancellation of its
awaiter does not drop. So the check needs no task of its own (the step task of
``shielding.finished``, a third of a check's Python time at 64 callers:
benchmarks/README.md, bench_check). Everything else (a ledger, leases, a wait, an
approval, a price, an observer, a backend whose ``charge`` is overridden) still
runs as a step of its own; these tests hold both sides of that line.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Unit, Window
from mcp_budget_governor import admission as admission_module
from mcp_budget_governor.projections.counters.redis import RedisBackend
from mcp_budget_governor.shielding import Held, reply_of
from testing.delay_proxy import DelayProxy, behind_proxy, target_of

#: Each of the store's replies arrives this late, so a cancellation a few
#: milliseconds into a check lands while its charge is on the wire.
STORE_DELAY = 0.040
INSTANTS = [0.002 + 0.056 * i / 29 for i in range(30)]


def policy() -> Policy:
    return Policy.of(
        Limit("calls", cap=1_000_000, window=Window.DAY, scope=Scope.USER),
        Limit("global", cap=1_000_000, window=Window.HOUR),
    )


async def test_a_held_reply_outlives_its_awaiters_cancellation() -> None:
    reply: Held[str] = Held(loop=asyncio.get_running_loop())
    waiting = asyncio.ensure_future(reply_of(reply))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the cancellation waits for the reply
    reply.set_result("charged")
    cancelled = await waiting
    assert isinstance(cancelled, asyncio.CancelledError)
    assert reply.result() == "charged"


async def test_a_held_reply_keeps_its_error_for_the_reader() -> None:
    reply: Held[str] = Held(loop=asyncio.get_running_loop())
    reply.set_exception(ConnectionError("redis connection lost"))
    assert await reply_of(reply) is None
    assert isinstance(reply.exception(), ConnectionError)


def _no_step(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the check ran as a step of its own")


async def test_a_plain_check_on_redis_runs_in_its_callers_task(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gov = Governor(policy(), RedisBackend.from_url(redis_url))
    try:
        await gov.check(Context(user="inline"))  # the first one connects: a step
        monkeypatch.setattr(admission_module, "finished", _no_step)
        decision = await gov.check(Context(user="inline"))
        assert decision.admitted and decision.remaining["calls"] == 1_000_000 - 2
    finally:
        await gov.aclose()


class _Counting(RedisBackend):
    charges = 0

    async def charge(self, *args: Any, **kwargs: Any) -> Any:
        type(self).charges += 1
        return await super().charge(*args, **kwargs)


async def test_a_backend_that_overrides_charge_keeps_its_charge(redis_url: str) -> None:
    gov = Governor(policy(), _Counting.from_url(redis_url))
    try:
        for _ in range(3):  # the first connects; the others would be written at once
            assert (await gov.check(Context(user="wrapped"))).admitted
        assert _Counting.charges == 3
    finally:
        await gov.aclose()


async def test_an_instance_whose_charge_is_replaced_keeps_it(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url)
    gov = Governor(policy(), backend)
    calls: list[object] = []
    original = backend.charge

    async def charge(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return await original(*args, **kwargs)

    backend.charge = charge  # type: ignore[method-assign]
    try:
        for _ in range(3):
            assert (await gov.check(Context(user="replaced"))).admitted
        assert len(calls) == 3
    finally:
        await gov.aclose()


async def test_checks_cancelled_while_their_charge_is_on_the_wire_count_once_and_raise(
    redis_url: str,
) -> None:
    """Each check is cancelled 2 to 58 ms in, its reply 40 ms away: the ones cancelled
    before the reply raise the cancellation, the later ones return; every check is
    counted once, and nothing is left for the loop's exception handler."""
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    with DelayProxy(*target_of(redis_url), delay=STORE_DELAY) as proxy:
        gov = Governor(policy(), RedisBackend.from_url(behind_proxy(redis_url, proxy)))
        watch = Governor(policy(), RedisBackend.from_url(redis_url))
        ctx = Context(user="swept")
        try:
            await gov.check(ctx)  # connected, scripts loaded
            before = await watch.usage("global")

            async def cancelled_at(instant: float) -> bool:
                task = asyncio.ensure_future(gov.check(ctx))
                await asyncio.sleep(instant)
                task.cancel()
                try:
                    decision = await task
                except asyncio.CancelledError:
                    return True
                assert decision.admitted
                return False

            outcomes = await asyncio.gather(*(cancelled_at(t) for t in INSTANTS))
            assert sum(outcomes) >= len(INSTANTS) // 2  # most were cancelled mid-way
            assert await watch.usage("global") == before + len(INSTANTS)
            assert await watch.usage("calls", ctx) == before + len(INSTANTS)
        finally:
            await watch.aclose()
            await gov.aclose()
    assert errors == []


async def test_a_check_in_a_cancelled_anyio_scope_is_counted(redis_url: str) -> None:
    """Under anyio (the MCP SDK's cancel scopes) the reply is awaited in a shielded
    scope: the scope's cancellation lands after it, the check counted."""
    with DelayProxy(*target_of(redis_url), delay=STORE_DELAY) as proxy:
        gov = Governor(policy(), RedisBackend.from_url(behind_proxy(redis_url, proxy)))
        watch = Governor(policy(), RedisBackend.from_url(redis_url))
        ctx = Context(user="scoped")
        try:
            await gov.check(ctx)
            before = await watch.usage("calls", ctx)
            for instant in (0.005, 0.02, 0.035):
                with anyio.move_on_after(instant) as scope:
                    await gov.check(ctx)
                    await anyio.sleep(1)  # reached only past the reply: cancelled here
                assert scope.cancelled_caught
            assert await watch.usage("calls", ctx) == before + 3
        finally:
            await watch.aclose()
            await gov.aclose()


async def test_a_charge_whose_connection_drops_goes_to_the_fail_mode(
    redis_url: str,
) -> None:
    """The reply is an error (the store went away with the charge on the wire): the
    check is decided by the outage rules, as a step of its own, not raised."""
    with DelayProxy(*target_of(redis_url), delay=STORE_DELAY) as proxy:
        gov = Governor(
            Policy.of(Limit("calls", cap=10, window=Window.DAY, unit=Unit.CALLS)),
            RedisBackend.from_url(behind_proxy(redis_url, proxy)),
        )
        try:
            await gov.check(Context(user="dropped"))
            pending = asyncio.ensure_future(gov.check(Context(user="dropped")))
            await asyncio.sleep(0.01)
            proxy.stop()  # the connection drops before the reply
            decision = await pending
            assert decision.degraded
        finally:
            await gov.aclose()
