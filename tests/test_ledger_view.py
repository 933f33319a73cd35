"""The ledger view: one row per charge over the Parquet archive and the file ledger,
deduplicated as the projector counts; the ``costs`` view's one-USD-per-event rule.

Also home of :func:`mixed_run`, the workload the replay, reconcile and costs
suites share: a Governor on a real Redis with a ledger, its events projected by
the real :class:`Projector` (with the real :class:`Archiver` as its archive
hook, as the worker wires them), including redelivered batches, overlapping
archive segments and a producer duplicate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import redis as redis_sync

from mcp_budget_governor import (
    BudgetExceeded,
    Context,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    planning,
    usd,
)
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.events import LedgerEvent, encode, parse, to_entry
from mcp_budget_governor.keys import WATERMARK_KEY
from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id, partition_key
from mcp_budget_governor.ledger import partition_of as partition_index
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.ledger_view import (
    COLUMNS,
    LedgerError,
    open_ledger,
    range_days,
)
from mcp_budget_governor.stream.archiver import Archiver
from mcp_budget_governor.stream.projector import Projector

TOPIC = "mcpbg.ledger"
PARTITIONS = 3
SOURCE = "/mcpbg/test"


def _tenants() -> list[str]:
    """Three tenants, one on each partition (the ledger partitions by tenant)."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < PARTITIONS:
        found.setdefault(partition_index(partition_key(f"t{i}", None), PARTITIONS), f"t{i}")
        i += 1
    return [found[p] for p in range(PARTITIONS)]


TENANTS = _tenants()


def policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=6, window=Window.MINUTE, scope=Scope.USER),
        Limit("daily", cap=400, window=Window.DAY, scope=Scope.USER),
        Limit("tenant_calls", cap=100_000, window=Window.DAY, scope=Scope.TENANT),
        Limit(
            "spend",
            cap=usd(50),
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
        Limit(
            "user_spend",
            cap=usd(20),
            window=Window.MONTH,
            unit=Unit.USD_MICROS,
            scope=Scope.USER,
            gated=False,
        ),
    )


class Clock:
    """Governor time: starts ``back`` seconds ago and steps, so events span a few minutes."""

    def __init__(self, now: float, back: float, step: float) -> None:
        self.t = now - back
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


async def workload(gov: Governor, n: int, rng: random.Random, users: str = "u") -> None:
    """Checks (some refused), metered USD, metered model calls, reservations settled or released."""
    for _ in range(n):
        ctx = Context(user=f"{users}{rng.randrange(6)}", tenant=rng.choice(TENANTS), tool="search")
        op = rng.random()
        if op < 0.5:
            await gov.check(ctx)
        elif op < 0.7:
            await gov.meter("spend", rng.randrange(1, 40_000), ctx)
        elif op < 0.85:
            await gov.meter_tokens(
                "user_spend",
                rng.choice(["gpt-4o", "claude-haiku-4-5"]),
                input_tokens=rng.randrange(100, 5000),
                output_tokens=rng.randrange(10, 800),
                cache_read_tokens=rng.choice([0, 50]),
                ctx=ctx,
            )
        else:
            with contextlib.suppress(BudgetExceeded):
                async with gov.reserved("spend", 25_000, ctx) as r:
                    if rng.random() < 0.3:
                        r.release()
                    else:
                        r.actual = rng.randrange(0, 50_000)


@dataclass
class Run:
    """What a mixed run produced: the raw events per partition, in offset order."""

    archive: Path
    partitions: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)

    def events(self) -> list[tuple[int, int, bytes]]:
        return [(p, o, raw) for p, recs in sorted(self.partitions.items()) for o, raw in recs]

    def totals(self, *, upto: dict[int, int] | None = None) -> dict[str, int]:
        """Independent of DuckDB: the sum per key, each event id once (first offset wins)."""
        out: dict[str, int] = defaultdict(int)
        seen: set[str] = set()
        for p, offset, raw in self.events():
            if upto is not None and offset > upto.get(p, -1):
                continue
            event = parse(raw)
            if event.id in seen:
                continue
            seen.add(event.id)
            for c in event.data.charges:
                out[c.key] += c.amount
        return dict(out)


def partition_of(raw: bytes) -> int:
    ctx = parse(raw).data.context
    return partition_index(partition_key(ctx.tenant, ctx.user), PARTITIONS)


async def mixed_run(
    redis_url: str, tmp_path: Path, *, n: int = 400, seed: int = 1, project: bool = True
) -> Run:
    """A governed workload on Redis, projected and archived like the worker does it.

    Batches of 40 per partition; the second batch of each partition is
    delivered again shifted by 20 (overlapping segments, a redelivery), and
    the first event of partition 0 is appended again at the end (a producer
    retry at a new offset). ``project=False`` leaves everything in flight.
    """
    import time

    backend = RedisBackend.from_url(redis_url, timeout=5.0)
    await backend.mark_ready("test")
    ledger = MemoryLedger()
    gov = Governor(
        policy(),
        backend,
        ledger=ledger,
        prices=PriceTable.builtin(),
        clock=Clock(time.time(), back=180, step=180 / n),
    )
    await workload(gov, n, random.Random(seed))
    run = Run(tmp_path / "archive")
    for entry in ledger.entries:
        raw = encode(entry, SOURCE)
        p = partition_of(raw)
        records = run.partitions.setdefault(p, [])
        records.append((len(records), raw))
        run.ids.append(entry.id)
    first = run.partitions[0][0][1]
    run.partitions[0].append((len(run.partitions[0]), first))  # a producer retry
    if project:
        archiver = Archiver(run.archive, topic=TOPIC)
        projector = Projector(backend, TOPIC, dlq=lambda letter: None, archive=archiver.write_batch)
        for p, records in sorted(run.partitions.items()):
            for start in range(0, len(records), 40):
                await projector.apply_batch(p, records[start : start + 40])
                if start == 40:  # redelivered after a "rebalance", batched differently
                    await projector.apply_batch(p, records[start - 20 : start + 20])
    await backend.aclose()
    return run


def live_counters(redis_url: str) -> dict[str, tuple[int, int]]:
    """Every counter in Redis: committed and in-flight."""
    client = redis_sync.Redis.from_url(redis_url)
    out = {}
    for raw in client.scan_iter(match="mcpbg:v1:[^_]*", count=1000):
        fields = client.hgetall(raw)
        out[raw.decode()] = (int(fields.get(b"c", 0)), int(fields.get(b"f", 0)))
    client.close()
    return out


def watermarks(redis_url: str) -> dict[str, int]:
    client = redis_sync.Redis.from_url(redis_url)
    marks = {k.decode(): int(v) for k, v in client.hgetall(WATERMARK_KEY).items()}
    client.close()
    return marks


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
    seen: set[str] = set()
    for _, _, raw in run.events():
        event = parse(raw)
        if event.id in seen:
            continue
        seen.add(event.id)
        usd_charges = [c.amount for c in event.data.charges if c.unit == "usd_micros"]
        if usd_charges:
            want[event.data.context.user or ""] += usd_charges[0]
    got = dict(con.sql('SELECT "user", sum(usd_micros)::BIGINT FROM costs GROUP BY 1').fetchall())
    assert {u: v for u, v in got.items() if v} == {u: v for u, v in want.items() if v}
    ((events,),) = con.sql("SELECT count(*) FROM costs").fetchall()
    assert events == len(seen)


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
