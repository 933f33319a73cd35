"""How long counters and operation markers live, on MemoryBackend and on a real Redis.

An inline charge carries an operation id: a replay of one that landed changes
nothing, on both backends, for as long as its counters live. MemoryBackend
(also the fail-open fallback during an outage) evicts what has expired, as
Redis does, so its memory follows the live buckets.
"""

from __future__ import annotations

import time

import redis

from mcp_budget_governor import Backend, Limit, MemoryBackend, Policy, Scope, Window
from mcp_budget_governor.context import Context
from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, CounterOp
from mcp_budget_governor.keys import OP_HORIZON_SECONDS, OP_PREFIX, op_key
from mcp_budget_governor.planning import slot

DAY = Limit("per_user", cap=10, window=Window.DAY, scope=Scope.USER)
MINUTE = Limit("burst", cap=10, window=Window.MINUTE, scope=Scope.USER)
POLICY = Policy.of(DAY, MINUTE)


def ops_for(user: str, now: float, amount: int, *, enforce: bool = False) -> list[CounterOp]:
    out = []
    for lim in (DAY, MINUTE):
        s = slot(lim, Context(user=user), now, POLICY.tz, amount, enforce=enforce)
        assert s is not None
        out.append(s.op)
    return out


async def test_a_charge_replayed_under_its_operation_id_counts_once(backend: Backend) -> None:
    now = time.time()  # one instant: keys planned later must name the same minute
    ops = ops_for("alice", now, 3)
    keys = [op.key for op in ops]
    first = await backend.charge(ops, op_id="op-1")
    assert first.admitted
    replay = await backend.charge(ops, op_id="op-1", want_used=False)
    assert replay.admitted
    assert await backend.usage(keys) == [3, 3]
    assert (await backend.charge(ops, op_id="op-2")).admitted
    assert await backend.usage(keys) == [6, 6]
    # A refused charge writes nothing, its id included: the same id may land later.
    big = ops_for("alice", now, 5, enforce=True)
    assert not (await backend.charge(big, op_id="op-3")).admitted
    small = ops_for("alice", now, 4, enforce=True)
    assert (await backend.charge(small, op_id="op-3")).admitted
    assert (await backend.charge(small, op_id="op-3")).admitted
    assert await backend.usage(keys) == [10, 10]
    # An event id (ledger mode) is not an operation id: in flight, moved by the projection.
    assert (await backend.charge(ops_for("bob", now, 1), event_id="e-1")).admitted


def test_the_lua_horizon_is_the_python_one() -> None:
    from mcp_budget_governor.lua import source

    assert f"local OP_HORIZON = {OP_HORIZON_SECONDS}\n" in source("charge")


def test_the_redis_marker_lives_for_the_horizon(redis_url: str) -> None:
    import asyncio

    from mcp_budget_governor import RedisBackend

    ops = ops_for("carol", time.time(), 2)

    async def charge() -> None:
        backend = RedisBackend.from_url(redis_url, timeout=2.0)
        await backend.charge(ops, op_id="op-ttl")
        await backend.charge([CounterOp(ops[0].key, 0, 10, True, ops[0].expire_at)], op_id="z")
        await backend.aclose()

    asyncio.run(charge())
    client = redis.Redis.from_url(redis_url)
    try:
        assert OP_HORIZON_SECONDS - 5 <= client.ttl(op_key("op-ttl")) <= OP_HORIZON_SECONDS
        assert op_key("op-ttl").startswith(OP_PREFIX + ":")
        assert client.exists(op_key("z")) == 0  # a charge that wrote nothing leaves no marker
    finally:
        client.close()


def test_a_window_counter_keeps_its_first_expiry_a_session_counter_slides(redis_url: str) -> None:
    """charge.lua sets a counter's expiry when it creates it (the same atomic call) and
    moves it only for a session counter (flag 's'), whose life runs from its last write."""
    import asyncio

    from mcp_budget_governor import RedisBackend

    now = time.time()
    chat = Limit("chat", cap=100, window=Window.SESSION, scope=Scope.SESSION)
    window = ops_for("dora", now, 1)[0]
    s = slot(chat, Context(user="dora", session="s_1"), now, POLICY.tz, 1, enforce=True)
    assert s is not None
    session = s.op
    assert session.key.endswith(":session") and not window.key.endswith(":session")
    first, later = int(now) + 1000, int(now) + 5000

    async def charge() -> None:
        backend = RedisBackend.from_url(redis_url, timeout=2.0)
        for expire_at in (first, later):
            for op in (window, session):
                ops = [CounterOp(op.key, 1, 100, True, expire_at)]
                assert (await backend.charge(ops, op_id=f"{op.key}{expire_at}")).admitted
        refused = [CounterOp(window.key, 500, 100, True, later)]
        assert not (await backend.charge(refused, op_id="refused")).admitted
        await backend.aclose()

    asyncio.run(charge())
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.expiretime(window.key) == first
        assert client.expiretime(session.key) == later
        assert client.exists(op_key("refused")) == 0  # a refused charge gives its marker back
    finally:
        client.close()


def test_the_lua_session_suffix_is_the_python_one() -> None:
    from mcp_budget_governor.keys import SESSION_SUFFIX
    from mcp_budget_governor.lua import source

    assert f"local SESSION_SUFFIX = '{SESSION_SUFFIX}'\n" in source("charge")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_memory_backend_evicts_counters_of_past_buckets() -> None:
    clock = Clock(time.time())
    backend = MemoryBackend(clock=clock)
    old = ops_for("alice", clock.now, 1)
    await backend.charge(old, op_id="op-old")
    applied = AppliedEvent(0, "e-old", clock.now, (AppliedCharge(old[0].key, 2, old[0].expire_at),))
    await backend.apply("p:0", [applied])
    assert sorted(backend._counters) == sorted(op.key for op in old)
    # Past the minute bucket's end plus grace, the minute counter is gone on the next
    # write, without being read; past the day's, every one, and the marker and seen set.
    clock.now = old[1].expire_at
    await backend.charge(ops_for("bob", clock.now, 1))
    assert old[1].key not in backend._counters and old[0].key in backend._counters
    clock.now = max(old[0].expire_at, applied.seen_expire_at) + 1
    await backend.charge(ops_for("bob", clock.now, 1))
    assert old[0].key not in backend._counters
    assert "op-old" not in backend._ops and not backend._seen
    # A replay of the old operation now lands in the new buckets: its window is over.
    assert await backend.usage([op.key for op in old]) == [0, 0]


async def test_memory_backend_stays_bounded_under_many_buckets() -> None:
    clock = Clock(time.time())
    backend = MemoryBackend(clock=clock)
    live = []
    for minute in range(3000):
        clock.now += 60
        for user in ("a", "b", "c"):
            await backend.charge(ops_for(user, clock.now, 1), op_id=f"{minute}{user}")
        live.append(len(backend._counters))
    # Three users' day counters plus the minute counters still inside their hour of
    # grace: bounded by the live buckets, not by the 9,000 minute buckets written.
    grace_minutes = (ops_for("a", clock.now, 1)[1].expire_at - clock.now) // 60 + 2
    bound = 3 * (2 + 2) + 3 * grace_minutes
    assert max(live[-500:]) <= bound < 9000
    assert len(backend._ops) <= 3 * (OP_HORIZON_SECONDS // 60 + 1)
    assert len(backend._expiry) <= len(backend._counters) + len(backend._ops)
