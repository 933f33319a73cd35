"""A turn's plain checks on Redis go as one call of charge_many.lua.

Checks written while others are in flight on the shared connection are sent,
up to ``autopipe.BATCH_CALLS`` at a time, as one EVALSHA of charge_many.lua,
which runs charge.lua for each in arrival order (tests/test_charge_many.py
holds the two scripts to the same replies and counters). These tests hold the
connection's side: each check gets its own decision, one check's error is its
own, a Redis that lost the script is served alone and given it again, one that
refuses it is not asked on every check, and a connection lost under a batch
leaves every check to its fail mode. Each runs on a private Redis, so the
server's command counts are this test's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window
from mcp_budget_governor.counters import Charge, CounterOp
from mcp_budget_governor.projections.counters import autopipe, redis_scripts
from mcp_budget_governor.projections.counters.redis import RedisBackend
from testing.services import RedisService, start_redis

FAR = 4_102_444_800
CALLERS = 64


@pytest.fixture
def private() -> Iterator[RedisService]:
    service = start_redis(prefer_local=True)  # the command counts are the server's
    try:
        yield service
    finally:
        service.stop()


def evalshas(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        stats: dict[str, Any] = client.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    finally:
        client.close()


def policy(cap: int) -> Policy:
    return Policy.of(Limit("calls", cap=cap, window=Window.DAY, scope=Scope.USER))


async def burst(gov: Governor, n: int) -> list[bool]:
    ctx = Context(user="u1", tool="search")
    decisions = await asyncio.gather(*(gov.check(ctx) for _ in range(n)))
    assert not any(d.degraded for d in decisions)
    return [d.admitted for d in decisions]


async def loaded(backend: RedisBackend) -> None:
    """Checks until charge_many.lua is in: the first connects, the next loads it."""
    gov = Governor(policy(10**9), backend)
    for _ in range(100):
        await gov.check(Context(user="warm"))
        if backend._batched.ready:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("charge_many.lua was never loaded")


async def test_a_burst_goes_in_batches_and_each_check_gets_its_own_decision(
    private: RedisService,
) -> None:
    backend = RedisBackend.from_url(private.url)
    try:
        await loaded(backend)
        before = evalshas(private.url)
        admitted = await burst(Governor(policy(40), backend), CALLERS)
        calls = evalshas(private.url) - before
        # The first check goes alone (nothing in flight); the others wait in a batch.
        assert calls <= 1 + -(-(CALLERS - 1) // autopipe.BATCH_CALLS)
        assert sum(admitted) == 40  # exactly the cap: each check decided in its turn
        assert admitted == [True] * 40 + [False] * (CALLERS - 40)  # in arrival order
        assert await Governor(policy(40), backend).usage("calls", Context(user="u1")) == 40
    finally:
        await backend.aclose()


async def test_batching_is_off_until_the_script_is_in_and_a_lone_check_goes_alone(
    private: RedisService,
) -> None:
    backend = RedisBackend.from_url(private.url)
    sent: list[int] = []
    many = autopipe.Batched.many

    def counting(self: autopipe.Batched, parts: list[autopipe.Part]) -> bytes:
        sent.append(len(parts))
        return many(self, parts)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(autopipe.Batched, "many", counting)
            gov = Governor(policy(10**9), backend)
            await gov.check(Context(user="u1"))  # connects; charge_many.lua is not in yet
            assert sent == []
            await loaded(backend)
            for _ in range(3):
                await gov.check(Context(user="u1"))  # alone: charge.lua, no batch
            assert sent == []
            await burst(gov, 20)
            assert sent and all(1 < n <= autopipe.BATCH_CALLS for n in sent)
    finally:
        await backend.aclose()


async def test_an_error_reply_is_its_own_checks_alone(private: RedisService) -> None:
    """A counter key holding a string (a stray write): its check gets Redis' error,
    the checks batched with it are counted as if it were not there."""
    backend = RedisBackend.from_url(private.url)
    client = redis.Redis.from_url(private.url)
    try:
        await loaded(backend)
        client.set("mcpbg:v1:bad:user=x:d1", "not a counter")
        good = [CounterOp(f"mcpbg:v1:ok:user=u{i}:d1", 1, 10, True, FAR) for i in range(6)]
        bad = CounterOp("mcpbg:v1:bad:user=x:d1", 1, 10, True, FAR)
        charges = [Charge([op], None, True, f"op{i}") for i, op in enumerate(good)]
        charges.insert(3, Charge([bad], None, True, "op-bad"))
        await backend.charge_held(Charge(good[:1], None, True, "op-first"))  # in flight: batch
        replies = [backend.charge_held(c) for c in charges]
        assert all(r is not None for r in replies)
        outcomes = []
        for reply, c in zip(replies, charges, strict=True):
            assert reply is not None
            await asyncio.wait([reply])
            try:
                result = backend.held_result(reply, c)
                outcomes.append(result if not asyncio.iscoroutine(result) else await result)
            except redis.ResponseError as exc:
                outcomes.append(exc)
        assert isinstance(outcomes[3], redis.ResponseError) and "WRONGTYPE" in str(outcomes[3])
        assert all(o.admitted for i, o in enumerate(outcomes) if i != 3)  # type: ignore[union-attr]
        assert await backend.usage([op.key for op in good]) == [2, 1, 1, 1, 1, 1]
        assert client.get("mcpbg:v1:bad:user=x:d1") == b"not a counter"
    finally:
        client.close()
        await backend.aclose()


async def test_a_redis_that_lost_the_script_serves_each_check_and_gets_it_again(
    private: RedisService,
) -> None:
    backend = RedisBackend.from_url(private.url)
    client = redis.Redis.from_url(private.url)
    try:
        await loaded(backend)
        gov = Governor(policy(30), backend)
        client.script_flush()  # a restart or a SCRIPT FLUSH: both scripts gone
        admitted = await burst(gov, 50)  # a batch meets NOSCRIPT: each check alone, EVAL
        assert sum(admitted) == 30
        assert not backend._batched.ready
        await burst(gov, 2)  # the next check loads it again
        await loaded(backend)
        assert backend._batched.ready
        assert client.script_exists(backend._many.sha) == [True]
        admitted = await burst(Governor(policy(30), backend), 10)
        assert not any(admitted)  # still exactly 30, nothing counted twice or lost
        assert await gov.usage("calls", Context(user="u1")) == 30
    finally:
        client.close()
        await backend.aclose()


async def test_a_redis_that_refuses_the_script_is_asked_again_only_after_a_while(
    private: RedisService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user whose ACL forbids SCRIPT LOAD (some managed services): checks go alone,
    and the script is asked for once, then again only after ``MANY_RETRY`` seconds
    (0.3 here instead of 60, so that the second ask comes within the test)."""
    monkeypatch.setattr(redis_scripts, "MANY_RETRY", 0.3)
    admin = redis.Redis.from_url(private.url)
    admin.acl_setuser(
        "noload", enabled=True, nopass=True, keys=["*"], commands=["+@all", "-script|load"]
    )
    url = private.url.replace("redis://", "redis://noload:x@")
    backend = RedisBackend.from_url(url)

    def asked() -> int:
        # ACL LOG folds repeats of one refusal into one entry and counts them.
        refused = [e for e in admin.acl_log(count=50) if e.get("object") == "script|load"]
        return sum(int(e["count"]) for e in refused)

    try:
        gov = Governor(policy(25), backend)
        for _ in range(3):
            await gov.check(Context(user="u0"))
        admitted = await burst(gov, 40)
        assert sum(admitted) == 25
        assert not backend._batched.ready
        stats: dict[str, Any] = admin.info("commandstats")
        assert stats.get("cmdstat_script|load", {}).get("calls", 0) == 0
        assert asked() == 1
        await asyncio.sleep(0.35)
        await burst(gov, 5)
        assert asked() == 2
    finally:
        admin.close()
        await backend.aclose()


async def test_a_connection_lost_under_a_batch_leaves_each_check_to_its_fail_mode(
    private: RedisService,
) -> None:
    backend = RedisBackend.from_url(private.url)
    try:
        await loaded(backend)
        pipe = backend._pipe()
        gov = Governor(policy(10**9), backend)
        checks = [asyncio.ensure_future(gov.check(Context(user="u1"))) for _ in range(20)]
        await asyncio.sleep(0)  # all written: one alone, the rest in batches
        assert pipe.waiters
        pipe.fail(ConnectionError("redis connection lost"))
        decisions = await asyncio.gather(*checks)
        assert all(d.degraded for d in decisions[1:])  # decided by the fail mode, none raised
    finally:
        await backend.aclose()
