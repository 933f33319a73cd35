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
import random
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
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
    usd,
)
from mcp_budget_governor.events import encode, parse
from mcp_budget_governor.keys import WATERMARK_KEY
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.ledger_view import COLUMNS, LedgerError, open_ledger
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
        found.setdefault(zlib.crc32(f"t{i}".encode()) % PARTITIONS, f"t{i}")
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
    return zlib.crc32((ctx.tenant or ctx.user or "-").encode()) % PARTITIONS


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
