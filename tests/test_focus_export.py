"""``mcpbg export focus`` end to end: a generated month, the official validator, bad input.

The month comes from ``testing/ledger_gen.py`` (several tenants, users and
tools; model calls with all four token meters; reservations, settlements and
releases without a model, i.e. tool-call costs; admissions and rejections that
carry no USD). The export must pass focus-validator 2.2.1 with no real
failure, bill exactly the ledger's USD, split each call as ``focus.split_cost``
does, and obey every rule ``focus_checks.check_row`` enforces.
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Scope, Unit, Window
from mcp_budget_governor.cli import main
from mcp_budget_governor.focus import (
    FOCUS_1_2,
    TOKEN_METERS,
    decimal_text,
    list_cost_micros,
    split_cost,
    tier_rates,
)
from mcp_budget_governor.focus_checks import check_row
from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger
from mcp_budget_governor.projections import focus_export
from mcp_budget_governor.projections.ledger_view import LedgerError, open_ledger
from testing.focus_validator_env import validate
from testing.ledger_gen import GenStats, write_archive

EVENTS = 6_000
MONTH = "2026-11"


@pytest.fixture(scope="module")
def month(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GenStats]:
    archive = tmp_path_factory.mktemp("archive")
    return archive, write_archive(archive, EVENTS, seed=5, month=MONTH, tenants=4, users=40)


@pytest.fixture(scope="module")
def exported(
    month: tuple[Path, GenStats], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    archive, _ = month
    out = tmp_path_factory.mktemp("focus")
    files = {"csv": out / "focus.csv", "parquet": out / "focus.parquet"}
    for path in files.values():
        code = main(
            [
                *("export", "focus", "--period", MONTH, "--archive-dir", str(archive)),
                *("--out", str(path), "--quiet"),
            ]
        )
        assert code == 0
    return files


def rows_of(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="ascii") as f:  # ASCII: a stray byte fails here
        return list(csv.DictReader(f))


def micros(text: str) -> int:
    value = Decimal(text) * 1_000_000
    assert value == value.to_integral_value(), text
    return int(value)


def test_the_export_passes_focus_validator_with_no_real_failure(
    exported: dict[str, Path],
) -> None:
    for fmt, path in exported.items():
        report = validate(path)
        failing = sorted(report.real_failures)
        print(
            f"{fmt}: {len(report.passed)} passed, {len(report.skipped)} skipped, "
            f"excused {report.excused}, failing {failing}"
        )
        assert not failing, f"{fmt}: focus-validator rules failing: {report.real_failures}"
        assert len(report.passed) > 150  # the rules did run


def test_billed_cost_is_the_ledgers_usd_to_the_micro(
    month: tuple[Path, GenStats], exported: dict[str, Path]
) -> None:
    archive, stats = month
    rows = rows_of(exported["csv"])
    billed = sum(micros(r["BilledCost"]) for r in rows)
    con = open_ledger(archive)
    (ledger_usd,) = con.execute("SELECT sum(usd_micros) FROM costs").fetchone() or (0,)
    assert billed == ledger_usd == stats.usd_micros
    # The same total from the Parquet file, read as exact decimals.
    (parquet,) = duckdb.connect().execute(
        f"SELECT sum(BilledCost) FROM read_parquet('{exported['parquet']}')"
    ).fetchone() or (0,)
    assert micros(str(parquet)) == billed
    # Each costed event is counted once per meter it has; admissions and rejections never.
    # (Every generated model call has output tokens, so its output row counts it.)
    tools, calls = con.execute(
        "SELECT count(*) FILTER (WHERE model IS NULL), count(*) FILTER (WHERE model IS NOT NULL) "
        "FROM costs WHERE usd_micros <> 0"
    ).fetchone() or (0, 0)
    counted: dict[str, int] = defaultdict(int)
    for r in rows:
        counted[r["x_Meter"]] += int(r["x_EventCount"])
    assert (counted["tool_calls"], counted["output"]) == (tools, calls)
    assert stats.by_type["mcpbg.rejected.v1"] > 0 and stats.by_type["mcpbg.admitted.v1"] > 0
    assert tools + calls < stats.events - stats.by_type["mcpbg.rejected.v1"]


def test_every_row_obeys_the_self_enforced_rules(exported: dict[str, Path]) -> None:
    rows = rows_of(exported["csv"])
    assert list(rows[0]) == list(FOCUS_1_2.names)
    problems = [(i, p) for i, row in enumerate(rows) for p in check_row(row)]
    assert problems == []
    meters = {r["x_Meter"] for r in rows}
    assert meters == {"input", "output", "cache_read", "cache_write", "tool_calls"}
    assert len({r["SubAccountId"] for r in rows}) > 1 and len({r["x_ToolName"] for r in rows}) > 1


def test_each_calls_micros_are_split_over_its_meters_as_split_cost_does(
    month: tuple[Path, GenStats], exported: dict[str, Path]
) -> None:
    """The SQL split, summed per row, equals focus.split_cost applied event by event."""
    archive, _ = month
    prices = PriceTable.builtin()
    con = open_ledger(archive)
    events = con.execute(
        """SELECT date_trunc('hour', "time"), "user", tool, model, usd_micros, input_tokens,
                  output_tokens, cache_read_tokens, cache_write_tokens
           FROM costs WHERE usd_micros <> 0 AND model IS NOT NULL"""
    ).fetchall()
    expected: dict[tuple[str, str, str, str, str], int] = defaultdict(int)
    for hour, user, tool, model, usd_micros, inp, out, cr, cw in events:
        rates = next(r for start, r in reversed(tier_rates(prices.price_of(model))) if inp > start)
        tokens = [inp - cr - cw, out, cr, cw]
        weights = [list_cost_micros(t, r) for t, r in zip(tokens, rates, strict=True)]
        shares = split_cost(usd_micros, weights, tokens)
        for meter, share, count in zip(TOKEN_METERS, shares, tokens, strict=True):
            if share or count:
                key = (f"{hour:%Y-%m-%dT%H:%M:%SZ}", user, tool, model, meter.value)
                expected[key] += share
    got = {
        (
            r["ChargePeriodStart"],
            r["x_UserId"],
            r["x_ToolName"],
            r["x_ModelId"],
            r["x_Meter"],
        ): micros(r["BilledCost"])
        for r in rows_of(exported["csv"])
        if r["x_Meter"] != "tool_calls"
    }
    assert got == dict(expected)


def test_day_granularity_and_a_range(month: tuple[Path, GenStats], tmp_path: Path) -> None:
    archive, _ = month
    out = tmp_path / "days.csv"
    code = main(
        [
            # --to names the last day exported (inclusive, as in mcpbg costs).
            *("export", "focus", "--from", "2026-11-02", "--to", "2026-11-03"),
            *("--granularity", "day", "--archive-dir", str(archive), "--out", str(out), "--quiet"),
        ]
    )
    assert code == 0
    rows = rows_of(out)
    assert {r["ChargePeriodStart"] for r in rows} == {
        "2026-11-02T00:00:00Z",
        "2026-11-03T00:00:00Z",
    }
    assert all(check_row(r) == [] for r in rows)
    con = open_ledger(archive)
    (usd,) = con.execute(
        """SELECT sum(usd_micros) FROM costs WHERE "time" >= TIMESTAMPTZ '2026-11-02 00:00Z'
                                                AND "time" < TIMESTAMPTZ '2026-11-04 00:00Z'"""
    ).fetchone() or (0,)
    assert sum(micros(r["BilledCost"]) for r in rows) == usd


async def test_a_file_ledger_with_unusual_names_exports_ascii(tmp_path: Path) -> None:
    """Real governor events: a model call, a tool's own cost, a refusal, a non-ASCII user."""
    t0 = datetime(2026, 11, 3, 10, 15, tzinfo=UTC).timestamp()
    ledger = FileLedger(tmp_path / "ledger")
    gov = Governor(
        Policy.of(
            Limit("calls", cap=1, window=Window.DAY, scope=Scope.USER),
            Limit("spend", cap=10**9, window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
        ),
        MemoryBackend(),
        ledger=ledger,
        prices=PriceTable().with_price("m-1", 3, 15, 0.3, 3.75),
        clock=lambda: t0,
    )
    who = Context(user='müller,"x"', tenant="acme", tool="search")
    assert (await gov.check(who)).admitted
    # A refusal as the governor records it: no charge, so no cost row.
    await ledger.append(
        LedgerEntry(new_id(), EntryType.REJECTED, t0, who, limit="calls", status=429)
    )
    await gov.meter_tokens(
        "spend",
        "m-1",
        input_tokens=10_000,
        output_tokens=500,
        cache_read_tokens=4_000,
        cache_write_tokens=1_000,
        ctx=who,
    )
    await gov.meter("spend", 50_000, Context(user="bot", tool="sql"))
    await gov.aclose()

    out = tmp_path / "out.csv"
    module = tmp_path / "prices_mod.py"
    module.write_text(
        "from mcp_budget_governor.prices import PriceTable\n"
        "TABLE = PriceTable().with_price('m-1', 3, 15, 0.3, 3.75)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(
            [
                *("export", "focus", "--from", "2026-11-03T10:00Z", "--to", "2026-11-03T11:00Z"),
                *("--ledger-dir", str(tmp_path / "ledger"), "--out", str(out), "--quiet"),
                *("--prices", "prices_mod:TABLE"),
            ]
        )
    finally:
        sys.path.remove(str(tmp_path))
    assert code == 0
    rows = rows_of(out)
    assert all(check_row(r) == [] for r in rows)
    con = open_ledger(None, tmp_path / "ledger")
    assert con.execute(
        "SELECT count(*) FROM costs WHERE type = 'mcpbg.rejected.v1'"
    ).fetchall() == [(1,)]
    by_meter = {r["x_Meter"]: r for r in rows}
    assert len(rows) == len(by_meter)
    assert set(by_meter) == {"input", "output", "cache_read", "cache_write", "tool_calls"}
    # 5,000 uncached x $3 + 500 x $15 + 4,000 x $0.30 + 1,000 x $3.75 per MTok = 27,450 micros.
    assert {m: r["BilledCost"] for m, r in by_meter.items()} == {
        "input": "0.015",
        "output": "0.0075",
        "cache_read": "0.0012",
        "cache_write": "0.00375",
        "tool_calls": "0.05",
    }
    assert by_meter["input"]["x_UserId"] == 'm%C3%BCller,"x"'
    assert (
        by_meter["input"]["Tags"]
        == '{"tenant":"acme","user":"m%C3%BCller,\\"x\\"","tool":"search"}'
    )
    assert (
        by_meter["input"]["PricingQuantity"] == "0.005"
        and by_meter["input"]["ListUnitPrice"] == "3.0"
    )
    tool = by_meter["tool_calls"]
    assert (tool["SkuId"], tool["ConsumedQuantity"], tool["PricingUnit"]) == (
        "sql:tool_calls",
        "1.0",
        "USD",
    )
    assert tool["SubAccountId"] == "" and "tenant" not in tool["Tags"]


async def model_call_ledger(folder: Path) -> None:
    """An admission at 10:15, then at 11:15 a call of a model only a custom price table knows."""
    now = [datetime(2026, 11, 3, 10, 15, tzinfo=UTC).timestamp()]
    gov = Governor(
        Policy.of(
            Limit("calls", cap=5, window=Window.DAY, scope=Scope.USER),
            Limit("spend", cap=10**9, window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
        ),
        MemoryBackend(),
        ledger=FileLedger(folder),
        prices=PriceTable().with_price("house-model", 1, 2),
        clock=lambda: now[0],
    )
    who = Context(user="u1", tool="search")
    assert (await gov.check(who)).admitted
    now[0] += 3600
    await gov.meter_tokens("spend", "house-model", input_tokens=1_000, output_tokens=10, ctx=who)
    await gov.aclose()


async def test_a_period_with_events_but_no_cost_is_an_empty_export(tmp_path: Path) -> None:
    await model_call_ledger(tmp_path / "ledger")
    args = ["export", "focus", "--ledger-dir", str(tmp_path / "ledger"), "--quiet"]
    out = tmp_path / "empty.csv"
    hour = ["--from", "2026-11-03T10:00Z", "--to", "2026-11-03T11:00Z"]  # the admission only
    assert main([*args, *hour, "--out", str(out)]) == 0
    assert out.read_text().splitlines() == [",".join(FOCUS_1_2.names)]
    before = ["--from", "2026-11-03T09:00Z", "--to", "2026-11-03T10:00Z"]  # nothing at all
    assert main([*args, *before, "--out", str(tmp_path / "none.csv")]) == 2
    assert not (tmp_path / "none.csv").exists()


async def test_an_unpriced_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await model_call_ledger(tmp_path / "ledger")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    err = run_bad(
        ["--period", MONTH, "--ledger-dir", str(tmp_path / "ledger")], out_dir / "f.csv", capsys
    )
    assert "no price for 'house-model'" in err and "--prices" in err


def test_a_large_export_is_checked_on_a_sample_and_every_enumerated_value(
    month: tuple[Path, GenStats],
    exported: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    archive, _ = month
    monkeypatch.setattr(focus_export, "CHECK_SAMPLE", 300)
    out = tmp_path / "sampled.csv"
    args = ["export", "focus", "--period", MONTH, "--archive-dir", str(archive), "--quiet"]
    assert main([*args, "--out", str(out)]) == 0
    assert out.read_bytes() == exported["csv"].read_bytes()  # same rows, fewer checked whole
    # A value on few rows (one user), which a 300-row sample would likely miss, is still seen:
    users: dict[str, int] = defaultdict(int)
    for r in rows_of(out):
        users[r["x_UserId"]] += 1
    rare = min(users, key=lambda u: users[u])
    real = focus_export.check_row

    def strict(row: dict[str, str | None], version: object) -> list[str]:
        bad = ["x_UserId: refused"] if row.get("x_UserId") == rare else []
        return bad + real(row, version)  # type: ignore[arg-type]

    monkeypatch.setattr(focus_export, "check_row", strict)
    assert main([*args, "--out", str(tmp_path / "again.csv")]) == 2
    assert not (tmp_path / "again.csv").exists()


# --- bad input: one line, exit 2, nothing left behind ----------------------------------


def run_bad(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    folder = out.parent if out.parent.is_dir() else None
    before = sorted(os.listdir(folder)) if folder else None
    code = main(["export", "focus", *args, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.endswith("\n") and "\n" not in err.rstrip("\n"), f"not one line: {err!r}"
    if folder:
        assert sorted(os.listdir(folder)) == before  # no partial file, no temp file
    return err.strip()


def test_an_unknown_period_is_refused(
    month: tuple[Path, GenStats], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive, _ = month
    out = tmp_path / "f.csv"
    err = run_bad(["--period", "2026-13", "--archive-dir", str(archive)], out, capsys)
    # The one period rule of every command (windows.parse_period).
    assert err == (
        "mcpbg export: --period: expected a month YYYY-MM or a day YYYY-MM-DD (got '2026-13')"
    )
    err = run_bad(["--period", "2026-10", "--archive-dir", str(archive)], out, capsys)
    assert err == (
        "mcpbg export: --period 2026-10: the ledger has no event in this period "
        "(it holds 2026-11-01 to 2026-11-30)"
    )


def test_an_empty_ledger_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "archive"
    empty.mkdir()
    err = run_bad(["--period", MONTH, "--archive-dir", str(empty)], tmp_path / "f.csv", capsys)
    assert "empty ledger" in err and str(empty) in err


def test_a_corrupt_parquet_file_is_refused(
    month: tuple[Path, GenStats], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive, _ = month
    broken = tmp_path / "archive"
    day = broken / "date=2026-11-05"
    day.mkdir(parents=True)
    source = next(archive.glob("date=2026-11-05/*.parquet"))
    (day / source.name).write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    err = run_bad(["--period", MONTH, "--archive-dir", str(broken)], out_dir / "f.csv", capsys)
    assert "corrupt Parquet file" in err and source.name in err


def test_an_unwritable_output_is_refused(
    month: tuple[Path, GenStats], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive, _ = month
    src = ["--period", MONTH, "--archive-dir", str(archive)]
    err = run_bad(src, tmp_path / "missing" / "f.csv", capsys)
    assert err.endswith(f"no such folder {tmp_path / 'missing'}")
    (tmp_path / "taken.csv").mkdir()
    assert run_bad(src, tmp_path / "taken.csv", capsys).endswith("is a folder")
    assert "must end in .csv or .parquet" in run_bad(src, tmp_path / "f.json", capsys)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert "is not writable" in run_bad(src, locked / "f.csv", capsys)


def test_a_failure_while_writing_leaves_no_partial_file(
    month: tuple[Path, GenStats],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The disk fills up as the file is renamed into place: no file, no temp file."""
    archive, _ = month
    out = tmp_path / "f.parquet"
    (tmp_path / "f.parquet").write_text("the previous export")  # stays untouched

    def full(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(focus_export.os, "replace", full)
    err = run_bad(["--period", MONTH, "--archive-dir", str(archive)], out, capsys)
    assert err == f"mcpbg export: --out {out}: No space left on device"
    assert out.read_text() == "the previous export"


def test_a_row_breaking_a_rule_writes_nothing(
    month: tuple[Path, GenStats],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    archive, _ = month
    monkeypatch.setattr(focus_export, "check_row", lambda row, version: ["BilledCost: bad"])
    err = run_bad(["--period", MONTH, "--archive-dir", str(archive)], tmp_path / "f.csv", capsys)
    assert "a row breaks a FOCUS rule, nothing written: BilledCost: bad" in err


# --- the SQL renderings are the pure rules -----------------------------------------


@given(
    st.lists(st.integers(min_value=-(10**24), max_value=10**24), min_size=1, max_size=50),
    st.integers(min_value=0, max_value=12),
)
@settings(max_examples=60, deadline=None)
def test_decimal_sql_is_decimal_text(values: list[int], scale: int) -> None:
    con = duckdb.connect()
    rendered = [
        text
        for (text,) in con.execute(
            f"SELECT {focus_export._dec_sql('CAST(v AS HUGEINT)', scale)} "
            "FROM unnest(CAST(? AS VARCHAR[])) AS t(v)",
            [[str(v) for v in values]],
        ).fetchall()
    ]
    assert rendered == [decimal_text(v, scale) for v in values]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--period", MONTH, "--to", "2026-11-05"], "--to: goes with --from, not --period"),
        (["--from", "2026-11-03"], "--to: required with --from"),
        (["--period", MONTH, "--prices", "nocolon"], "--prices: expected package.module:attribute"),
        (["--period", MONTH, "--prices", "no_such_mod:X"], "--prices: cannot load it"),
        (["--period", MONTH, "--prices", "os:sep"], "--prices: is not a PriceTable"),
    ],
)
def test_bad_options_name_themselves(
    month: tuple[Path, GenStats],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    archive, _ = month
    assert message in run_bad([*args, "--archive-dir", str(archive)], tmp_path / "f.csv", capsys)


def test_progress_and_summary_for_people(
    month: tuple[Path, GenStats], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive, stats = month
    out = tmp_path / "f.parquet"
    code = main(
        ["export", "focus", "--period", MONTH, "--archive-dir", str(archive), "--out", str(out)]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert "splitting and aggregating" in captured.err and "writing" in captured.err
    assert f"{stats.usd_micros // 1_000_000}." in captured.out and "parquet" in captured.out


# -- a period reads only its date folders ----------------------------------------

QUARTER = ("2026-10", "2026-11", "2026-12")


@pytest.fixture(scope="module")
def quarter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three generated months in one archive (a seed each: distinct events)."""
    archive = tmp_path_factory.mktemp("quarter")
    for i, name in enumerate(QUARTER):
        write_archive(archive, 2_500, seed=20 + i, month=name, tenants=3, users=30)
    return archive


def _export(con: duckdb.DuckDBPyConnection, out: Path, start: str, end: str) -> bytes:
    options = focus_export.ExportOptions(datetime.fromisoformat(start), datetime.fromisoformat(end))
    focus_export.export_focus(con, out, options)
    return out.read_bytes()


@pytest.mark.parametrize(
    ("start", "end", "days"),
    [
        ("2026-11-01T00:00Z", "2026-12-01T00:00Z", 30),  # a month
        ("2026-10-30T05:00Z", "2026-11-02T17:00Z", 4),  # hours across a month's end
        ("2026-12-31T00:00Z", "2027-01-01T00:00Z", 1),  # the last day
    ],
)
def test_a_pruned_export_equals_the_export_of_the_whole_archive(
    quarter: Path, tmp_path: Path, start: str, end: str, days: int
) -> None:
    lo, hi = datetime.fromisoformat(start), datetime.fromisoformat(end)
    pruned = open_ledger(quarter, since=lo, until=hi)
    (read,) = pruned.execute('SELECT count(DISTINCT "date") FROM ledger_raw').fetchone() or (0,)
    assert read == days  # the days the range touches, not the quarter's 92
    whole = _export(open_ledger(quarter), tmp_path / "whole.csv", start, end)
    assert _export(pruned, tmp_path / "pruned.csv", start, end) == whole
    assert whole.count(b"\n") > 10


def test_a_period_export_never_opens_files_of_other_months(
    quarter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "archive"
    shutil.copytree(quarter, broken)
    bad = broken / "date=2026-10-05" / "mcpbg.ledger-p9-corrupt.parquet"
    bad.write_bytes(b"PAR1 not a parquet file PAR1")
    outs = {}
    for name, archive in (("clean", quarter), ("broken", broken)):
        outs[name] = tmp_path / f"{name}.csv"
        code = main(
            [
                *("export", "focus", "--period", "2026-11", "--archive-dir", str(archive)),
                *("--out", str(outs[name]), "--quiet"),
            ]
        )
        assert code == 0, capsys.readouterr().err
    assert outs["broken"].read_bytes() == outs["clean"].read_bytes()
    # Read whole, the archive fails on that file; so does a period that holds it.
    with pytest.raises(LedgerError, match="corrupt Parquet file"):
        open_ledger(broken)
    err = run_bad(["--period", "2026-10", "--archive-dir", str(broken)], tmp_path / "f.csv", capsys)
    assert "corrupt Parquet file" in err and bad.name in err
    # A month the archive does not hold names the whole archive's span, from its folders.
    err = run_bad(
        ["--period", "2027-01", "--archive-dir", str(quarter)], tmp_path / "f.csv", capsys
    )
    assert err.endswith("(it holds 2026-10-01 to 2026-12-31)"), err
