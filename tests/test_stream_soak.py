"""Soak: 100,000 ledger events, the projecting worker SIGKILLed twice, counters exact.

The issue's done-when, as one test: "after a 100,000-event run during which a
worker is SIGKILLed twice, every Redis counter equals the sum of its ledger
charges (checked over all keys) and nothing is left in-flight".

- Own services: a private local Redis and a private local broker (memory
  storage: the broker is not killed), a fresh topic of six partitions.
- Producer, in the test's event loop: a Governor on RedisBackend (the hot path
  writes in-flight amounts) with the Kafka ledger, running a mixed workload —
  checks from many users, tenants, tools and sessions (some refused), meters,
  token meters priced by a PriceTable, reservations settled, released or
  refused — paced to a steady rate until exactly ``EVENTS`` events were
  appended.
- Workers, as in production (``python -m mcp_budget_governor.cli worker``
  subprocesses in one group): A runs until about a third of the events were
  produced and is SIGKILLed mid-run; B takes over and is SIGKILLed at about
  two thirds; C catches up and is stopped with SIGTERM. The producer never
  gets past a ceiling the test lifts after each kill, so both kills land while
  events are still coming, whatever the machine's speed.
- Caught up: the topic is read back (``read_topic``, whose fetched highwater
  marks say where each partition ends) and every partition's Redis watermark
  must reach its last offset.
- Conservation over all keys: each counter named by a ledger charge (each
  event id once: a producer retry may put an event on the topic twice) has
  committed == the sum of its charges, no in-flight total and no pending
  entry; and a SCAN of Redis finds no counter the ledger does not explain.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    LimitExceeded,
    Policy,
    PriceTable,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.keys import EPOCH_KEY, PREFIX, SEEN_PREFIX, WATERMARK_KEY
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.stream.alerts import ALERTED_PREFIX
from mcp_budget_governor.stream.topic_reader import read_topic
from testing.services import (
    KafkaService,
    RedisService,
    redis_binary,
    start_kafka,
    start_redis,
    tansu_binary,
)
from testing.stream_support import (
    Worker,
    applied_offsets,
    both_engines,
    charge_totals,
    engine,
    tenants,
    unique_events,
    wait_watermarks,
    watermarks,
    worker_argv,
    worker_env,
    worker_logs,
)

pytest.importorskip("mcp_budget_governor.stream.worker", reason="the worker needs the stream extra")

__all__ = ["engine"]  # a fixture, used by name

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(tansu_binary() is None, reason="no local Kafka-protocol broker (tansu)"),
    pytest.mark.skipif(redis_binary() is None, reason="no local Redis binary"),
]

EVENTS = 100_000
PARTITIONS = 6
RATE = 3_000  # events/s the producer aims at: a third of the run outlasts a takeover
CONCURRENCY = 8  # producer coroutines (concurrent hot-path calls)
FIRST_KILL, SECOND_KILL = EVENTS // 3, 2 * EVENTS // 3
PHASE_TIMEOUT = 90.0  # seconds any one phase may take before the test gives up
MODEL = "soak-model"

TENANTS = tenants(PARTITIONS, 8, "tenant-")
# Skewed: the big tenants exhaust their spend early (reservations refused), the small never.
TENANT_WEIGHTS = [8, 4, 2] + [1] * (len(TENANTS) - 3)
USERS = [f"user-{i}" for i in range(24)]
TOOLS = ["search", "fetch", "write:file", "exec"]  # a separator in a scope value, too


def policy() -> Policy:
    return Policy.of(
        Limit("user_minute", cap=1_200, window=Window.MINUTE, scope=Scope.USER),
        Limit("user_tool_hour", cap=500, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
        Limit("session_calls", cap=40, window=Window.SESSION),
        Limit("tenant_day", cap=10**9, window=Window.DAY, scope=Scope.TENANT),
        Limit("all_minute", cap=10**9, window=Window.MINUTE),  # one hot global key
        Limit(
            "spend",
            cap=usd(60),
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
        # Gated with a zero charge: check() reads it, meter_tokens() counts into it.
        Limit("tokens", cap=10**12, window=Window.DAY, unit=Unit.TOKENS, scope=Scope.USER),
    )


PRICES = PriceTable().with_price(MODEL, 3, 15, 0.3, 3.75)


# -- the producer -------------------------------------------------------------


@dataclass
class Production:
    """Exactly ``target`` ledger events at about ``rate`` a second, never past ``ceiling``.

    Each operation claims the events it will append before it starts (a
    reservation two, given back one if it is refused), so the run ends on
    ``target`` exactly however many coroutines share it.
    """

    target: int
    rate: float
    ceiling: int
    claimed: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return self.claimed >= self.target


async def produce(gov: Governor, prod: Production, seed: int) -> None:
    rng = random.Random(seed)
    while not prod.done:
        ahead = prod.claimed / prod.rate - (time.monotonic() - prod.started)
        if ahead < -0.25:  # behind the pace (held at the ceiling): no burst to catch up
            prod.started += -0.25 - ahead
            ahead = -0.25
        if prod.claimed >= prod.ceiling or ahead > 0:
            await asyncio.sleep(max(ahead, 0.02) if prod.claimed < prod.ceiling else 0.05)
            continue
        user = rng.choice(USERS)
        ctx = Context(
            user=user,
            tenant=rng.choices(TENANTS, TENANT_WEIGHTS)[0],
            tool=rng.choice(TOOLS),
            session=f"{user}/s{rng.randrange(16)}" if rng.random() < 0.4 else None,
        )
        op = rng.random()
        if op < 0.5:
            prod.claimed += 1
            decision = await gov.check(ctx)
            prod.ops["admitted" if decision.admitted else "rejected"] += 1
        elif op < 0.7:
            prod.claimed += 1
            await gov.meter("spend", rng.randrange(1, 40_000), ctx)
            prod.ops["metered"] += 1
        elif op < 0.82:
            prod.claimed += 1
            inp, out = rng.randrange(0, 4_000), rng.randrange(0, 1_000)
            limit = "spend" if rng.random() < 0.5 else "tokens"
            await gov.meter_tokens(
                limit,
                MODEL,
                input_tokens=inp,
                output_tokens=out,
                cache_read_tokens=rng.randrange(0, inp + 1),
                ctx=ctx,
            )
            prod.ops[f"tokens:{limit}"] += 1
        elif prod.target - prod.claimed >= 2:
            prod.claimed += 2  # reserved + settled or released
            try:
                async with gov.reserved("spend", 25_000, ctx) as r:
                    if rng.random() < 0.3:
                        r.release()
                        prod.ops["released"] += 1
                    else:
                        r.actual = rng.randrange(0, 60_000)
                        prod.ops["settled"] += 1
            except LimitExceeded:
                prod.claimed -= 1  # refused: one event (rejected), not two
                prod.ops["reservation refused"] += 1


# -- the workers --------------------------------------------------------------


@dataclass
class Setup:
    kafka: KafkaService
    redis: RedisService
    backend: RedisBackend
    topic: str
    group: str
    tmp: Path
    engine: str
    workers: list[Worker] = field(default_factory=list)

    def start_worker(self, name: str) -> Worker:
        tmp = self.tmp / f"worker-{name}-tmp"
        tmp.mkdir()
        argv = worker_argv(
            self.topic, self.group,
            "--kafka-url", f"kafka://{self.kafka.bootstrap}",
            "--redis-url", self.redis.url,
            "--progress-interval", "1",
            "--topic-wait", "30",
            "--engine", self.engine,
        )  # fmt: skip
        worker = Worker(name, self.tmp / f"worker-{name}.log", argv, worker_env(tmp))
        self.workers.append(worker)
        return worker

    def logs(self) -> str:
        return worker_logs(self.workers)

    async def watermarks(self) -> dict[int, int]:
        return await watermarks(self.backend, self.topic)

    async def applied(self) -> int:
        return await applied_offsets(self.backend, self.topic)


@pytest.fixture
async def setup(tmp_path: Path, engine: str) -> AsyncIterator[Setup]:
    redis_svc = start_redis(prefer_local=True)
    try:
        kafka = start_kafka(prefer_local=True)
    except BaseException:
        redis_svc.stop()
        raise
    backend = RedisBackend.from_url(redis_svc.url, timeout=10.0)
    tag = uuid.uuid4().hex[:10]
    s = Setup(kafka, redis_svc, backend, f"soak-{tag}", f"soak-{tag}", tmp_path, engine)
    try:
        yield s
    finally:
        for w in s.workers:
            w.kill()
        with contextlib.suppress(Exception):
            await backend.aclose()
        kafka.stop()
        redis_svc.stop()


async def until(
    setup: Setup,
    condition: Callable[[], Awaitable[bool]],
    what: str,
    within: float = PHASE_TIMEOUT,
) -> None:
    """Poll ``condition()`` until true; fail with the watermarks and logs after ``within``."""
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            marks = await setup.watermarks()
            pytest.fail(f"{what}: not within {within:g}s (watermarks {marks})\n{setup.logs()}")
        await asyncio.sleep(0.1)


# -- the test -----------------------------------------------------------------


@both_engines
async def test_100k_events_two_sigkills_every_counter_exact(setup: Setup) -> None:
    t0 = time.monotonic()
    timeline: list[str] = []

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f}s {what}")

    ledger = KafkaLedger(
        setup.kafka.bootstrap,
        topic=setup.topic,
        partitions=PARTITIONS,
        outbox_dir=setup.tmp / "outbox",
    )
    gov = Governor(policy(), setup.backend, ledger=ledger, prices=PRICES)
    prod = Production(EVENTS, RATE, ceiling=int(EVENTS * 0.42))
    producing = asyncio.gather(*(produce(gov, prod, seed) for seed in range(CONCURRENCY)))

    async def shipped() -> bool:
        return ledger.stats.shipped > 0  # so the ledger has created the topic

    async def producer_alive() -> None:
        if producing.done():
            producing.result()  # re-raises what stopped the producer
            pytest.fail(f"the producer finished early ({prod.claimed} events)")

    async def produced_all() -> bool:
        if not producing.done():
            return False
        producing.result()
        return True

    def due(worker: Worker, threshold: int) -> Callable[[], Awaitable[bool]]:
        """Once ``worker`` holds every partition, has applied 1,000 events itself and
        ``threshold`` events were produced: a kill then lands in the middle of its work."""
        assigned: list[int] = []

        async def condition() -> bool:
            await producer_alive()
            resumed = worker.resumed_at()
            if resumed is None or set(resumed) != set(range(PARTITIONS)):
                return False
            if not assigned:
                assigned.append(sum(resumed.values()))
                mark(f"worker {worker.name} holds every partition, resuming at {assigned[0]}")
            applied = await setup.applied()
            return prod.claimed >= threshold and applied >= sum(resumed.values()) + 1_000

        return condition

    try:
        await until(setup, shipped, "the ledger ships its first events", 30)
        a = setup.start_worker("A")
        mark("worker A started")
        await until(setup, due(a, FIRST_KILL), "worker A: a third produced, 1,000 applied")
        a.kill()
        killed_a = (prod.claimed, await setup.applied())
        prod.ceiling = int(EVENTS * 0.75)
        mark(f"worker A SIGKILLed: {killed_a[0]} produced, {killed_a[1]} applied")

        # B takes over once the dead member's session has ended.
        b = setup.start_worker("B")
        await until(setup, due(b, SECOND_KILL), "worker B: two thirds produced, 1,000 applied")
        b.kill()
        killed_b = (prod.claimed, await setup.applied())
        prod.ceiling = EVENTS
        mark(f"worker B SIGKILLed: {killed_b[0]} produced, {killed_b[1]} applied")

        c = setup.start_worker("C")
        await until(setup, produced_all, "the producer appends every event")
        assert await ledger.flush(60.0), f"the ledger did not ship everything: {ledger.stats}"
        mark(f"producer done: {ledger.stats.appended} events, {dict(prod.ops)}")
    finally:
        prod.claimed = prod.target  # stops the producer should the test have failed
        with contextlib.suppress(Exception):
            await producing
        await ledger.aclose()

    assert ledger.stats.appended == EVENTS, ledger.stats
    records = await read_topic(setup.kafka.bootstrap, setup.topic, idle_timeout=10.0)
    mark(f"topic read: {len(records)} records, highwater {records.highwater}")
    assert records.caught_up, f"the topic could not be read to its end: {records.highwater}"
    assert records.malformed == 0
    assert set(records.highwater) == set(range(PARTITIONS))
    assert sum(records.highwater.values()) == len(records)  # every record is a valid event
    await wait_watermarks(setup.backend, setup.topic, records, PHASE_TIMEOUT, setup.logs, 0.2)
    mark(f"worker C caught up (resumed at {sum((c.resumed_at() or {}).values())})")
    assert c.terminate() == 0, c.tail()
    mark("worker C stopped (SIGTERM)")

    # Each new worker resumed from the Redis watermarks, not from the start.
    for worker, killed in ((b, killed_a), (c, killed_b)):
        resumed = worker.resumed_at()
        assert resumed is not None and set(resumed) == set(range(PARTITIONS)), worker.tail()
        assert sum(resumed.values()) >= killed[1], (resumed, killed, worker.tail())
    for w in setup.workers:
        assert "Traceback" not in w.text(), w.tail(200)

    # -- conservation over every key -------------------------------------------
    events = unique_events(records)  # a producer retry may put an event on the topic twice
    totals = charge_totals(events)
    kinds = Counter(event.type.split(".")[1] for event in events)
    assert len(events) == EVENTS, (len(events), len(records))
    for kind in ("admitted", "rejected", "metered", "reserved", "settled", "released"):
        assert kinds[kind] > 0, f"the workload made no {kind} event: {kinds}"

    wrong = []
    for key, total in totals.items():
        state = await setup.backend.state(key)
        if (state.committed, state.in_flight, state.pending) != (total, 0, {}):
            wrong.append((key, total, state))
    assert not wrong, f"{len(wrong)} of {len(totals)} counters differ from the ledger: {wrong[:10]}"

    # Every counter in Redis, without the projection's own keys (watermarks, epoch
    # marker, seen-id sets, alert markers).
    stored = set()
    async for raw in setup.backend.client.scan_iter(match=f"{PREFIX}:*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        if key not in (WATERMARK_KEY, EPOCH_KEY) and not key.startswith(
            (f"{SEEN_PREFIX}:", f"{ALERTED_PREFIX}:")
        ):
            stored.add(key)
    unexplained = sorted(stored - totals.keys())
    assert not unexplained, f"counters the ledger does not explain: {unexplained[:10]}"
    mark(
        f"checked {len(totals)} ledger keys ({len(stored)} counters in Redis), "
        f"{len(records) - len(events)} duplicate records, events {dict(kinds)}"
    )
    print("\n".join(["", *timeline]))
