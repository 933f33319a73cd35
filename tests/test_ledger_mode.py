"""With a ledger the hot path writes in-flight amounts; projection commits them once."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    LimitExceeded,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.producers.memory_ledger import MemoryLedger


def policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=5, window=Window.MINUTE, scope=Scope.USER),
        Limit("daily", cap=40, window=Window.DAY, scope=Scope.USER),
        Limit(
            "spend", cap=usd(2), window=Window.DAY, unit=Unit.USD_MICROS, breaker=True, gated=False
        ),
    )


async def mixed_run(gov: Governor, n: int, seed: int = 7) -> dict[str, int]:
    rng = random.Random(seed)
    done: dict[str, int] = defaultdict(int)
    for _ in range(n):
        ctx = Context(user=f"u{rng.randrange(4)}")
        op = rng.random()
        if op < 0.6:
            d = await gov.check(ctx)
            done["admitted" if d.admitted else "rejected"] += 1
        elif op < 0.85:
            await gov.meter("spend", rng.randrange(1, 50_000), ctx)
            done["metered"] += 1
        else:
            try:
                async with gov.reserved("spend", 20_000, ctx) as r:
                    r.actual = rng.randrange(0, 40_000)
                done["reserved"] += 1
            except LimitExceeded:
                done["rejected"] += 1
    return done


async def test_in_flight_then_projection_conserves_every_charge(backend: Backend) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    done = await mixed_run(gov, 400)
    keys = sorted({c.key for e in ledger.entries for c in e.charges})
    live_before = await backend.usage(keys)

    # Every operation is in the ledger once, with a unique id.
    ids = [e.id for e in ledger.entries]
    assert len(ids) == len(set(ids))
    kinds: dict[str, int] = defaultdict(int)
    for e in ledger.entries:
        kinds[e.type.value] += 1
    assert kinds["admitted"] == done["admitted"]
    assert kinds["rejected"] == done["rejected"]
    assert kinds["metered"] == done["metered"]
    assert kinds["reserved"] == done["reserved"]
    assert all(not e.charges for e in ledger.entries if e.type is EntryType.REJECTED)

    # Before projection everything is in flight and nothing committed.
    states = [await backend.state(k) for k in keys]
    assert all(s.committed == 0 for s in states)

    assert await ledger.project(backend) == len(ledger.entries)
    totals: dict[str, int] = defaultdict(int)
    for e in ledger.entries:
        for c in e.charges:
            totals[c.key] += c.amount
    for key in keys:
        state = await backend.state(key)
        assert (state.committed, state.in_flight, state.pending) == (totals[key], 0, {})
    # The hot path saw the same totals before projection as after: nothing moved twice.
    assert await backend.usage(keys) == live_before == [totals[k] for k in keys]

    # Idempotent projection: replaying all, or any part, changes nothing.
    assert await ledger.project(backend) == 0
    assert await ledger.project(backend, start=len(ledger.entries) // 2) == 0
    assert await backend.usage(keys) == [totals[k] for k in keys]


async def test_projection_of_events_the_hot_path_never_saw(backend: Backend) -> None:
    """Events from emit-only producers (no in-flight entry here) are simply committed."""
    from mcp_budget_governor import MemoryBackend

    source = MemoryLedger()
    emitter = Governor(policy(), MemoryBackend(), ledger=source)
    await emitter.meter("spend", 1234, Context(user="x"))
    await emitter.meter("spend", 766, Context(user="y"))
    assert await backend.apply("elsewhere:0", source.events()) == 2
    reader = Governor(policy(), backend)
    assert await reader.usage("spend") == 2000
    state = await backend.state(source.entries[0].charges[0].key)
    assert (state.committed, state.in_flight, state.pending) == (2000, 0, {})
    assert await backend.apply("elsewhere:0", source.events()) == 0
    assert await reader.usage("spend") == 2000


async def test_an_event_delivered_twice_at_new_offsets_counts_once(backend: Backend) -> None:
    """A producer retry can put one event on the topic twice; its id is applied once."""
    from dataclasses import replace

    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    for user in ("a", "b", "a"):
        await gov.meter("spend", 1000, Context(user=user))
        await gov.check(Context(user=user))
    events = ledger.events()
    assert await backend.apply("p:0", events) == len(events)
    total = await gov.usage("spend")
    # The same events again, further down the partition (a re-sent batch).
    again = [replace(e, offset=e.offset + 100) for e in events]
    assert await backend.apply("p:0", again) == 0
    assert await gov.usage("spend") == total == 3000
    assert await gov.usage("daily", Context(user="a")) == 2


async def test_projection_refuses_a_store_that_lost_its_state(backend: Backend) -> None:
    """A flushed or restarted store applies nothing until it is rebuilt and marked ready."""
    import pytest

    from mcp_budget_governor.errors import EpochMissingError

    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    await gov.meter("spend", 700, Context(user="a"))
    assert not await backend.has_epoch()  # type: ignore[attr-defined]
    with pytest.raises(EpochMissingError):
        await backend.apply("p:0", ledger.events(), require_epoch=True)
    state = await backend.state(ledger.entries[0].charges[0].key)
    assert (state.committed, state.in_flight) == (0, 700)  # nothing moved
    await backend.mark_ready("epoch-1")  # type: ignore[attr-defined]
    assert await backend.apply("p:0", ledger.events(), require_epoch=True) == 1
    assert await gov.usage("spend") == 700


async def test_hot_path_never_admits_from_a_flushed_redis(redis_url: str) -> None:
    """With require_epoch, a Redis without the worker's marker counts as unreachable."""
    import redis as redis_sync

    from mcp_budget_governor import FailMode, RedisBackend

    strict = Policy.of(
        Limit("closed", cap=100, window=Window.DAY, scope=Scope.USER, fail_mode=FailMode.CLOSED)
    )
    backend = RedisBackend.from_url(redis_url, require_epoch=True, timeout=2.0)
    gov = Governor(strict, backend, ledger=MemoryLedger(), retry_interval=0.01)
    ctx = Context(user="a")
    d = await gov.check(ctx)
    assert (d.admitted, d.status, d.degraded) == (False, 503, True)
    await backend.mark_ready("epoch-1")
    await asyncio.sleep(0.02)
    assert (await gov.check(ctx)).admitted
    redis_sync.Redis.from_url(redis_url).flushdb()  # Redis loses everything (this test's db)
    await asyncio.sleep(0.02)
    d = await gov.check(ctx)
    assert (d.admitted, d.status, d.degraded) == (False, 503, True)
    await gov.aclose()


class PreparingLedger(MemoryLedger):
    """A ledger that prepares: records what it was asked to prepare."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[object] = []

    def prepare(self, entry: object) -> None:
        self.prepared.append(entry)


async def test_the_prepared_entry_is_appended_only_when_it_is_the_outcome(redis_url: str) -> None:
    """check() hands the ledger the likely entry while the counters' reply is on its
    way; the append is that very entry on a plain admission, and a fresh one when
    Redis refuses (nothing prepared is appended unless it is the outcome)."""
    from mcp_budget_governor import RedisBackend

    ctx = Context(user=f"prep-{random.randrange(1 << 30)}")
    ledger = PreparingLedger()
    now = time.time()  # both governors in one minute: the second one's check is refused
    gov = Governor(
        policy(), RedisBackend.from_url(redis_url, timeout=2.0), ledger=ledger, clock=lambda: now
    )
    try:
        decisions = [await gov.check(ctx) for _ in range(5)]  # burst: 5 a minute
    finally:
        await gov.aclose()
    assert all(d.admitted for d in decisions)
    assert [e.type for e in ledger.entries] == [EntryType.ADMITTED] * 5
    # (the first check connects: its charge could not be written at once)
    assert len(ledger.prepared) >= 4
    appended = {e.id: e for e in ledger.entries}
    for prepared in ledger.prepared:
        assert appended[prepared.id] is prepared  # type: ignore[attr-defined]

    # A new governor knows nothing locally: Redis refuses its check.
    other = PreparingLedger()
    gov = Governor(
        policy(), RedisBackend.from_url(redis_url, timeout=2.0), ledger=other, clock=lambda: now
    )
    try:
        assert (await gov.check(Context(user=f"{ctx.user}-warm-up"))).admitted  # connects
        refused = await gov.check(ctx)
    finally:
        await gov.aclose()
    assert not refused.admitted
    entry = other.entries[-1]
    prepared = other.prepared[-1]
    assert entry is not prepared and entry.id == prepared.id  # type: ignore[attr-defined]
    assert entry.type is EntryType.REJECTED and entry.limit == "burst" and not entry.charges


async def test_a_refused_caller_is_not_encoded_ahead_until_admitted_again(redis_url: str) -> None:
    """A refused check's admitted event, prepared ahead, is thrown away: the caller's next
    checks prepare none (one encoding each, the refusal's) until one is admitted, after
    which the admissions are prepared ahead again."""
    import redis as redis_sync

    from mcp_budget_governor import RedisBackend

    ctx = Context(user=f"refused-{random.randrange(1 << 30)}")
    ledger = PreparingLedger()
    now = time.time()  # one minute's "burst": the refusals hold until the flush
    gov = Governor(
        policy(), RedisBackend.from_url(redis_url, timeout=2.0), ledger=ledger, clock=lambda: now
    )
    try:
        assert all([(await gov.check(ctx)).admitted for _ in range(5)])  # burst: 5 a minute
        before = len(ledger.prepared)
        assert not any([(await gov.check(ctx)).admitted for _ in range(3)])
        assert len(ledger.prepared) == before + 1  # the first refusal's only
        redis_sync.Redis.from_url(redis_url).flushdb()  # the burst forgotten: admitted again
        assert (await gov.check(ctx)).admitted  # (not prepared: it was expected refused)
        assert len(ledger.prepared) == before + 1
        assert (await gov.check(ctx)).admitted
        assert len(ledger.prepared) == before + 2
    finally:
        await gov.aclose()
    kinds = [e.type for e in ledger.entries]
    assert kinds == [EntryType.ADMITTED] * 5 + [EntryType.REJECTED] * 3 + [EntryType.ADMITTED] * 2
    last = ledger.entries[-1]
    assert last is ledger.prepared[-1]  # appended as prepared
