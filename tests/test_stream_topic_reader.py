"""TopicReader on a real Kafka-protocol broker: the paths read_topic does not take.

Record-by-record use, its lifecycle rules, reading some partitions only,
naming what is missing, the idle-timeout fallback (``caught_up=False`` and a
WARNING naming the partitions), and malformed records (tombstones included)
reaching a caller's ``on_malformed`` instead of the log. Each test uses a
fresh topic on the broker ``services.start_kafka`` finds or starts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Iterator
from datetime import UTC

import pytest
from aiokafka import AIOKafkaProducer

from mcp_budget_governor import Context, Limit, Unit, Window, planning
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id
from mcp_budget_governor.stream import topic_reader
from mcp_budget_governor.stream.topic_reader import (
    TopicNotFoundError,
    TopicReader,
    TopicRecord,
    read_topic,
)
from testing.services import KafkaService, start_kafka, tansu_binary
from testing.stream_support import create_topic

LOGGER = "mcp_budget_governor.stream.topic_reader"
Malformed = tuple[int, int, bytes | None, str]


@pytest.fixture(scope="module")
def kafka() -> Iterator[KafkaService]:
    svc = start_kafka()
    yield svc
    svc.stop()


def fresh_topic(name: str) -> str:
    return f"test.reader.{name}.{uuid.uuid4().hex[:10]}"


def event(i: int) -> bytes:
    """A valid ledger event (a metered charge) as the producers encode it."""
    now = time.time()
    spend = Limit("spend", cap=10**9, window=Window.DAY, unit=Unit.USD_MICROS)
    ctx = Context(user=f"u{i}")
    (charge,) = planning.ledger_charges(planning.meter_slots([(spend, i + 1)], ctx, now, UTC))
    entry = LedgerEntry(new_id(), EntryType.METERED, now, ctx, (charge,))
    return encode(entry, "/test")


async def produce(
    bootstrap: str, topic: str, records: list[tuple[int, bytes | None, bytes | None]]
) -> list[tuple[int, int]]:
    """Send ``(partition, key, value)`` records one by one; their (partition, offset)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        out = []
        for partition, key, value in records:
            meta = await producer.send_and_wait(topic, value, key=key, partition=partition)
            out.append((meta.partition, meta.offset))
        return out
    finally:
        await producer.stop()


# --------------------------------------------------------------------------- #
# record by record
# --------------------------------------------------------------------------- #


async def test_reader_yields_every_partition_in_offset_order(kafka: KafkaService) -> None:
    topic = fresh_topic("iterate")
    await create_topic(kafka.bootstrap, topic, 3)
    values = {(p, i): event(10 * p + i) for p in range(3) for i in range(4 - p)}  # 4, 3, 2
    t0 = int(time.time() * 1000)
    sent = await produce(
        kafka.bootstrap, topic, [(p, b"k%d" % p, v) for (p, _), v in sorted(values.items())]
    )
    t1 = int(time.time() * 1000)

    seen: list[TopicRecord] = []
    async with TopicReader(kafka.bootstrap, topic) as reader:
        async for record in reader:
            seen.append(record)
    assert reader.caught_up and reader.malformed == 0
    assert reader.count == len(seen) == len(values)
    assert reader.highwater == {0: 4, 1: 3, 2: 2}
    assert sorted((r.partition, r.offset) for r in seen) == sorted(sent)
    for p in range(3):
        offsets = [r.offset for r in seen if r.partition == p]
        assert offsets == sorted(offsets) == list(range(4 - p))  # in order, from the earliest
    for r in seen:
        assert r.key == b"k%d" % r.partition
        assert r.event.data.charges[0].amount == 10 * r.partition + r.offset + 1
        assert r.timestamp is not None and t0 - 1000 <= r.timestamp <= t1 + 1000


async def test_a_reader_starts_once_reads_once_and_stops_cleanly(kafka: KafkaService) -> None:
    topic = fresh_topic("lifecycle")
    await create_topic(kafka.bootstrap, topic, 1)
    await produce(kafka.bootstrap, topic, [(0, None, event(1))])

    reader = TopicReader(kafka.bootstrap, topic)
    with pytest.raises(RuntimeError, match="use 'async with'"):
        aiter(reader)
    await reader.stop()  # stopping a reader that never started: nothing to do
    await reader.start()
    await reader.start()  # a second start keeps the one connection
    try:
        assert [r.offset async for r in reader] == [0]
        with pytest.raises(RuntimeError, match="reads the topic once; make another"):
            aiter(reader)
    finally:
        await reader.stop()
    await reader.stop()
    with pytest.raises(RuntimeError, match="use 'async with'"):
        aiter(reader)  # stopped: no silent empty read either


async def test_partitions_restricts_the_read(kafka: KafkaService) -> None:
    topic = fresh_topic("subset")
    await create_topic(kafka.bootstrap, topic, 3)
    await produce(kafka.bootstrap, topic, [(p, None, event(p)) for p in (0, 1, 2, 2)])

    records = await read_topic(kafka.bootstrap, topic, partitions=[2, 0, 2])
    assert records.caught_up
    assert sorted((r.partition, r.offset) for r in records) == [(0, 0), (2, 0), (2, 1)]
    assert records.highwater == {0: 1, 2: 2}  # partition 1 was not read at all


@pytest.mark.parametrize(
    ("exists", "partitions", "message"),
    [
        (True, [0, 5, 7], r"has no partition \[5, 7\] \(it has \[0, 1\]\)"),
        (False, None, r"not found on \S+ within 0\.3s"),
    ],
    ids=["missing-partitions", "unknown-topic"],
)
async def test_what_is_missing_is_named(
    kafka: KafkaService, exists: bool, partitions: list[int] | None, message: str
) -> None:
    topic = fresh_topic("missing")
    if exists:
        await create_topic(kafka.bootstrap, topic, 2)
    reader = TopicReader(kafka.bootstrap, topic, partitions=partitions, topic_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(TopicNotFoundError, match=message) as info:
        async with reader:
            pytest.fail("the reader must not start")
    assert time.monotonic() - started < 5
    assert repr(topic) in str(info.value)
    assert isinstance(info.value, LookupError)
    with pytest.raises(RuntimeError, match="use 'async with'"):
        aiter(reader)
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert leftover == [], "the failed start left aiokafka tasks running"


# --------------------------------------------------------------------------- #
# the idle-timeout fallback
# --------------------------------------------------------------------------- #


async def test_a_broker_that_holds_its_fetches_ends_the_read_after_idle_timeout(
    kafka: KafkaService, caplog: pytest.LogCaptureFixture
) -> None:
    """No fetch answer (so no highwater mark) within idle_timeout: the read stops,
    says it is not caught up, and a WARNING names each unconfirmed partition."""
    topic = fresh_topic("held")
    await create_topic(kafka.bootstrap, topic, 2)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    started = time.monotonic()
    # An empty topic and a broker told to hold each fetch for 1.5 s.
    records = await read_topic(kafka.bootstrap, topic, idle_timeout=0.4, fetch_max_wait_ms=1500)
    elapsed = time.monotonic() - started
    assert list(records) == [] and records.malformed == 0
    assert records.caught_up is False
    assert records.highwater == {}
    assert 0.4 <= elapsed < 1.5, elapsed  # before the held fetch would have answered
    (warning,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert warning.startswith(f"topic {topic}: no record for 0.4 s")
    assert "{0: 'at 0, highwater None', 1: 'at 0, highwater None'}" in warning
    assert "the read may be incomplete" in warning


@pytest.mark.skipif(tansu_binary() is None, reason="needs a private tansu broker to kill")
async def test_a_broker_lost_mid_read_gives_a_partial_result(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = start_kafka(prefer_local=True)  # private: this test kills it
    try:
        topic = fresh_topic("lost")
        await create_topic(broker.bootstrap, topic, 1)
        await produce(broker.bootstrap, topic, [(0, None, event(i)) for i in range(5)])
        caplog.set_level(logging.WARNING, logger=LOGGER)
        offsets: list[int] = []
        reader = TopicReader(
            broker.bootstrap,
            topic,
            idle_timeout=0.5,
            # One record batch per fetch, so the read is partway when the broker dies.
            max_partition_fetch_bytes=1,
            fetch_max_bytes=1,
            request_timeout_ms=1000,
        )
        try:
            async with reader:
                async for record in reader:
                    offsets.append(record.offset)
                    if len(offsets) == 2:
                        broker.kill()
        except asyncio.CancelledError:
            pytest.fail("leaving 'async with TopicReader' raised CancelledError; nothing cancelled")
        assert offsets == [0, 1]
        assert reader.caught_up is False and reader.highwater == {0: 5}
        assert any(
            "{0: 'at 2, highwater 5'}" in r.getMessage() for r in caplog.records if r.name == LOGGER
        )
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert leftover == [], "the reader left aiokafka tasks running"
    finally:
        broker.stop()


# --------------------------------------------------------------------------- #
# malformed records
# --------------------------------------------------------------------------- #


async def test_on_malformed_gets_partition_offset_raw_and_reason_instead_of_a_warning(
    kafka: KafkaService, caplog: pytest.LogCaptureFixture
) -> None:
    topic = fresh_topic("malformed")
    await create_topic(kafka.bootstrap, topic, 2)
    bad: list[tuple[int, bytes | None]] = [
        (0, None),  # a tombstone
        (1, b"\xff not json"),
        (0, b'{"specversion": "1.0"}'),
        (1, b"[]"),
    ]
    valid = [(p, None, event(p)) for p in (0, 1)]
    sent = await produce(
        kafka.bootstrap, topic, [valid[0], *[(p, b"junk", v) for p, v in bad], valid[1]]
    )
    where = dict(zip(sent[1:-1], (v for _, v in bad), strict=True))

    reported: list[Malformed] = []
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with TopicReader(
        kafka.bootstrap, topic, on_malformed=lambda *a: reported.append(a)
    ) as reader:
        good = [(r.partition, r.offset) async for r in reader]
    assert sorted(good) == sorted([sent[0], sent[-1]])
    assert reader.caught_up and reader.count == 2 and reader.malformed == len(bad)
    assert {(p, o): raw for p, o, raw, _ in reported} == where
    reasons = {raw: reason for _, _, raw, reason in reported}
    assert reasons[None] == "no value (a tombstone or a null record)"
    assert all(isinstance(reason, str) and reason for reason in reasons.values())
    # The caller's handler replaces the default WARNING: nothing is logged twice.
    assert [r for r in caplog.records if r.name == LOGGER] == []


async def test_an_unexpected_parse_error_is_reported_and_reading_goes_on(
    kafka: KafkaService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ValueError that is not a schema verdict (a parser bug, say) costs one record."""
    topic = fresh_topic("parser-bug")
    await create_topic(kafka.bootstrap, topic, 1)
    values = [event(i) for i in range(3)]
    await produce(kafka.bootstrap, topic, [(0, None, v) for v in values])
    real_parse = topic_reader.parse

    def parse(raw: bytes | str) -> object:
        if raw == values[1]:
            raise ValueError("boom")
        return real_parse(raw)

    monkeypatch.setattr(topic_reader, "parse", parse)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    records = await read_topic(kafka.bootstrap, topic)
    assert [r.offset for r in records] == [0, 2]
    assert records.caught_up and records.malformed == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert f"topic {topic} partition 0 offset 1: malformed record skipped: ValueError: boom" in (
        warning
    )


# --------------------------------------------------------------------------- #
# settings
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("idle_timeout", [0, -1.5])
def test_idle_timeout_must_be_positive(idle_timeout: float) -> None:
    with pytest.raises(ValueError, match=rf"idle_timeout: seconds > 0 \(got {idle_timeout}\)"):
        TopicReader("127.0.0.1:9", "any", idle_timeout=idle_timeout)


@pytest.mark.parametrize("idle_timeout", [math.inf, math.nan], ids=["inf", "nan"])
async def test_a_non_finite_idle_timeout_is_refused_or_honoured(
    kafka: KafkaService, idle_timeout: float
) -> None:
    topic = fresh_topic("idle-inf")
    await create_topic(kafka.bootstrap, topic, 1)
    await produce(kafka.bootstrap, topic, [(0, None, event(0))])
    refused: str | None = None
    try:
        reader = TopicReader(kafka.bootstrap, topic, idle_timeout=idle_timeout)
    except ValueError as exc:
        refused = str(exc)
    if refused is not None:
        assert "idle_timeout" in refused
        return
    async with reader:
        offsets = [r.offset async for r in reader]
    assert offsets == [0] and reader.caught_up
