"""Redis flushed mid-run: the worker rebuilds from the ledger, the hot path admits nothing
from the empty counters meanwhile, and the counters converge to the ledger's totals."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
import redis as redis_sync

from mcp_budget_governor import Context, Governor, RedisBackend
from mcp_budget_governor.keys import EPOCH_KEY
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from testing.services import KafkaService
from testing.stream_support import (
    Names,
    Stream,
    Worker,
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
    wait_epoch,
    wait_watermarks,
    workers,
    workload,
)

__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name


@pytest.mark.slow
@both_engines
async def test_flushall_mid_run_rebuilds_and_never_admits_from_empty_counters(
    stream: Stream,
) -> None:
    sync = redis_sync.Redis.from_url(stream.redis_url)
    async with stream.governor() as seed:
        await workload(seed, 300, __import__("random").Random(1))
    worker = stream.start_worker()
    await stream.wait_for(lambda: sync.exists(EPOCH_KEY), "first rebuild sets the epoch", 60)
    await stream.caught_up()

    # The hot path of a ledger deployment refuses to admit from a Redis without the marker.
    guarded = RedisBackend.from_url(stream.redis_url, require_epoch=True, timeout=2.0)
    ledger = KafkaLedger(
        stream.kafka.bootstrap,
        topic=stream.topic,
        partitions=3,
        outbox_dir=stream.tmp_path / "hot-outbox",
    )
    gov = Governor(policy(), guarded, ledger=ledger, retry_interval=0.05)
    decisions: list[tuple[float, bool, bool, bool]] = []  # time, admitted, degraded, epoch

    async def traffic(seconds: float) -> None:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            ctx = Context(user=f"u{i % 7}", tenant=f"t{i % 3}", tool="search")
            d = await gov.check(ctx)
            decisions.append(
                (time.monotonic(), d.admitted, d.degraded, bool(sync.exists(EPOCH_KEY)))
            )
            if d.admitted:
                await gov.meter("spend", 1_000 + i % 50, ctx)
            i += 1
            await asyncio.sleep(0.002)

    await traffic(1.0)
    sync.flushdb()  # Redis loses everything mid-run (this test's db: the server may be shared)
    flushed_at = time.monotonic()
    await traffic(3.0)
    await stream.wait_for(lambda: sync.exists(EPOCH_KEY), "rebuild after FLUSHALL", 60)
    await traffic(1.0)
    assert await ledger.flush(30)
    await ledger.aclose()
    await guarded.aclose()

    after = [d for d in decisions if d[0] > flushed_at]
    rebuilding = [d for d in after if not d[3]]
    assert rebuilding, "the test never observed the rebuild window"
    # While the marker was missing, Redis decided nothing: every check followed its
    # limits' fail modes (these limits are fail-open: process-local counters).
    assert all(degraded for _, _, degraded, _ in rebuilding)
    resumed = [d for d in after if d[3]]
    assert resumed and not resumed[-1][2], "enforcement on Redis never resumed"

    records = await stream.caught_up()
    checked = await assert_exact(stream.backend, records)
    assert checked > 300
    assert "rebuild: " in worker.text()
    assert worker.terminate() == 0


@pytest.mark.slow
async def test_a_worker_started_on_an_empty_redis_rebuilds_before_it_resumes(
    kafka: KafkaService, redis_url: str, names: Names, workers: list[Worker], tmp_path: Path
) -> None:
    """No marker at start (first deployment, or Redis restarted empty while no worker ran):
    the whole retained ledger is replayed, then the marker is set and the live path goes on."""
    import random

    fresh = RedisBackend.from_url(redis_url, timeout=5.0)
    async with governor(kafka, fresh, names.topic, tmp_path) as gov:
        await workload(gov, 400, random.Random(2))
    redis_sync.Redis.from_url(redis_url).flushdb()  # the in-flight charges are gone too
    assert not await fresh.has_epoch()
    worker = start_worker(workers, kafka, redis_url, names, tmp_path)
    records = await read_ledger(kafka, names.topic)
    await wait_epoch(fresh, workers)
    # Replayed, then marked: with the marker set, every watermark is already at the end.
    await wait_watermarks(fresh, names.topic, records, 0.0, lambda: worker.text())
    assert await assert_exact(fresh, records) == len({r.event.id for r in records})
    assert "rebuild: " in worker.text() and "counters ready" in worker.text()
    assert worker.terminate() == 0
    await fresh.aclose()


@pytest.mark.slow
async def test_what_the_start_up_rebuild_applies_reaches_the_archive_once(
    kafka: KafkaService, redis_url: str, names: Names, workers: list[Worker], tmp_path: Path
) -> None:
    """6,000 events appended before any worker ran, then one worker (archiving) on an
    empty Redis: its rebuild applies them and leaves the watermarks at the topic's
    end, so they reach the archive there. Counters, archive, ``mcpbg costs`` and the
    FOCUS file all show the same 6,000 events and the same dollars."""
    fresh = RedisBackend.from_url(redis_url, timeout=5.0)
    spent = 0
    async with governor(kafka, fresh, names.topic, tmp_path) as gov:
        for i in range(6000):
            spent += 1_000 + i % 7
            await gov.meter("spend", 1_000 + i % 7, Context(user=f"u{i % 12}", tenant=f"t{i % 3}"))
    redis_sync.Redis.from_url(redis_url).flushdb()  # the first worker finds an empty store
    archive = tmp_path / "archive"
    worker = start_worker(workers, kafka, redis_url, names, tmp_path, "--archive-dir", str(archive))
    records = await wait_caught_up(kafka, fresh, names.topic, workers)
    assert await assert_exact(fresh, records) == 6000
    assert "counters ready" in worker.text()
    assert worker.terminate() == 0
    await fresh.aclose()

    rows = pq.read_table(archive, columns=["id", "amount"]).to_pydict()  # no reader's dedupe
    assert len(rows["id"]) == len(set(rows["id"])) == 6000 and sum(rows["amount"]) == spent

    out = await asyncio.to_thread(run_mcpbg, "costs", "--archive-dir", str(archive), "--json")
    (total,) = json.loads(out)["summary"]
    assert (total["events"], total["usd_micros"]) == (6000, spent)

    focus = tmp_path / "focus.csv"
    month = time.strftime("%Y-%m", time.gmtime(records[0].event.time.timestamp()))
    await asyncio.to_thread(
        run_mcpbg, "export", "focus", "--period", month, "--archive-dir", str(archive),
        "--out", str(focus), "--quiet",
    )  # fmt: skip
    rows_out = csv.DictReader(focus.read_text().splitlines())
    assert sum(Decimal(row["BilledCost"]) for row in rows_out) * 1_000_000 == spent


def run_mcpbg(*argv: str) -> str:
    """``mcpbg argv`` as a user runs it (its own process); its output, after exit 0."""
    done = subprocess.run(
        [sys.executable, "-m", "mcp_budget_governor.cli", *argv],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout
