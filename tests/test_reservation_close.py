"""Every reservation ends with exactly one closing event, the estimate left to stand too.

A reservation whose ``actual`` is never set keeps its estimate as the charge; its
ledger still gets a ``settled`` event naming it (no charges: the delta is zero), so
readers can tell a closed reservation from an open one. On real Redis, with the file
ledger and its projector, then with the Kafka ledger and the ``mcpbg worker``
subprocess: the counters end committed with nothing in flight, ``mcpbg reconcile``
finds nothing, ``mcpbg budgets`` lists no open reservation, and ``mcpbg costs`` and the
FOCUS export bill each estimate that stood once.
"""

from __future__ import annotations

import asyncio
import csv
import json
from collections import Counter
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.ledger import LedgerEntry
from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.ledger_view import open_ledger
from mcp_budget_governor.stream.archiver import Archiver
from testing.ledger_run import run_cli
from testing.stream_support import (
    Stream,
    assert_exact,
    backend,
    engine,
    kafka,
    names,
    stream,
    workers,
)

__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures

POLICY_TOML = """\
[[limits]]
name = "spend"
cap_usd = "10"
window = "day"
scope = "user"
"""
ALICE = Context(user="alice", tenant="acme", tool="search")
#: What the four reservations of :func:`four_reservations` bill: the estimate that
#: stood, the exact one, the settled one's actual, nothing for the released one.
BILLED = usd("0.50") + usd("0.30") + usd("0.10")


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``mcpbg *argv`` as an operator runs it (in a thread: it starts its own loop)."""
    return await asyncio.to_thread(run_cli, capsys, *argv)


def spend_policy() -> Policy:
    return Policy.of(
        Limit("spend", cap=usd(10), window=Window.DAY, scope=Scope.USER, unit=Unit.USD_MICROS)
    )


async def four_reservations(gov: Governor) -> list[str]:
    """An estimate left to stand, an exact one, one settled lower, one released; their
    ids (the reserved events': none without a ledger)."""
    ids: list[str | None] = []
    async with gov.reserved("spend", usd("0.50"), ALICE) as standing:
        pass  # actual never set: the estimate stands
    ids.append(standing.id)
    async with gov.reserved("spend", usd("0.30"), ALICE) as exact:
        exact.actual = usd("0.30")
    ids.append(exact.id)
    async with gov.reserved("spend", usd("0.40"), ALICE) as lower:
        lower.actual = usd("0.10")
    ids.append(lower.id)
    async with gov.reserved("spend", usd("0.20"), ALICE) as unused:
        unused.release()
    ids.append(unused.id)
    return [i for i in ids if i is not None]


def closes(entries: list[Any], ids: list[str]) -> dict[str, list[tuple[str, int]]]:
    """Per reservation id, its closing events: (kind, the sum of their charges)."""
    out: dict[str, list[tuple[str, int]]] = {i: [] for i in ids}
    for e in entries:
        if e.reservation in out:
            out[e.reservation].append((e.kind, e.total))
    return out


class Seen:
    """An event's kind, reservation and charge total, from an entry or a parsed event."""

    def __init__(self, kind: str, reservation: str | None, total: int) -> None:
        self.kind, self.reservation, self.total = kind, reservation, total

    @classmethod
    def of_entry(cls, e: LedgerEntry) -> Seen:
        return cls(e.type.value, e.reservation, sum(c.amount for c in e.charges))

    @classmethod
    def of_event(cls, e: LedgerEvent) -> Seen:
        kind = e.type.split(".")[1]
        return cls(kind, e.data.reservation, sum(c.amount for c in e.data.charges))


EXPECTED_CLOSES = [
    [("settled", 0)],  # the estimate stood: a zero delta, no charges
    [("settled", 0)],  # exact
    [("settled", usd("0.10") - usd("0.40"))],
    [("released", -usd("0.20"))],
]


async def test_every_reservation_writes_one_closing_event_and_no_zero_round_trip() -> None:
    """Memory ledger: the four ends each write one close; a zero delta never goes to the
    counters (no round trip), with a ledger or without."""
    calls: Counter[str] = Counter()

    class Counting(MemoryBackend):
        async def charge(self, *args: Any, **kwargs: Any) -> Any:
            calls["charge"] += 1
            return await super().charge(*args, **kwargs)

    ledger = MemoryLedger()
    gov = Governor(spend_policy(), Counting(), ledger=ledger)
    ids = await four_reservations(gov)
    found = closes([Seen.of_entry(e) for e in ledger.entries], ids)
    assert [found[i] for i in ids] == EXPECTED_CLOSES
    # 4 reservations + the settled delta + the release; the two zero deltas: none.
    assert calls["charge"] == 6
    assert await gov.usage("spend", ALICE) == BILLED

    calls.clear()
    bare = Governor(spend_policy(), Counting())  # no ledger: nothing to write either
    await four_reservations(bare)
    assert calls["charge"] == 6 and await bare.usage("spend", ALICE) == BILLED
    # An explicit settle reports the limit's total, so it reads it even for a zero delta.
    held = await bare.reserve("spend", usd("0.05"), ALICE)
    calls.clear()
    result = await bare.settle(held, usd("0.05"))
    assert calls["charge"] == 1 and result.total == BILLED + usd("0.05")


async def test_file_ledger_standing_estimate_is_closed_committed_and_billed_once(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(POLICY_TOML)
    folder = tmp_path / "ledger"
    ledger = FileLedger(folder, fsync="never")
    backend = RedisBackend.from_url(redis_url, timeout=5.0)
    gov = Governor(Policy.from_file(policy_file), backend, ledger=ledger)
    ids = await four_reservations(gov)
    await ledger.aclose()

    # Before the projection: the estimates are in flight, yet none is listed open.
    budgets = ["budgets", "--policy", str(policy_file), "--redis-url", redis_url]
    code, out, _ = await cli(capsys, *budgets, "--ledger-dir", str(folder), "--json")
    assert code == 0 and json.loads(out)["open_reservations"] == []

    await FileProjector(folder, backend).catch_up()
    con = open_ledger(ledger_dir=folder)
    rows = con.execute(
        'SELECT "type", reservation, coalesce(sum(amount), 0) FROM ledger '
        'WHERE reservation IS NOT NULL GROUP BY id, "type", reservation'
    ).fetchall()
    seen = [Seen(t.split(".")[1], r, int(a)) for t, r, a in rows]
    found = closes(seen, ids)
    assert [found[i] for i in ids] == EXPECTED_CLOSES
    query = "SELECT DISTINCT key FROM ledger WHERE key IS NOT NULL"
    [key] = [k for (k,) in con.execute(query).fetchall()]
    con.close()
    state = await backend.state(key)
    assert (state.committed, state.in_flight, state.pending) == (BILLED, 0, {})
    await backend.aclose()

    store = ["--redis-url", redis_url, "--ledger-dir", str(folder)]
    code, out, _ = await cli(capsys, "reconcile", *store, "--older-than", "0")
    assert code == 0 and "no drift" in out and "no orphaned in-flight amounts" in out, out
    code, out, _ = await cli(capsys, *budgets, "--ledger-dir", str(folder), "--json")
    assert code == 0 and json.loads(out)["open_reservations"] == []

    code, out, _ = await cli(capsys, "costs", "--ledger-dir", str(folder), "--by", "user", "--json")
    assert code == 0, out
    [alice] = json.loads(out)["spend by user"]
    assert (alice["events"], alice["usd_micros"]) == (8, BILLED)  # 4 reserved, 4 closes
    target = tmp_path / "focus.csv"
    month = datetime.now(UTC).strftime("%Y-%m")
    export = ["export", "focus", "--period", month, "--ledger-dir", str(folder)]
    code, out, err = await cli(capsys, *export, "--out", str(target), "--quiet")
    assert code == 0, err
    with target.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert sum(Decimal(r["BilledCost"]) for r in rows) == Decimal(BILLED) / 10**6
    # Three completed calls, each once (the estimate that stood, the exact one, the
    # settled one); the released one is none.
    assert [(r["x_Meter"], r["ConsumedQuantity"]) for r in rows] == [("tool_calls", "3.0")]


async def test_the_worker_projects_each_close_once_and_reconcile_finds_nothing(
    stream: Stream, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Kafka ledger and the ``mcpbg worker`` subprocess: every close is applied (none
    dead-lettered), each counter is its ledger's sum with nothing in flight, and the
    topic archived as the worker's archiver writes it reconciles clean."""
    async with stream.governor(spend_policy()) as gov:
        ids = []
        for _ in range(3):
            ids += await four_reservations(gov)
    worker = stream.start_worker()
    records = await stream.caught_up()
    found = closes([Seen.of_event(r.event) for r in records], ids)
    assert [found[i] for i in ids] == EXPECTED_CLOSES * 3
    assert await assert_exact(stream.backend, records) == len(records) == 4 * 3 * 2
    key = next(c.key for r in records for c in r.event.data.charges)
    assert (await stream.backend.state(key)).committed == 3 * BILLED
    assert worker.terminate() == 0, worker.tail()
    assert f"{len(records)} applied, 0 dead" in worker.text(), worker.tail()

    archive = stream.tmp_path / "archive"
    archiver = Archiver(archive, topic=stream.topic)
    by_partition: dict[int, list[tuple[int, LedgerEvent]]] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append((r.offset, r.event))
    for p, batch in by_partition.items():
        archiver.write_batch(p, batch)
    store = ["--redis-url", stream.redis_url, "--archive-dir", str(archive)]
    code, out, _ = await cli(capsys, "reconcile", *store, "--older-than", "0")
    assert code == 0 and "no drift" in out and "no orphaned in-flight amounts" in out, out
