"""A fixed price is charged by the admission (one round trip, issue 33): a burst of
500 priced calls from 4 processes against $1 of room, some tools raising and some
calls cancelled, never spends past $1, and the counters, ``mcpbg costs`` and the
FOCUS file agree to the micro."""

from __future__ import annotations

import asyncio
import csv
import json
import multiprocessing
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from mcp_budget_governor import Governor, RedisBackend
from mcp_budget_governor.cli import main as cli
from mcp_budget_governor.ledger import EntryType, LedgerEntry
from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
from testing.priced_burst import CTX, PRICE, ROOM, priced_calls, priced_policy


@pytest.mark.slow
def test_500_priced_calls_from_4_processes_never_spend_past_the_room_and_all_agree(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0  # every process is connected and waiting by then
    with ctx.Pool(4) as pool:
        per_process = pool.starmap(priced_calls, [(redis_url, 125, start_at, s) for s in range(4)])
    entries: list[LedgerEntry] = [e for got, _ in per_process for e in got]
    outcomes = Counter[str]()
    for _, ended in per_process:
        outcomes.update(ended)
    # Tools raised and calls were cancelled, admitted and refused alike.
    assert outcomes["failed"] > 0 and outcomes["cancelled"] > 0 and outcomes["refused"] > 0
    kinds = Counter(e.type for e in entries)
    # One admission event and one cost event per admitted call, nothing else charged.
    assert kinds[EntryType.ADMITTED] == kinds[EntryType.METERED] > 0
    assert set(kinds) <= {EntryType.ADMITTED, EntryType.METERED, EntryType.REJECTED}
    spent = sum(c.amount for e in entries for c in e.charges if c.limit == "spend")
    assert spent == kinds[EntryType.METERED] * PRICE
    assert spent == ROOM  # $5 asked for: the room fills exactly, never past it

    ledger_dir = tmp_path / "ledger"

    async def project() -> tuple[int, int, int]:
        ledger = FileLedger(ledger_dir)
        for entry in entries:
            await ledger.append(entry)
        await ledger.aclose()
        backend = RedisBackend.from_url(redis_url)
        gov = Governor(priced_policy(), backend)
        key = gov._read_slot("spend", CTX).key
        hot = await backend.state(key)  # the hot path's in-flight amounts, per event
        await FileProjector(ledger_dir, backend).catch_up()
        state = await backend.state(key)
        await gov.aclose()
        return hot.committed + hot.in_flight, state.committed, state.in_flight

    hot_total, committed, in_flight = asyncio.run(project())
    assert hot_total == spent  # the admissions counted what the ledger says
    assert (committed, in_flight) == (spent, 0)  # each cost event moved exactly once

    day = datetime.now(UTC).date()
    span = ("--from", day.isoformat(), "--to", (day + timedelta(days=1)).isoformat())
    capsys.readouterr()
    assert cli(["costs", *span, "--ledger-dir", str(ledger_dir), "--json"]) == 0
    summary = next(iter(json.loads(capsys.readouterr().out).values()))
    assert sum(row["usd_micros"] for row in summary) == spent
    out = tmp_path / "focus.csv"
    focus = ["export", "focus", *span, "--ledger-dir", str(ledger_dir), "--out", str(out)]
    assert cli([*focus, "--quiet"]) == 0
    with out.open(newline="") as fh:
        billed = sum(Decimal(row["BilledCost"]) for row in csv.DictReader(fh))
    assert billed * 10**6 == spent
