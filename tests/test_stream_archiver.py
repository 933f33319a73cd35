"""The archiver: ledger events to date-partitioned Parquet segments that DuckDB reads.

Events come from a real Governor (MemoryBackend, MemoryLedger) running a mixed
workload, and reach the archiver as the stream worker has them: each entry
encoded as the hot path writes it, then parsed (``events.parse``). What is read
back must be every charge of the ledger, once, with integer money; the event
itself must be recoverable from its rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from mcp_budget_governor import (
    MAX_AMOUNT,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    LimitExceeded,
    MemoryBackend,
    OnExceed,
    Policy,
    PriceTable,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.events import LedgerEvent, encode, parse
from mcp_budget_governor.ledger import LedgerEntry
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream import archiver as archiver_module
from mcp_budget_governor.stream.archiver import SCHEMA, TEMP_SUFFIX, Archiver, segment_name

TOPIC = "mcpbg.ledger"
SOURCE = "/mcpbg/test"
NOON = datetime(2025, 11, 29, 12, 0, tzinfo=UTC).timestamp()
MIDNIGHT = datetime(2025, 11, 30, tzinfo=UTC).timestamp()
PRICES = PriceTable().with_price("m", 3, 15, cache_read_per_mtok="0.3")
MONEY_AND_COUNTS = (
    "partition",
    "offset",
    "amount",
    "expire_at",
    "status",
    "charge_index",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
)


class Clock:
    """A clock the test moves: each reading advances it by ``step`` seconds."""

    def __init__(self, start: float, step: float = 0.25) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=3, window=Window.MINUTE, scope=Scope.USER),
        Limit("tenant_calls", cap=1_000, window=Window.DAY, scope=Scope.TENANT),
        Limit("tool_calls", cap=2, window=Window.HOUR, scope=Scope.TOOL, on_exceed=OnExceed.ALERT),
        Limit("spend", cap=usd(1), window=Window.DAY, unit=Unit.USD_MICROS),
        Limit("tokens", cap=10**9, window=Window.MONTH, unit=Unit.TOKENS, scope=Scope.TENANT),
        Limit("session_spend", cap=usd(1), window=Window.SESSION, unit=Unit.USD_MICROS,
              scope=Scope.SESSION, gated=False),
    )  # fmt: skip


async def workload(clock: Clock, rounds: int = 6) -> list[LedgerEntry]:
    """Admissions, rejections, shadow alerts, metered costs, token metering, reservations."""
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(clock=clock), ledger=ledger, prices=PRICES, clock=clock)
    users = ["u1", "u:2", "ü3"]  # a separator and non-ASCII in ids
    for i in range(rounds):
        ctx = Context(user=users[i % 3], tenant="acme", tool=f"t{i % 2}", session=f"s{i % 2}")
        await gov.check(ctx)  # burst refuses each user's 4th call; tool_calls only alerts
        await gov.meter("spend", 1_000 + i, ctx)
        await gov.meter_tokens(
            "tokens", "m", input_tokens=900 + i, output_tokens=40, cache_read_tokens=100, ctx=ctx
        )
        await gov.meter_tokens("spend", "m", input_tokens=2_000, output_tokens=500, ctx=ctx)
        await gov.meter("session_spend", 7, ctx)
    await gov.check(Context(agent="a7"))  # no scope of a gated limit: no charge
    async with gov.reserved("spend", 50_000, Context(user="u9", tenant="acme")) as r:
        r.actual = 20_000
    async with gov.reserved("spend", 30_000, Context(user="u9")) as r:
        r.release()
    with contextlib.suppress(LimitExceeded):
        async with gov.reserved("spend", usd(5), Context(user="u9")):
            pytest.fail("a reservation past the cap was admitted")
    await gov.aclose()
    return ledger.entries


def as_consumed(entries: Sequence[LedgerEntry]) -> list[tuple[int, LedgerEvent]]:
    """(offset, parsed event) as the worker holds them, offsets = ledger positions."""
    return [(offset, parse(encode(e, SOURCE))) for offset, e in enumerate(entries)]


def totals(entries: Sequence[LedgerEntry]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for entry in entries:
        for charge in entry.charges:
            out[charge.key] += charge.amount
    return dict(out)


def write_in_batches(
    archiver: Archiver, partition: int, records: Sequence[tuple[int, LedgerEvent]], size: int
) -> list[Path]:
    written: list[Path] = []
    for i in range(0, len(records), size):
        written += archiver.write_batch(partition, records[i : i + size])
    return written


def read_rows(directory: Path) -> list[dict[str, Any]]:
    table = ds.dataset(directory, format="parquet", partitioning="hive").to_table()
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def event_from_rows(rows: Sequence[dict[str, Any]]) -> LedgerEvent:
    """Rebuild the CloudEvent from its archive rows (they must hold all of it)."""
    first = rows[0]
    charges = [
        {name: row[name] for name in ("limit", "unit", "amount", "window", "bucket", "key")}
        | {"expire_at": row["expire_at"]}
        for row in sorted(rows, key=lambda r: r["charge_index"])
        if row["charge_index"] is not None
    ]
    usage = None
    if first["model"] is not None:
        usage = {
            name: first[name]
            for name in (
                "model",
                "input_tokens",
                "output_tokens",
                "cache_read_tokens",
                "cache_write_tokens",
                "price_version",
            )
        }
    doc = {
        "specversion": "1.0",
        "id": first["id"],
        "source": first["source"],
        "type": first["type"],
        "time": first["time"].isoformat(),
        "subject": first["subject"],
        "datacontenttype": "application/json",
        "data": {
            "context": {d: first[d] for d in ("user", "tenant", "tool", "session", "agent")},
            "charges": charges,
            "decision": {
                "limit": first["decision_limit"],
                "status": first["status"],
                "over": first["over"],
                "degraded": first["degraded"],
            },
            "usage": usage,
            "reservation": first["reservation"],
        },
    }
    return parse(orjson.dumps(doc))


@pytest.fixture
async def ledger() -> list[LedgerEntry]:
    return await workload(Clock(NOON))


def test_workload_is_mixed(ledger: list[LedgerEntry]) -> None:
    kinds = {e.type.value for e in ledger}
    assert kinds == {"admitted", "rejected", "metered", "reserved", "settled", "released"}
    assert any(not e.charges for e in ledger if e.type.value == "admitted")
    assert any(e.over for e in ledger)
    assert any(e.usage is not None and e.usage.cache_read_tokens for e in ledger)
    assert any(c.amount < 0 for e in ledger for c in e.charges)  # settled / released deltas


def test_rows_hold_every_charge_and_every_event(ledger: list[LedgerEntry], tmp_path: Path) -> None:
    records = as_consumed(ledger)
    archiver = Archiver(tmp_path / "archive", topic=TOPIC)
    written = write_in_batches(archiver, 3, records, size=7)

    assert files(tmp_path / "archive") == sorted(written)
    rows = read_rows(tmp_path / "archive")
    assert len(rows) == sum(max(1, len(e.charges)) for e in ledger)
    sums: dict[str, int] = defaultdict(int)
    for row in rows:
        if row["key"] is not None:
            sums[row["key"]] += row["amount"]
    assert dict(sums) == totals(ledger)

    by_offset: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        assert (row["topic"], row["partition"]) == (TOPIC, 3)
        assert str(row["date"]) == "2025-11-29"
        by_offset[row["offset"]].append(row)
    assert sorted(by_offset) == list(range(len(ledger)))
    for offset, event in records:
        assert event_from_rows(by_offset[offset]) == event
    # admissions and rejections stay countable: one row per event at charge_index 0 or NULL
    firsts = [r for r in rows if (r["charge_index"] or 0) == 0]
    assert len(firsts) == len(ledger)
    assert sum(r["type"] == "mcpbg.rejected.v1" for r in firsts) == sum(
        e.type.value == "rejected" for e in ledger
    )


def test_file_names_and_folders(ledger: list[LedgerEntry], tmp_path: Path) -> None:
    records = as_consumed(ledger)
    archiver = Archiver(tmp_path, topic=TOPIC)
    written = write_in_batches(archiver, 12, records, size=10)
    folder = tmp_path / "date=2025-11-29"
    expected = [
        folder / segment_name(TOPIC, 12, records[i][0], records[min(i + 10, len(records)) - 1][0])
        for i in range(0, len(records), 10)
    ]
    assert written == expected
    assert written[0].name == f"{TOPIC}-p12-{0:020d}-{9:020d}.parquet"
    assert archiver.glob == str(tmp_path / "**" / "*.parquet")


def test_money_and_counts_are_int64(ledger: list[LedgerEntry], tmp_path: Path) -> None:
    (path,) = Archiver(tmp_path, topic=TOPIC).write_batch(0, as_consumed(ledger))
    schema = pq.read_schema(path)
    for name in MONEY_AND_COUNTS:
        assert schema.field(name).type == pa.int64(), name
    assert schema.field("time").type == pa.timestamp("us", tz="UTC")
    assert schema.field("degraded").type == pa.bool_()
    assert schema.metadata[b"mcpbg.archive.schema"] == b"1"
    assert schema.remove_metadata() == SCHEMA.remove_metadata()
    # no float anywhere in the file
    assert not any(pa.types.is_floating(f.type) for f in schema)


def test_big_amounts_stay_exact(tmp_path: Path) -> None:
    """The extreme amounts and offsets come back exact (an offset past 2**53 too)."""
    raw = orjson.loads(encode(_metered_entry(), SOURCE))
    raw["type"] = "mcpbg.released.v1"  # the kind whose charges are negative
    raw["data"]["charges"][0]["amount"] = -MAX_AMOUNT
    expire_at = raw["data"]["charges"][0]["expire_at"]
    event = parse(orjson.dumps(raw))
    (path,) = Archiver(tmp_path, topic=TOPIC).write_batch(0, [(2**63 - 1, event)])
    row = pq.read_table(path).to_pylist()[0]
    assert (row["amount"], row["expire_at"], row["offset"]) == (-MAX_AMOUNT, expire_at, 2**63 - 1)
    assert path.name.endswith(f"-{2**63 - 1:020d}-{2**63 - 1:020d}.parquet")


def _metered_entry() -> LedgerEntry:
    """One metered entry, from a sync test (no event loop is running there)."""

    async def one() -> LedgerEntry:
        ledger = MemoryLedger()
        gov = Governor(policy(), MemoryBackend(), ledger=ledger, clock=lambda: NOON)
        await gov.meter("spend", 5, Context(user="u"))
        return ledger.entries[0]

    return asyncio.run(one())


def test_redelivery_rewrites_the_same_files(ledger: list[LedgerEntry], tmp_path: Path) -> None:
    records = as_consumed(ledger)
    archiver = Archiver(tmp_path, topic=TOPIC)
    first = archiver.write_batch(0, records[:20])
    before = {p: p.read_bytes() for p in files(tmp_path)}
    # the worker died before committing: the same batch comes again, to a new archiver
    again = Archiver(tmp_path, topic=TOPIC).write_batch(0, records[:20])
    assert again == first
    after = {p: p.read_bytes() for p in files(tmp_path)}
    assert after == before  # same names, same count, byte-identical content
    assert pq.read_table(first[0]).num_rows == sum(max(1, len(e.charges)) for e in ledger[:20])


async def test_batch_crossing_midnight_makes_one_file_per_date(tmp_path: Path) -> None:
    entries = await workload(Clock(MIDNIGHT - 3), rounds=4)
    records = as_consumed(entries)
    days = [e.time >= MIDNIGHT for e in entries]
    assert False in days and True in days  # the workload straddles midnight UTC
    written = Archiver(tmp_path, topic=TOPIC).write_batch(5, records)

    before = [o for (o, _), late in zip(records, days, strict=True) if not late]
    after = [o for (o, _), late in zip(records, days, strict=True) if late]
    assert written == [
        tmp_path / "date=2025-11-29" / segment_name(TOPIC, 5, before[0], before[-1]),
        tmp_path / "date=2025-11-30" / segment_name(TOPIC, 5, after[0], after[-1]),
    ]
    assert files(tmp_path) == written
    for path in written:
        day = path.parent.name.removeprefix("date=")
        table = pq.read_table(path)
        assert {t.date().isoformat() for t in table.column("time").to_pylist()} == {day}
    rows = read_rows(tmp_path)
    assert sorted({r["offset"] for r in rows}) == [o for o, _ in records]


def test_dates_follow_utc_even_out_of_order(tmp_path: Path) -> None:
    """Event times need not follow offsets; a foreign offset in ``time`` is read as UTC."""
    base = orjson.loads(encode(_metered_entry(), SOURCE))
    # Settlements: the only events whose time may come after their charges' day ends.
    base["type"] = "mcpbg.settled.v1"
    times = ["2025-11-29T23:30:00-02:00", "2025-11-29T21:00:00Z", "2025-11-30T01:00:00+00:00"]
    records = []
    for offset, stamp in zip((10, 11, 12), times, strict=True):
        doc = base | {"time": stamp, "id": f"01938f5e-0000-7000-8000-0000000000{offset}"}
        records.append((offset, parse(orjson.dumps(doc))))
    written = Archiver(tmp_path, topic=TOPIC).write_batch(0, records)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        f"date=2025-11-29/{segment_name(TOPIC, 0, 11, 11)}",
        f"date=2025-11-30/{segment_name(TOPIC, 0, 10, 12)}",
    ]
    late = pq.read_table(written[1]).to_pylist()
    assert [r["time"] for r in late] == [
        datetime(2025, 11, 30, 1, 30, tzinfo=UTC),
        datetime(2025, 11, 30, 1, 0, tzinfo=UTC),
    ]


@pytest.fixture
def failing_write(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Make file writes fail: halfway through the bytes ("write"), or at the rename."""
    real_write_all = archiver_module._write_all

    def arm(point: str) -> None:
        def half_then_fail(fd: int, data: memoryview) -> None:
            real_write_all(fd, data[: len(data) // 2])
            raise OSError(28, "No space left on device")

        def no_rename(src: Any, dst: Any) -> None:
            raise OSError(5, "Input/output error")

        if point == "write":
            monkeypatch.setattr(archiver_module, "_write_all", half_then_fail)
        else:
            monkeypatch.setattr(os, "replace", no_rename)

    return arm


@pytest.mark.parametrize("point", ["write", "rename"])
def test_a_failed_write_leaves_no_temp_file(
    ledger: list[LedgerEntry],
    tmp_path: Path,
    failing_write: Callable[[str], None],
    point: str,
) -> None:
    records = as_consumed(ledger)
    archiver = Archiver(tmp_path, topic=TOPIC)
    (good,) = archiver.write_batch(0, records[:10])
    content = good.read_bytes()

    failing_write(point)
    with pytest.raises(OSError, match=r"No space|Input/output"):
        archiver.write_batch(0, records[10:20])  # a new file
    with pytest.raises(OSError, match=r"No space|Input/output"):
        archiver.write_batch(0, records[:10])  # a redelivery over an existing file
    assert files(tmp_path) == [good]  # no temp file, no half file
    assert good.read_bytes() == content  # the file in place is untouched


def test_remove_stale_temp_files(tmp_path: Path) -> None:
    archiver = Archiver(tmp_path, topic=TOPIC)
    folder = tmp_path / "date=2025-11-29"
    folder.mkdir()
    stale = folder / f".{segment_name(TOPIC, 0, 0, 9)}.dead{TEMP_SUFFIX}"
    fresh = folder / f".{segment_name(TOPIC, 1, 0, 9)}.busy{TEMP_SUFFIX}"
    kept = folder / segment_name(TOPIC, 0, 0, 9)
    for path in (stale, fresh, kept):
        path.write_bytes(b"x")
    os.utime(stale, (0, 0))
    os.utime(kept, (0, 0))
    assert archiver.remove_stale_temp_files(older_than=600) == 1
    assert files(tmp_path) == sorted([fresh, kept])


def test_bad_input_is_refused(ledger: list[LedgerEntry], tmp_path: Path) -> None:
    records = as_consumed(ledger)
    for topic in ("", "a/b", "..", "x" * 250, "ledger topic"):
        with pytest.raises(InvalidInputError, match="topic"):
            Archiver(tmp_path, topic=topic)
    archiver = Archiver(tmp_path, topic=TOPIC)
    assert archiver.write_batch(0, []) == []
    with pytest.raises(InvalidInputError, match="partition"):
        archiver.write_batch(-1, records[:2])
    with pytest.raises(ValueError, match="offsets must ascend"):
        archiver.write_batch(0, [records[1], records[0]])
    with pytest.raises(ValueError, match="offsets must ascend"):
        archiver.write_batch(0, [records[0], records[0]])
    assert files(tmp_path) == []


# -- DuckDB over the archive ------------------------------------------------------

DEDUP = """
    SELECT * FROM read_parquet('{glob}', hive_partitioning = true)
    QUALIFY row_number() OVER (PARTITION BY id, charge_index ORDER BY "partition", "offset") = 1
"""


@pytest.fixture
def duckdb() -> Any:
    return pytest.importorskip("duckdb")


def test_duckdb_sums_per_key_equal_the_ledger(
    duckdb: Any, ledger: list[LedgerEntry], tmp_path: Path
) -> None:
    archiver = Archiver(tmp_path, topic=TOPIC)
    write_in_batches(archiver, 0, as_consumed(ledger), size=9)
    con = duckdb.connect()
    glob = archiver.glob
    rows = con.execute(
        f"SELECT key, sum(amount) FROM read_parquet('{glob}', hive_partitioning=true) GROUP BY key"
    ).fetchall()
    sums = {key: total for key, total in rows if key is not None}
    assert sums == totals(ledger)
    # the NULL group is the one row of each event without a charge
    (empty,) = [total for key, total in rows if key is None]
    assert empty is None
    ((chargeless,),) = con.execute(
        f"SELECT count(*) FROM read_parquet('{glob}') WHERE charge_index IS NULL"
    ).fetchall()
    assert chargeless == sum(not e.charges for e in ledger)

    types = dict(
        con.execute(
            f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM "
            f"read_parquet('{glob}', hive_partitioning = true))"
        ).fetchall()
    )
    assert {types[name] for name in MONEY_AND_COUNTS} == {"BIGINT"}
    assert (types["time"], types["date"]) == ("TIMESTAMP WITH TIME ZONE", "DATE")

    spend = con.execute(
        f"""SELECT "user", date, sum(amount) FROM read_parquet('{glob}', hive_partitioning = true)
            WHERE "limit" = 'spend' GROUP BY ALL ORDER BY ALL"""
    ).fetchall()
    expected: dict[str | None, int] = defaultdict(int)
    for e in ledger:
        for c in e.charges:
            if c.limit == "spend":
                expected[e.context.user] += c.amount
    assert {(u, str(d)): s for u, d, s in spend} == {
        (u, "2025-11-29"): s for u, s in expected.items()
    }


def test_duckdb_dedup_removes_overlapping_redeliveries(
    duckdb: Any, ledger: list[LedgerEntry], tmp_path: Path
) -> None:
    records = as_consumed(ledger)
    assert len(records) > 30
    archiver = Archiver(tmp_path, topic=TOPIC)
    archiver.write_batch(0, records[:20])
    archiver.write_batch(0, records[10:30])  # re-batched after a rebalance: 10-19 twice
    archiver.write_batch(0, records[30:])
    # a producer retry that reached the broker twice: event 3 again at a later offset
    archiver.write_batch(0, [(len(records) + 100, records[3][1])])
    con = duckdb.connect()
    glob = archiver.glob

    raw = dict(
        con.execute(f"SELECT key, sum(amount) FROM read_parquet('{glob}') GROUP BY key").fetchall()
    )
    raw.pop(None)
    assert raw != totals(ledger)  # read naively, the overlap counts twice

    deduped = con.execute(
        f"SELECT key, sum(amount) FROM ({DEDUP.format(glob=glob)}) WHERE key IS NOT NULL "
        "GROUP BY key"
    ).fetchall()
    assert dict(deduped) == totals(ledger)
    ((events, kept_offsets),) = con.execute(
        f'SELECT count(DISTINCT id), max("offset") FROM ({DEDUP.format(glob=glob)})'
    ).fetchall()
    assert (events, kept_offsets) == (len(ledger), len(ledger) - 1)


def test_a_date_folder_removed_meanwhile_is_made_again(
    ledger: list[LedgerEntry], tmp_path: Path
) -> None:
    records = as_consumed(ledger)
    archiver = Archiver(tmp_path, topic=TOPIC)
    (first,) = archiver.write_batch(0, records[:5])
    first.unlink()
    first.parent.rmdir()  # a retention job dropped the day
    (again,) = archiver.write_batch(0, records[5:10])
    assert files(tmp_path) == [again]
