"""The worker archives every batch to Parquet before applying it, compacts the segments,
and serves its metrics."""

from __future__ import annotations

import asyncio
import random
import signal
import urllib.request
from pathlib import Path

import duckdb
import pytest

from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.projections.counters.sync import ledger_totals
from mcp_budget_governor.projections.ledger_view import open_ledger
from mcp_budget_governor.stream.archiver import TEMP_SUFFIX
from mcp_budget_governor.stream.compaction import KILL_ENV
from testing.services import free_port
from testing.stream_support import (
    Stream,
    assert_exact,
    backend,
    charge_totals,
    engine,
    kafka,
    names,
    stream,
    unique_events,
    workers,
    workload,
)

__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name


@pytest.mark.slow
async def test_archive_matches_the_ledger_and_metrics_count_it(stream: Stream) -> None:
    archive = stream.tmp_path / "archive"
    port = free_port()
    async with stream.governor() as gov:
        await workload(gov, 500, random.Random(3))
    worker = stream.start_worker("--archive-dir", str(archive), "--metrics-port", str(port))
    records = await stream.caught_up()
    events = await assert_exact(stream.backend, records)

    # The archive holds every charge once (deduplicated on event id and charge index,
    # as a reader must), and its totals per counter equal the ledger's.
    want = charge_totals(unique_events(records))
    rows = duckdb.sql(
        f"""
        SELECT key, sum(amount)::BIGINT FROM (
            SELECT * FROM read_parquet('{archive}/**/*.parquet', hive_partitioning = true)
            QUALIFY row_number() OVER (PARTITION BY id, charge_index ORDER BY "offset") = 1
        ) WHERE key IS NOT NULL GROUP BY key
        """
    ).fetchall()
    assert dict(rows) == dict(want)
    ((archived_events,),) = duckdb.sql(
        f"SELECT count(DISTINCT id) FROM read_parquet('{archive}/**/*.parquet')"
    ).fetchall()
    assert archived_events == events

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())

    body = await asyncio.to_thread(scrape)
    name = "mcpbg_worker_applied_events_total"
    applied = [line for line in body.splitlines() if line.startswith(name)]
    assert applied and float(applied[0].split()[-1]) >= 1
    assert "mcpbg_worker_last_offset" in body
    assert worker.terminate() == 0


def archive_answers(archive: Path) -> tuple[list[tuple[str, int]], int, dict[str, int]]:
    """Spend per user, distinct events and counter totals, as the ledger view reads them."""
    con = open_ledger(archive_dir=archive)
    try:
        spend = con.sql(
            'SELECT "user", sum(usd_micros)::BIGINT FROM costs WHERE "user" IS NOT NULL '
            "GROUP BY 1 ORDER BY 1"
        ).fetchall()
        ((events,),) = con.sql("SELECT count(*) FROM costs").fetchall()
        totals = {k: amount for k, (amount, _) in ledger_totals(con, 0).items()}
    finally:
        con.close()
    return spend, events, totals


def expected_answers(
    events: list[LedgerEvent],
) -> tuple[list[tuple[str, int]], int, dict[str, int]]:
    spend: dict[str, int] = {}
    for e in events:
        usd = next((c.amount for c in e.data.charges if c.unit == "usd_micros"), 0)
        if e.data.context.user is not None:
            spend[e.data.context.user] = spend.get(e.data.context.user, 0) + usd
    return sorted(spend.items()), len(events), charge_totals(events)


@pytest.mark.slow
@pytest.mark.parametrize("step", ["read", "written", "renamed", "deleted-one", "deleted"])
async def test_kill_9_of_the_worker_at_each_compaction_step(stream: Stream, step: str) -> None:
    """A worker SIGKILLed right after a step of a compaction; its successor finishes it.

    ``--archive-segment-age 1`` (the default is an hour) so that a compaction falls due
    within the test; the test above runs the defaults (compaction at a clean stop).
    """
    archive = stream.tmp_path / "archive"
    age = ("--archive-dir", str(archive), "--archive-segment-age", "1")
    async with stream.governor() as gov:
        await workload(gov, 300, random.Random(5))
    doomed = stream.start_worker(*age, env={KILL_ENV: step})
    await stream.wait_for(lambda: doomed.proc.poll() is not None, f"killed at {step}", 60)
    assert doomed.proc.returncode == -signal.SIGKILL, doomed.tail()
    async with stream.governor() as gov:  # more events while no worker runs
        await workload(gov, 200, random.Random(6))
    successor = stream.start_worker(*age)
    records = await stream.caught_up()
    await assert_exact(stream.backend, records)
    assert successor.terminate() == 0  # a clean stop compacts what is left
    events = unique_events(records)
    assert archive_answers(archive) == expected_answers(events)
    # Only compacted segments (one per partition per second of age here), no temporary file.
    files = list(archive.rglob("*.parquet"))
    assert files and all(p.name.endswith(".compact.parquet") for p in files), files
    assert not list(archive.rglob(f"*{TEMP_SUFFIX}"))
