"""The worker archives every batch to Parquet before applying it, and serves its metrics."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import duckdb
import pytest

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
