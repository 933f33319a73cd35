"""The ledger view: one row per charge over the Parquet archive and the file ledger,
deduplicated as the projector counts; the ``costs`` view's one-USD-per-event rule.

The run they read is :func:`testing.ledger_run.mixed_run`, which the replay,
reconcile and costs suites share.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    RedisBackend,
    Scope,
    Unit,
    Window,
    planning,
)
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.events import LedgerEvent, encode, parse, to_entry
from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger
from mcp_budget_governor.projections.ledger_view import (
    COLUMNS,
    LedgerError,
    open_ledger,
    range_days,
)
from mcp_budget_governor.stream.archiver import Archiver
from testing.ledger_run import SOURCE, TENANTS, TOPIC, Run, mixed_run, policy, workload


@pytest.fixture
async def run(redis_url: str, tmp_path: Path) -> Run:
    return await mixed_run(redis_url, tmp_path)


# -- tests --------------------------------------------------------------------


async def test_view_has_the_contract_columns_and_one_row_per_charge(run: Run) -> None:
    con = open_ledger(run.archive)
    described = con.sql("DESCRIBE ledger").fetchall()
    types = {name: kind for name, kind, *_ in described}
    assert [name for name, *_ in described] == list(COLUMNS)
    assert types["time"] == "TIMESTAMP WITH TIME ZONE"
    assert types["amount"] == types["expire_at"] == types["offset"] == "BIGINT"
    assert types["status"] == "INTEGER" and types["degraded"] == "BOOLEAN"

    # Overlapping segments and the producer retry are in the files, read once.
    ((raw_rows,),) = con.execute("SELECT count(*) FROM ledger_raw").fetchall()
    ((rows,),) = con.execute("SELECT count(*) FROM ledger").fetchall()
    distinct = {}
    for _, _, raw in run.events():
        event = parse(raw)
        distinct[event.id] = max(1, len(event.data.charges))
    assert raw_rows > rows == sum(distinct.values())
    sums = dict(
        con.sql(
            'SELECT "key", sum(amount)::BIGINT FROM ledger WHERE "key" IS NOT NULL GROUP BY 1'
        ).fetchall()
    )
    assert sums == run.totals()
    # The producer retry keeps its first offset; the source is named.
    ((source, partition_name),) = con.sql(
        'SELECT DISTINCT source, partition_name FROM ledger WHERE "partition" = 0'
    ).fetchall()
    assert (source, partition_name) == ("archive", f"{TOPIC}:0")


async def test_costs_view_counts_each_events_usd_once(run: Run) -> None:
    con = open_ledger(run.archive)
    want: dict[str, int] = defaultdict(int)
    unique = run.unique()
    for event in unique:
        usd_charges = [c.amount for c in event.data.charges if c.unit == "usd_micros"]
        if usd_charges:
            want[event.data.context.user or ""] += usd_charges[0]
    got = dict(con.sql('SELECT "user", sum(usd_micros)::BIGINT FROM costs GROUP BY 1').fetchall())
    assert {u: v for u, v in got.items() if v} == {u: v for u, v in want.items() if v}
    ((events,),) = con.sql("SELECT count(*) FROM costs").fetchall()
    assert events == len(unique)


async def test_file_ledger_rows_match_the_archive_rows(redis_url: str, tmp_path: Path) -> None:
    """The same events through a FileLedger read as the same charges, partition = segment."""
    backend = RedisBackend.from_url(redis_url, timeout=5.0)
    folder = tmp_path / "ledger"
    file_ledger = FileLedger(folder, fsync="never", source=SOURCE)
    gov = Governor(policy(), backend, ledger=file_ledger, prices=PriceTable.builtin())
    await workload(gov, 120, random.Random(7))
    await gov.aclose()
    con = open_ledger(ledger_dir=folder)
    rows = con.sql(
        'SELECT source, topic, partition_name, "partition", "offset", id FROM ledger '
        'ORDER BY "offset"'
    ).fetchall()
    assert {r[0] for r in rows} == {"file"}
    assert {r[2] for r in rows} == {"file:ledger-00000000000000000000.jsonl"}
    offsets = sorted({r[4] for r in rows})
    assert offsets == list(range(len(offsets)))  # the record index in the segment
    lines = (folder / "ledger-00000000000000000000.jsonl").read_bytes().splitlines()
    assert [parse(line).id for line in lines] == [
        r[0]
        for r in con.sql(
            'SELECT DISTINCT ON ("offset") id FROM ledger ORDER BY "offset"'
        ).fetchall()
    ]


def test_no_source_empty_folder_and_corrupt_file_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="no ledger given"):
        open_ledger()
    with pytest.raises(LedgerError, match="no such folder"):
        open_ledger(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LedgerError, match=r"empty ledger: no ledger events in .*empty"):
        open_ledger(empty, empty)
    folder = tmp_path / "archive" / "date=2026-11-29"
    folder.mkdir(parents=True)
    bad = folder / "mcpbg.ledger-p0-x.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(LedgerError) as info:
        open_ledger(tmp_path / "archive")
    assert str(bad) in str(info.value) and "corrupt Parquet file" in str(info.value)
    assert "\n" not in str(info.value)
    pq.write_table(__import__("pyarrow").table({"x": [1]}), bad)
    with pytest.raises(LedgerError, match="not a ledger archive segment"):
        open_ledger(tmp_path / "archive")


async def test_archive_and_file_ledger_together(run: Run, redis_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "ledger"
    ledger = FileLedger(folder, fsync="never", source=SOURCE)
    gov = Governor(
        policy(), RedisBackend.from_url(redis_url), ledger=ledger, prices=PriceTable.builtin()
    )
    await workload(gov, 50, random.Random(9))
    await gov.aclose()
    both = open_ledger(run.archive, folder)
    counts = dict(both.sql("SELECT source, count(DISTINCT id) FROM ledger GROUP BY 1").fetchall())
    ((archive_events,),) = open_ledger(run.archive).sql("SELECT count(*) FROM costs").fetchall()
    ((file_events,),) = open_ledger(ledger_dir=folder).sql("SELECT count(*) FROM costs").fetchall()
    assert counts == {"archive": archive_events, "file": file_events} and file_events >= 50


# -- a time range: only its days' date folders are read --------------------------

NOV = datetime(2026, 11, 1, tzinfo=UTC)


def test_range_days_are_the_utc_days_a_half_open_range_touches() -> None:
    dec = datetime(2026, 12, 1, tzinfo=UTC)
    assert range_days(NOV, dec) == (date(2026, 11, 1), date(2026, 11, 30))
    assert range_days(None, None) == (None, None)
    assert range_days(NOV + timedelta(hours=23), None) == (date(2026, 11, 1), None)
    assert range_days(None, NOV + timedelta(seconds=1)) == (None, date(2026, 11, 1))
    # Another zone: 2026-11-01T01:00+02:00 is 2026-10-31T23:00Z.
    plus2 = datetime(2026, 11, 1, 1, tzinfo=timezone(timedelta(hours=2)))
    assert range_days(plus2, NOV) == (date(2026, 10, 31), date(2026, 10, 31))
    first, last = range_days(NOV, NOV)  # empty: no day at all
    assert first is not None and last is not None and last < first
    with pytest.raises(InvalidInputError, match="since"):
        range_days(datetime(2026, 11, 1), None)


_SPEND = Limit("spend", cap=10**9, window=Window.DAY, unit=Unit.USD_MICROS, scope=Scope.USER)
_GLOBAL = Limit("global", cap=10**9, window=Window.DAY, unit=Unit.USD_MICROS)


def _around_midnight(n: int) -> list[tuple[int, LedgerEvent]]:
    """``n`` metered events one second apart, half before and half after 2026-11-01T00:00Z."""
    records = []
    for i in range(n):
        entry = LedgerEntry(
            id=new_id(),
            type=EntryType.METERED,
            time=NOV.timestamp() - n // 2 + i + 0.25,
            context=Context(user=f"u{i % 3}", tenant=TENANTS[0]),
            charges=(),
        )
        # The charges a governor plans for them (the topic accepts no others).
        slots = planning.meter_slots(
            [(_SPEND, 1_000 + i), (_GLOBAL, 1_000 + i)], entry.context, entry.time, UTC
        )
        entry = dataclasses.replace(entry, charges=planning.ledger_charges(slots))
        records.append((i, parse(encode(entry, SOURCE))))
    return records


def test_a_time_range_reads_its_days_and_keeps_every_copy_of_an_event(tmp_path: Path) -> None:
    records = _around_midnight(20)
    archiver = Archiver(tmp_path, topic=TOPIC)
    archiver.write_batch(0, records[:12])
    archiver.write_batch(0, records[6:])  # redelivered, batched differently: overlapping files
    # A producer retry: events at a second place (other partition and offsets), near midnight.
    archiver.write_batch(1, [(0, records[9][1]), (1, records[10][1]), (2, records[11][1])])
    # Pruning by folder keeps duplicates together: every copy of an event is
    # filed under the UTC date of its own time, whichever batch carried it.
    ids_by_folder: dict[str, set[str]] = {}
    for folder in sorted(tmp_path.glob("date=*")):
        table = pq.ParquetDataset(folder).read()
        times = table.column("time").to_pylist()
        assert {t.astimezone(UTC).date().isoformat() for t in times} == {folder.name[5:]}
        ids_by_folder[folder.name] = set(table.column("id").to_pylist())
    assert sorted(ids_by_folder) == ["date=2026-10-31", "date=2026-11-01"]
    assert not ids_by_folder["date=2026-10-31"] & ids_by_folder["date=2026-11-01"]

    whole = open_ledger(tmp_path)
    nov = open_ledger(tmp_path, since=NOV, until=NOV + timedelta(days=30))
    raw = 'SELECT DISTINCT "date" FROM ledger_raw'
    assert nov.sql(raw).fetchall() == [(date(2026, 11, 1),)]  # October was not read
    query = (
        'SELECT id, charge_index, amount, "partition", "offset" FROM ledger '
        "WHERE \"time\" >= TIMESTAMPTZ '2026-11-01 00:00Z' ORDER BY ALL"
    )
    expected = whole.sql(query).fetchall()
    assert nov.sql(query).fetchall() == expected and len(expected) == 2 * 10
    ((read,),) = nov.sql("SELECT count(*) FROM ledger_raw").fetchall()
    assert read > len(expected)  # copies were read, and removed exactly
    spend = "SELECT count(*), sum(usd_micros) FROM costs WHERE \"time\" >= TIMESTAMPTZ '2026-11-01'"
    assert (
        nov.sql(spend).fetchall()
        == whole.sql(spend).fetchall()
        == [(10, sum(1_000 + i for i in range(10, 20)))]
    )
    # What the whole ledger covers is known without reading it.
    dates = "SELECT date FROM ledger_dates ORDER BY 1"
    assert (
        nov.sql(dates).fetchall()
        == whole.sql(dates).fetchall()
        == [
            (date(2026, 10, 31),),
            (date(2026, 11, 1),),
        ]
    )
    # A range with no folder: empty views, not an error (the ledger is not empty).
    empty = open_ledger(tmp_path, since=NOV + timedelta(days=3), until=NOV + timedelta(days=4))
    assert empty.sql("SELECT count(*) FROM costs").fetchall() == [(0,)]
    assert [d[0] for d in empty.sql("SELECT * FROM ledger").description] == list(COLUMNS)


def test_a_range_never_opens_files_outside_it(tmp_path: Path) -> None:
    records = _around_midnight(8)
    Archiver(tmp_path / "archive", topic=TOPIC).write_batch(0, records)
    bad = tmp_path / "archive" / "date=2026-10-05" / "mcpbg.ledger-p0-x.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(LedgerError, match="corrupt Parquet file"):
        open_ledger(tmp_path / "archive")
    con = open_ledger(tmp_path / "archive", since=NOV, until=NOV + timedelta(days=1))
    assert con.sql("SELECT count(*) FROM costs").fetchall() == [(4,)]
    # Inside the range, the same file is named.
    with pytest.raises(LedgerError, match="corrupt Parquet file"):
        open_ledger(tmp_path / "archive", since=NOV - timedelta(days=30))


async def test_a_range_filters_the_file_ledger_to_the_same_days(tmp_path: Path) -> None:
    ledger = FileLedger(tmp_path / "ledger", fsync="never", source=SOURCE)
    for _, event in _around_midnight(6):
        await ledger.append(to_entry(event))
    await ledger.aclose()
    whole = open_ledger(ledger_dir=tmp_path / "ledger")
    nov = open_ledger(ledger_dir=tmp_path / "ledger", since=NOV)
    assert whole.sql("SELECT count(*) FROM costs").fetchall() == [(6,)]
    assert nov.sql(
        "SELECT count(*), min(\"time\") >= TIMESTAMPTZ '2026-11-01' FROM costs"
    ).fetchall() == [(3, True)]
    assert nov.sql("SELECT count(*) FROM ledger_dates").fetchall() == [(2,)]


@pytest.mark.parametrize("ranged", [False, True])
async def test_folders_whose_names_hold_quotes_are_read(tmp_path: Path, ranged: bool) -> None:
    # The paths reach DuckDB as SQL string literals inside the views (a view takes
    # no parameters): sql_quote.quote_string must keep them whole.
    base = tmp_path / "it's \"odd\" '' here"
    records = _around_midnight(6)
    Archiver(base / "archive", topic=TOPIC).write_batch(0, records)
    ledger = FileLedger(base / "ledger", fsync="never", source=SOURCE)
    for _, event in records:
        await ledger.append(to_entry(event))
    await ledger.aclose()
    since = NOV if ranged else None
    con = open_ledger(base / "archive", base / "ledger", since=since)
    by_source = "SELECT source, count(*) FROM ledger_raw GROUP BY 1 ORDER BY 1"
    expected = 3 if ranged else 6
    assert con.sql(by_source).fetchall() == [("archive", 2 * expected), ("file", 2 * expected)]
