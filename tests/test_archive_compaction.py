"""Archive compaction: small segments merged, and every reader still counts each event once.

The kill tests stop ``mcpbg archive compact`` with SIGKILL right after each
step of a compaction (``stream.compaction.KILL_ENV``), then read the archive
as every reader does (costs, the FOCUS export, a counter rebuild's totals),
then run it again to the end: the same answers each time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.projections.counters.sync import ledger_totals
from mcp_budget_governor.projections.focus_export import ExportOptions, export_focus
from mcp_budget_governor.projections.ledger_view import open_ledger
from mcp_budget_governor.stream.archiver import TEMP_SUFFIX, Archiver
from mcp_budget_governor.stream.compaction import (
    KILL_ENV,
    SOURCES_KEY,
    Compactor,
    compact_archive,
    parse_segment,
    scan,
    sources_of,
)
from tests.test_stream_archiver import MIDNIGHT, PRICES, Clock, as_consumed, workload

TOPIC = "mcpbg.ledger"
STEPS = ("read", "written", "renamed", "deleted-one", "deleted")


@pytest.fixture(scope="module")
def consumed() -> list[tuple[int, LedgerEvent]]:
    import asyncio

    # Starts before midnight UTC: the batches span two date folders.
    entries = asyncio.run(workload(Clock(MIDNIGHT - 6, step=0.25), rounds=12))
    return as_consumed(entries)


def small_archive(folder: Path, records: list[tuple[int, LedgerEvent]]) -> Archiver:
    """Two partitions in batches of 3, one redelivered batched differently (overlaps)."""
    archiver = Archiver(folder, topic=TOPIC)
    half = len(records) // 2
    for partition, part in ((0, records[:half]), (1, records[half:])):
        for i in range(0, len(part), 3):
            archiver.write_batch(partition, part[i : i + 3])
    archiver.write_batch(0, records[2:7])  # a redelivery batched differently
    return archiver


def answers(folder: Path, tmp: Path) -> dict[str, Any]:
    """What the readers say: spend per user, events, counter totals, the FOCUS export's sums."""
    con = open_ledger(archive_dir=folder)
    try:
        spend = con.sql(
            'SELECT "user", sum(usd_micros)::BIGINT, count(*) FROM costs GROUP BY 1 ORDER BY 1'
        ).fetchall()
        events = con.sql("SELECT count(*), count(DISTINCT id) FROM costs").fetchall()[0]
        totals = ledger_totals(con, int(MIDNIGHT))
        out = tmp / f"focus-{os.getpid()}-{len(list(tmp.iterdir()))}.csv"
        start = datetime.fromtimestamp(MIDNIGHT - 86_400, UTC)
        end = datetime.fromtimestamp(MIDNIGHT + 86_400, UTC)
        focus = export_focus(con, out, ExportOptions(start, end), prices=PRICES)
    finally:
        con.close()
    return {
        "spend": spend,
        "events": events,
        "totals": totals,
        "focus": (focus.rows, focus.events, focus.billed_micros),
    }


def segments(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*/*.parquet"))


def partition_days(folder: Path) -> int:
    """How many (date folder, partition) pairs hold segments: one file each once compacted."""
    return len({(p.parent, getattr(parse_segment(p), "partition", None)) for p in segments(folder)})


def test_compaction_merges_small_segments_and_every_reader_agrees(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    archive = tmp_path / "archive"
    small_archive(archive, consumed)
    before = answers(archive, tmp_path)
    assert before["events"][0] == before["events"][1] == len(consumed)
    files = segments(archive)
    groups = partition_days(archive)
    assert len(files) > 10 and groups == 3  # partition 0 spans midnight

    summary = compact_archive(archive, max_bytes=64_000_000)
    after = segments(archive)
    assert len(after) == summary.files_after == groups
    assert all(p.name.endswith(".compact.parquet") for p in after)
    assert summary.files_before == len(files) and summary.bytes_after < summary.bytes_before
    assert answers(archive, tmp_path) == before
    # The manifest names every source; rows at one offset are kept once.
    assert sorted(n for p in after for n in sources_of(p)) == sorted(p.name for p in files)
    con = open_ledger(archive_dir=archive)
    dupes = con.sql(
        'SELECT count(*) FROM (SELECT "partition", "offset", charge_index FROM ledger_raw '
        "GROUP BY ALL HAVING count(*) > 1)"
    ).fetchall()
    con.close()
    assert dupes == [(0,)]

    again = compact_archive(archive, max_bytes=64_000_000)  # idempotent
    assert (again.runs, again.finished, segments(archive)) == (0, 0, after)


def test_dry_run_changes_nothing(tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]) -> None:
    archive = tmp_path / "archive"
    small_archive(archive, consumed)
    files = segments(archive)
    summary = compact_archive(archive, max_bytes=64_000_000, dry_run=True)
    assert segments(archive) == files
    assert (summary.files_before, summary.files_after) == (len(files), partition_days(archive))


def run_compact(archive: Path, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
    if kill_at:
        env[KILL_ENV] = kill_at
    return subprocess.run(
        [sys.executable, "-m", "mcp_budget_governor.cli", "archive", "compact",
         "--archive-dir", str(archive)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("step", STEPS)
def test_kill_9_of_archive_compact_at_each_step(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]], step: str
) -> None:
    archive = tmp_path / "archive"
    small_archive(archive, consumed)
    before = answers(archive, tmp_path)

    killed = run_compact(archive, step)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = [p for p in archive.rglob("*") if p.is_file()]
    if step == "written":  # the merged rows sit in a hidden temporary file only
        assert any(p.name.endswith(TEMP_SUFFIX) for p in left)
    if step in ("renamed", "deleted-one"):  # a compacted file beside (some of) its sources
        (done,) = (p for p in left if p.name.endswith(".compact.parquet"))
        assert {p.name for p in left} & set(sources_of(done))
    assert answers(archive, tmp_path) == before

    finished = run_compact(archive)
    assert finished.returncode == 0, finished.stderr
    assert answers(archive, tmp_path) == before
    assert len(segments(archive)) == partition_days(archive) == 3
    assert not list(archive.rglob(f"*{TEMP_SUFFIX}"))


def test_a_source_rewritten_after_compaction_is_folded_in(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    """A slow worker's redelivery lands after the compaction: the next one folds it in."""
    archive = tmp_path / "archive"
    archiver = small_archive(archive, consumed)
    before = answers(archive, tmp_path)
    compact_archive(archive, max_bytes=64_000_000)
    archiver.write_batch(0, consumed[:3])
    assert answers(archive, tmp_path) == before
    compact_archive(archive, max_bytes=64_000_000)
    assert answers(archive, tmp_path) == before
    assert len(segments(archive)) == 3


def test_the_worker_compactor_rolls_by_size_and_age(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    archive = tmp_path / "archive"
    archiver = Archiver(archive, topic=TOPIC)
    compactor = Compactor(archive, TOPIC, max_bytes=10**9, max_age=3600, grace=60)
    compactor.start()
    for i in range(0, 12, 3):
        compactor.noted(archiver.write_batch(0, consumed[i : i + 3]))
    now = time.time()
    assert not compactor.due(now + 10)  # young and small: left alone
    assert compactor.run_due(now=now + 10) == 0
    assert compactor.due(now + 3600)
    written = compactor.run_due(now=now + 3600)
    assert written >= 1
    # The sources stay through the grace period (a query may have listed them)...
    assert any(not p.name.endswith(".compact.parquet") for p in segments(archive))
    compactor.run_due(now=now + 3600 + 61)
    assert all(p.name.endswith(".compact.parquet") for p in segments(archive))

    # By size: a limit of one byte rolls at once.
    by_size = Compactor(archive, TOPIC, max_bytes=1, max_age=3600)
    by_size.noted(archiver.write_batch(0, consumed[12:15]))
    assert by_size.due()
    assert by_size.run_due() == 1


def test_start_finishes_what_a_killed_worker_left(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    archive = tmp_path / "archive"
    small_archive(archive, consumed)
    before = answers(archive, tmp_path)
    # A killed worker: compacted files renamed in, sources not yet deleted.
    killed = Compactor(archive, TOPIC, max_bytes=1, max_age=3600)
    killed.start()
    killed.run_due()
    assert any(sources_of(p) for p in segments(archive))
    assert any(not p.name.endswith(".compact.parquet") for p in segments(archive))
    assert answers(archive, tmp_path) == before
    Compactor(archive, TOPIC, max_bytes=1, max_age=3600).start()
    assert all(p.name.endswith(".compact.parquet") for p in segments(archive))
    assert answers(archive, tmp_path) == before


def test_segment_names_and_groups(tmp_path: Path) -> None:
    assert parse_segment("x.parquet") is None
    seg = parse_segment(f"a.b-c-p7-{1:020d}-{9:020d}.compact.parquet")
    assert seg is not None and (seg.topic, seg.partition, seg.compacted) == ("a.b-c", 7, True)
    assert scan(tmp_path / "missing") == []
    assert SOURCES_KEY == b"mcpbg.archive.sources"


def test_the_command_in_process(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]], capsys: pytest.CaptureFixture[str]
) -> None:
    from mcp_budget_governor.cli import main

    archive = tmp_path / "archive"
    small_archive(archive, consumed)
    files = segments(archive)
    assert main(["archive", "compact", "--archive-dir", str(archive), "--dry-run"]) == 0
    assert f"would compact {len(files)} segment(s)" in capsys.readouterr().out
    assert segments(archive) == files
    assert main(["archive", "compact", "--archive-dir", str(archive)]) == 0
    assert "into 3 " in capsys.readouterr().out
    assert main(["archive", "compact", "--archive-dir", str(archive)]) == 0
    assert "nothing to compact: 3 segment(s)" in capsys.readouterr().out
    # Bad input: one line naming the option and the value.
    bad = ["archive", "compact", "--archive-dir", str(archive), "--archive-segment-mb"]
    assert main([*bad, "many"]) == 2
    assert "--archive-segment-mb" in capsys.readouterr().err
    assert main([*bad, "0"]) == 2
    assert "archive_segment_mb" in capsys.readouterr().err
    assert main(["archive", "compact", "--archive-dir", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_temporary_files_of_dead_writers_go_at_start(tmp_path: Path) -> None:
    from mcp_budget_governor.stream import archiver as archiver_module

    archiver = Archiver(tmp_path, topic=TOPIC)
    folder = tmp_path / "date=2025-11-29"
    folder.mkdir()
    host = archiver_module._HOST
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    gone = folder / f".x.parquet.{dead}@{host}.0123abcd{TEMP_SUFFIX}"
    alive = folder / f".y.parquet.{os.getppid()}@{host}.0123abcd{TEMP_SUFFIX}"
    elsewhere = folder / f".z.parquet.{dead}@another-host.0123abcd{TEMP_SUFFIX}"
    mine_before = folder / f".w.parquet.{os.getpid()}@{host}.0123abcd{TEMP_SUFFIX}"
    for path in (gone, alive, elsewhere, mine_before):
        path.write_bytes(b"half")
    old = archiver_module._STARTED - 10
    os.utime(mine_before, (old, old))  # a reused pid: written before this process started
    assert archiver.remove_stale_temp_files() == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted([alive.name, elsewhere.name])


def test_a_failed_compaction_is_tried_again_later(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mcp_budget_governor.stream import compaction

    archive = tmp_path / "archive"
    archiver = Archiver(archive, topic=TOPIC)
    compactor = Compactor(archive, TOPIC, max_bytes=1, max_age=3600)
    compactor.noted(archiver.write_batch(0, consumed[:3]))

    def full(*args: Any, **kwargs: Any) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compaction, "compact", full)
    with pytest.raises(OSError, match="No space"):
        compactor.run_due()
    now = time.time()
    assert not compactor.due(now) and compactor.due(now + compaction.RETRY_AFTER + 1)
    monkeypatch.undo()
    assert compactor.run_due(now=now + compaction.RETRY_AFTER + 1) == 1


def test_a_worker_start_looks_at_the_newest_days_only(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    archive = tmp_path / "archive"
    small_archive(archive, consumed)  # two date folders
    compactor = Compactor(archive, TOPIC, max_bytes=1, max_age=3600)
    compactor.start(days=1)
    compactor.run_due(everything=True)
    first, last = sorted(p for p in archive.iterdir())
    assert all(p.name.endswith(".compact.parquet") for p in last.iterdir())
    assert not any(p.name.endswith(".compact.parquet") for p in first.iterdir())


def hourly_archive(folder: Path, records: list[tuple[int, LedgerEvent]]) -> None:
    """Small segments compacted in runs of ~20 kB: several compacted files per partition-day,
    as a worker leaves a day of hourly rolls."""
    small_archive(folder, records)
    compact_archive(folder, max_bytes=20_000, day_after=float("inf"))
    assert len(segments(folder)) > partition_days(folder)


def test_a_closed_day_is_merged_to_one_file_per_partition(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    archive = tmp_path / "archive"
    hourly_archive(archive, consumed)
    before = answers(archive, tmp_path)
    # Not yet: the days ended less than day_after ago.
    not_yet = compact_archive(archive, max_bytes=64_000_000, day_after=10**10)
    assert not_yet.runs == 0
    summary = compact_archive(archive, max_bytes=64_000_000)
    assert summary.runs == len(segments(archive)) == partition_days(archive) == 3
    assert answers(archive, tmp_path) == before


@pytest.mark.parametrize("step", STEPS)
def test_kill_9_of_a_day_merge_at_each_step(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]], step: str
) -> None:
    archive = tmp_path / "archive"
    hourly_archive(archive, consumed)
    before = answers(archive, tmp_path)
    killed = run_compact(archive, step)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert answers(archive, tmp_path) == before
    finished = run_compact(archive)
    assert finished.returncode == 0, finished.stderr
    assert answers(archive, tmp_path) == before
    assert len(segments(archive)) == partition_days(archive) == 3


def test_the_worker_merges_a_closed_day(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    archive = tmp_path / "archive"
    hourly_archive(archive, consumed)
    before = answers(archive, tmp_path)
    compactor = Compactor(archive, TOPIC, max_bytes=64_000_000, max_age=3600)
    compactor.start()
    compactor.run_due(everything=True)
    assert len(segments(archive)) == partition_days(archive) == 3
    assert answers(archive, tmp_path) == before


def test_finish_never_deletes_on_the_word_of_a_deleted_file(tmp_path: Path) -> None:
    """Two compacted files naming each other (names reused): neither is deleted."""
    import json as json_module

    import pyarrow.parquet as pq

    from mcp_budget_governor.stream.compaction import Group, compacted_name, finish

    folder = tmp_path / "date=2025-11-29"
    folder.mkdir()
    a, b = (folder / compacted_name(TOPIC, 0, i, i + 9) for i in (0, 10))
    for path, other in ((a, b), (b, a)):
        table = pa.table({"x": [1]}).replace_schema_metadata(
            {SOURCES_KEY: json_module.dumps([other.name]).encode()}
        )
        pq.write_table(table, path)
    group = Group(folder, TOPIC, 0, [], [a, b])
    assert finish(group) == 0 and a.exists() and b.exists()


def test_the_manifest_keeps_the_footer_small(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    """A thousand sources' names, compressed, stored once (not again in the Arrow schema)."""
    import pyarrow.parquet as pq

    archive = tmp_path / "archive"
    archiver = Archiver(archive, topic=TOPIC)
    one = consumed[:1]
    for offset in range(1000):  # one event per batch, as a quiet worker writes them
        archiver.write_batch(0, [(offset, one[0][1])])
    compact_archive(archive, max_bytes=64_000_000)
    (merged,) = segments(archive)
    assert len(sources_of(merged)) == 1000
    meta = pq.read_metadata(merged)
    assert meta.serialized_size < 20_000, meta.serialized_size
    assert SOURCES_KEY not in (pq.read_schema(merged).metadata or {})


def test_costs_reports_read_the_archive_once_and_agree(
    tmp_path: Path, consumed: list[tuple[int, LedgerEvent]]
) -> None:
    from mcp_budget_governor.projections.costs import Filter, costs_reports, read_once, spend

    archive = tmp_path / "archive"
    small_archive(archive, consumed)
    start = datetime.fromtimestamp(MIDNIGHT, UTC)  # the events after midnight only
    end = datetime.fromtimestamp(MIDNIGHT + 3600, UTC)
    flt = Filter(start, end, tenant="acme")
    fresh = open_ledger(archive_dir=archive)
    want = spend(fresh, ["user"], flt).rows
    fresh.close()
    con = open_ledger(archive_dir=archive)
    try:
        first = [r.rows for r in costs_reports(con, flt)]
        read_once(con, flt)  # again on the same connection: kept, not read anew
        assert [r.rows for r in costs_reports(con, flt)] == first
        assert spend(con, ["user"], flt).rows == want
        ((snapshot,),) = con.sql("SELECT count(*) FROM _mcpbg_costs_snapshot").fetchall()
        assert 0 < snapshot < len(consumed)  # the time range only
    finally:
        con.close()
