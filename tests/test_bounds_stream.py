"""Each hostile event of issue 39, end to end, on Redis and on Postgres (one test each):
written to the Kafka topic and projected by the worker, and written to a file
ledger and rebuilt by ``mcpbg replay``. The event is dead-lettered with its
reason (the ``.dlq`` topic; the ledger view's ``dead_letters`` for a replay),
every other event of the partition is applied, and the counters, ``costs`` and
the FOCUS file agree, none of them negative.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import secrets
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from mcp_budget_governor import Governor, MemoryBackend
from mcp_budget_governor.approval import Approval
from mcp_budget_governor.cli import main as cli
from mcp_budget_governor.errors import EventRefusedError
from mcp_budget_governor.events import encode, parse
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.producers.file_ledger import DEFAULT_PREFIX
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.producers.record_log import RecordLog
from mcp_budget_governor.projections.ledger_view import open_ledger
from mcp_budget_governor.stream.projector import DeadLetter, to_applied
from testing.hostile import ALICE, BOB, CASES, MALLORY, SOURCE, build, policy, spend_key
from testing.services import KafkaService
from testing.stores import backend_for, is_postgres, store_args, wipe
from testing.stream_support import create_topic, kafka, names

worker_module = pytest.importorskip("mcp_budget_governor.stream.worker")
__all__ = ["kafka", "names"]  # fixtures, used by name
ATTACK_AT = 2  # the attack follows two honest records


async def _fresh(url: str) -> None:
    """The store empty (and on Postgres migrated)."""
    wipe(url)
    if is_postgres(url):
        backend = backend_for(url)
        await backend.migrate()
        await backend.aclose()


async def _counters(url: str) -> dict[str, tuple[int, int]]:
    backend = backend_for(url)
    try:
        out = {}
        for ctx in (ALICE, BOB, MALLORY):
            state = await backend.state(spend_key(ctx))
            out[ctx.user or ""] = (state.committed, state.in_flight)
        return out
    finally:
        await backend.aclose()


def _costs(con: Any) -> dict[str, int]:
    rows = con.execute('SELECT "user", sum(usd_micros) FROM costs GROUP BY 1').fetchall()
    return {str(u): int(t) for u, t in rows}


def _focus(folder: Path, source: list[str]) -> list[int]:
    """The BilledCost of every row of a FOCUS export of today, in micros."""
    out = folder / "focus.csv"
    day = datetime.now(UTC).date()
    span = ("--from", day.isoformat(), "--to", (day + timedelta(days=1)).isoformat())
    assert cli(["export", "focus", *span, *source, "--out", str(out), "--quiet"]) == 0
    with out.open() as fh:
        return [round(float(row["BilledCost"]) * 1_000_000) for row in csv.DictReader(fh)]


def _assert_agree(counters: dict[str, tuple[int, int]], costs: dict[str, int]) -> None:
    # Every honest event applied: the bystander's and alice's spend, before and after.
    assert counters["bob"] == (5_000, 0) and counters["alice"] == (5_000, 0), counters
    for user, (committed, in_flight) in counters.items():
        assert committed >= 0 and in_flight == 0, (user, committed)
        assert costs.get(user, 0) == committed, (user, costs, counters)
    assert all(total >= 0 for total in costs.values()), costs


@contextlib.asynccontextmanager
async def serving(config: Any) -> AsyncIterator[None]:
    assert await worker_module.prepare_topics(config) >= 1
    worker = worker_module.ProjectionWorker(config)
    task = asyncio.create_task(worker.serve())
    try:
        yield
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


async def _dead_letters(kafka: KafkaService, topic: str, count: int) -> list[DeadLetter]:
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    out: list[DeadLetter] = []
    try:
        parts = consumer.partitions_for_topic(topic) or {0}
        consumer.assign([TopicPartition(topic, p) for p in sorted(parts)])
        deadline = time.monotonic() + 20
        while len(out) < count and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=300)).values():
                out += [DeadLetter.from_json(m.value or b"") for m in messages]
        for messages in (await consumer.getmany(timeout_ms=500)).values():  # and no more
            out += [DeadLetter.from_json(m.value or b"") for m in messages]
    finally:
        await consumer.stop()
    return out


@pytest.mark.parametrize("live", [False, True], ids=["rebuild", "live"])
@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_worker_dead_letters_the_hostile_event_and_applies_the_partition(
    case: str, live: bool, store_url: str, kafka: KafkaService, names: Any, tmp_path: Path
) -> None:
    """``rebuild``: the worker starts on an empty store and rebuilds it from the topic
    (stream/rebuild.py); ``live``: the store is complete, the live projection applies."""
    await _fresh(store_url)
    if live:
        ready = backend_for(store_url)
        await ready.mark_ready("test")
        await ready.aclose()
    records, attack = await build(case)
    await create_topic(kafka.bootstrap, names.topic, 1)
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, enable_idempotence=False)
    await producer.start()
    try:
        for raw in records:
            await producer.send_and_wait(names.topic, raw, key=b"k", partition=0)
    finally:
        await producer.stop()
    archive = tmp_path / "archive"
    store = {"postgres_url": store_url} if is_postgres(store_url) else {"redis_url": store_url}
    config = worker_module.WorkerConfig(
        kafka.bootstrap,
        topic=names.topic,
        group=names.group,
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        archive_dir=str(archive),
        **store,
    )
    backend = backend_for(store_url)
    try:
        async with serving(config):
            deadline = time.monotonic() + 60
            while await backend.watermark(f"{names.topic}:0") < len(records) - 1:
                assert time.monotonic() < deadline, "the worker did not reach the partition's end"
                await asyncio.sleep(0.2)
    finally:
        await backend.aclose()
    refused = [ATTACK_AT + i for i in attack.refused]
    letters = await _dead_letters(kafka, f"{names.topic}.dlq", len(refused))
    assert sorted(d.offset for d in letters) == refused, [d.reason for d in letters]
    assert all(attack.reason in d.reason for d in letters), [d.reason for d in letters]
    con = open_ledger(archive_dir=archive)
    try:
        costs = _costs(con)
        dead = con.execute('SELECT "offset", reason FROM dead_letters ORDER BY 1').fetchall()
    finally:
        con.close()
    assert [o for o, _ in dead] == refused
    _assert_agree(await _counters(store_url), costs)
    assert min(_focus(tmp_path, ["--archive-dir", str(archive)]), default=0) >= 0


@pytest.mark.parametrize("case", sorted(CASES))
async def test_replay_of_a_file_ledger_follows_the_same_rule(
    case: str, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await _fresh(store_url)
    records, attack = await build(case)
    folder = tmp_path / "ledger"
    log = RecordLog(folder, prefix=DEFAULT_PREFIX)
    log.append(records)
    log.close()
    code = await asyncio.to_thread(
        cli, ["replay", "--source", "file", "--ledger-dir", str(folder), *store_args(store_url)]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    refused = [ATTACK_AT + i for i in attack.refused]
    if refused:
        assert f"{len(refused)} records refused" in out.out, out.out
    else:  # the honest burst: nothing of a Governor's own is a dead letter
        assert "records refused" not in out.out, out.out
    con = open_ledger(ledger_dir=folder)
    try:
        costs = _costs(con)
        dead = con.execute('SELECT "offset", reason FROM dead_letters ORDER BY 1').fetchall()
    finally:
        con.close()
    assert [o for o, _ in dead] == refused
    assert all(attack.reason in r for _, r in dead), dead
    _assert_agree(await _counters(store_url), costs)
    assert min(_focus(tmp_path, ["--ledger-dir", str(folder)]), default=0) >= 0


async def test_a_replay_restores_the_open_reservations(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mcpbg replay`` writes the counters from the ledger view; it restores the
    reservations the ledger holds open too, so the live projection settles them after
    it (and still refuses a second settlement)."""
    await _fresh(store_url)
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=ledger)
    held = await gov.reserve("spend", 5_000, MALLORY)
    await gov.settle(held, 1_000)
    reserved, settled = (encode(e, SOURCE) for e in ledger.entries)
    folder = tmp_path / "ledger"
    log = RecordLog(folder, prefix=DEFAULT_PREFIX)
    log.append([reserved])
    log.close()
    code = await asyncio.to_thread(
        cli, ["replay", "--source", "file", "--ledger-dir", str(folder), *store_args(store_url)]
    )
    assert code == 0, capsys.readouterr().err
    assert (await _counters(store_url))["mallory"] == (5_000, 0)
    backend = backend_for(store_url)
    try:
        await backend.apply("live:0", [to_applied(parse(settled), 0)])
        again = parse(settled.replace(ledger.entries[1].id.encode(), new_id().encode()))
        with pytest.raises(EventRefusedError, match="not one the ledger holds"):
            await backend.apply("live:0", [to_applied(again, 1)])
    finally:
        await backend.aclose()
    assert (await _counters(store_url))["mallory"] == (1_000, 0)


@pytest.mark.parametrize("via", ["projection", "replay"])
async def test_an_approval_spent_before_the_store_lost_its_state_stays_spent(
    store_url: str, via: str, tmp_path: Path
) -> None:
    """Redis (or Postgres) loses its state while an approval is inside its window:
    rebuilt from the ledger (``projection``: the apply the worker's start-up replay
    runs; ``replay``: ``mcpbg replay`` from the ledger view), the approval's marker
    is back and a second use is refused."""
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=ledger)
    assert (await gov.check(MALLORY)).admitted
    approval = Approval("asked", secrets.token_hex(16), int(time.time()) + 120)
    assert (await gov.check(MALLORY, approved=[approval])).admitted
    await _fresh(store_url)  # the store that lost its state
    if via == "replay":
        folder = tmp_path / "ledger"
        log = RecordLog(folder, prefix=DEFAULT_PREFIX)
        log.append([encode(e, SOURCE) for e in ledger.entries])
        log.close()
        argv = ["replay", "--source", "file", "--ledger-dir", str(folder)]
        assert await asyncio.to_thread(cli, [*argv, *store_args(store_url)]) == 0
    backend = backend_for(store_url)
    try:
        if via == "projection":
            assert await ledger.project(backend) == 2
        again = Governor(policy(), backend)
        refused = await again.check(MALLORY, approved=[approval])
        assert not refused.admitted and refused.limit == "asked", refused
        other = Approval("asked", secrets.token_hex(16), int(time.time()) + 120)
        assert (await again.check(MALLORY, approved=[other])).admitted  # a fresh one works
    finally:
        await backend.aclose()


@pytest.mark.parametrize("one_batch", [True, False], ids=["one batch", "batch by batch"])
async def test_a_reservation_redelivered_after_its_settlement_stays_closed(
    store_url: str, one_batch: bool
) -> None:
    """A producer retry of the reserved event (same id, a later offset) after its
    settlement is skipped like any copy: it does not open the reservation again, so a
    second settlement is still refused."""
    await _fresh(store_url)
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=ledger)
    await gov.meter("spend", 10_000, MALLORY)
    held = await gov.reserve("spend", 5_000, MALLORY)
    await gov.settle(held, 1_000)
    metered, reserved, settled = (parse(encode(e, SOURCE)) for e in ledger.entries)
    again = parse(encode(ledger.entries[2], SOURCE).replace(
        ledger.entries[2].id.encode(), new_id().encode()))  # fmt: skip
    batch = [to_applied(metered, 0), to_applied(reserved, 1), to_applied(settled, 2),
             to_applied(reserved, 3)]  # fmt: skip
    backend = backend_for(store_url)
    try:
        await backend.mark_ready("test")
        if one_batch:
            assert await backend.apply("retry:0", batch) == 3
        else:
            for event in batch:
                await backend.apply("retry:0", [event])
        with pytest.raises(EventRefusedError, match="not one the ledger holds"):
            await backend.apply("retry:0", [to_applied(again, 4)])
    finally:
        await backend.aclose()
    assert (await _counters(store_url))["mallory"] == (11_000, 0)
