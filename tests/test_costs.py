"""``mcpbg costs`` and ``mcpbg sql`` against sums computed independently of DuckDB
(pyarrow over the generated archive's files, or the parsed events of a governed run)."""

from __future__ import annotations

import csv
import io
import json
import shutil
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mcp_budget_governor.cli import costs as cli_costs
from mcp_budget_governor.cli import ledger_args
from mcp_budget_governor.money import format_usd
from mcp_budget_governor.prices import PriceTable
from testing.ledger_gen import GenStats, write_archive
from testing.ledger_run import mixed_run, run_cli


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> GenStats:
    return write_archive(tmp_path_factory.mktemp("gen") / "archive", 6000, seed=3, month="2026-11")


def rows(archive: Path) -> dict[str, list[object]]:
    """Every row of the generated files, read with pyarrow (no DuckDB)."""
    table = pq.ParquetDataset(archive).read()
    return {name: table.column(name).to_pylist() for name in table.column_names}


def test_generator_rows_are_valid_and_priced_by_the_price_table(generated: GenStats) -> None:
    data = rows(generated.directory)
    prices = PriceTable.builtin()
    checked = 0
    for i, model in enumerate(data["model"]):
        if model is None or data["charge_index"][i] != 0:
            continue
        cost = prices.cost_micros(
            model,
            input_tokens=data["input_tokens"][i],
            output_tokens=data["output_tokens"][i],
            cache_read_tokens=data["cache_read_tokens"][i],
            cache_write_tokens=data["cache_write_tokens"][i],
        )
        assert data["amount"][i] == cost
        checked += 1
    assert checked > 1000
    assert sum(generated.by_type.values()) == generated.events == len(set(data["id"]))


def test_costs_totals_equal_independent_sums(
    generated: GenStats, capsys: pytest.CaptureFixture[str]
) -> None:
    data = rows(generated.directory)
    per_user: dict[str, int] = defaultdict(int)
    trips: dict[tuple[str, str], int] = defaultdict(int)
    for i, limit in enumerate(data["limit"]):
        if limit == "spend":  # an event's first USD charge (user_spend repeats it)
            per_user[data["user"][i]] += data["amount"][i]
        if data["type"][i] == "mcpbg.rejected.v1" and data["status"][i] == 503:
            trips[data["tenant"][i], data["user"][i]] += 1
    archive = str(generated.directory)

    code, out, _ = run_cli(capsys, "costs", "--archive-dir", archive, "--json")
    assert code == 0
    report = json.loads(out)
    (total,) = report["summary"]
    assert total["usd_micros"] == generated.usd_micros == sum(per_user.values())
    assert total["usd"] == format_usd(generated.usd_micros)
    assert total["events"] == generated.events
    shown = report["breaker trips"]  # the 10 largest (tenant, user) groups
    assert [r["trips"] for r in shown] == sorted(trips.values(), reverse=True)[:10]
    assert all(r["breaker"] == "spend_breaker" for r in shown)
    top = report["top 10 spenders"]
    assert len(top) == 10
    assert [r["usd_micros"] for r in top] == sorted(per_user.values(), reverse=True)[:10]

    code, out, _ = run_cli(
        capsys, "costs", "--archive-dir", archive, "--by", "tenant", "--json",
        "--limit", "spend",
    )  # fmt: skip
    assert code == 0
    by_tenant = {r["tenant"]: r["usd_micros"] for r in json.loads(out)["spend by tenant"]}
    assert sum(by_tenant.values()) == generated.usd_micros

    # One day, one type of event, rendered as exact dollars in the table.
    day = "2026-11-07"
    want = sum(
        data["amount"][i]
        for i, limit in enumerate(data["limit"])
        if limit == "spend" and data["time"][i].date().isoformat() == day
    )
    code, out, _ = run_cli(
        capsys, "costs", "--archive-dir", archive, "--period", day, "--by", "day"
    )
    assert code == 0 and day in out and format_usd(want) in out


async def test_costs_of_a_governed_run_and_the_per_limit_rule(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(redis_url, tmp_path)
    per_user: dict[str, int] = defaultdict(int)
    user_spend: dict[str, int] = defaultdict(int)
    for event in run.unique():
        usd = [c for c in event.data.charges if c.unit == "usd_micros"]
        user = event.data.context.user or ""
        if usd:
            per_user[user] += usd[0].amount
        user_spend[user] += sum(c.amount for c in usd if c.limit == "user_spend")
    archive = str(run.archive)
    code, out, _ = run_cli(capsys, "costs", "--archive-dir", archive, "--by", "user", "--json")
    assert code == 0
    got = {r["user"]: r["usd_micros"] for r in json.loads(out)["spend by user"]}
    assert {u: v for u, v in got.items() if v} == {u: v for u, v in per_user.items() if v}
    code, out, _ = run_cli(
        capsys, "costs", "--archive-dir", archive, "--by", "user", "--json",
        "--limit", "user_spend",
    )  # fmt: skip
    got = {r["user"]: r["usd_micros"] for r in json.loads(out)["spend by user"]}
    assert {u: v for u, v in got.items() if v} == {u: v for u, v in user_spend.items() if v}


def test_sql_outputs(generated: GenStats, capsys: pytest.CaptureFixture[str]) -> None:
    archive = str(generated.directory)
    query = "SELECT type, count(*) AS n FROM costs GROUP BY type ORDER BY type"
    code, out, _ = run_cli(capsys, "sql", query, "--archive-dir", archive, "--json")
    assert code == 0
    assert {r["type"]: r["n"] for r in json.loads(out)} == generated.by_type
    code, out, _ = run_cli(capsys, "sql", query, "--archive-dir", archive, "--csv")
    parsed = list(csv.reader(io.StringIO(out)))
    assert parsed[0] == ["type", "n"]
    assert {t: int(n) for t, n in parsed[1:]} == generated.by_type
    code, out, _ = run_cli(
        capsys, "sql", "SELECT sum(usd_micros) AS usd FROM costs", "--archive-dir", archive
    )
    assert code == 0 and f"{generated.usd_micros}" in out.replace(",", "")
    data = rows(generated.directory)
    metered = sum(
        a
        for t, lim, a in zip(data["type"], data["limit"], data["amount"], strict=True)
        if t == "mcpbg.metered.v1" and lim == "spend"
    )
    code, out, _ = run_cli(
        capsys,
        "sql",
        "SELECT sum(usd_micros) AS usd FROM costs WHERE type = 'mcpbg.metered.v1'",
        "--archive-dir",
        archive,
        "--json",
    )
    assert json.loads(out) == [{"usd": metered}] and metered == generated.metered_usd_micros


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["costs", "--period", "2026-13"], "--period: expected a month YYYY-MM"),
        (["costs", "--by", "colour"], "by: one of user"),
        (["costs", "--top", "0"], "--top: at least 1"),
        (["costs", "--from", "2026-11-30", "--to", "2026-11-01"], "to: must be after --from"),
        (["sql", "SELEKT 1"], "query: "),
        (["sql", "SELECT * FROM nowhere"], "nowhere"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    generated: GenStats, capsys: pytest.CaptureFixture[str], argv: list[str], problem: str
) -> None:
    code, _, err = run_cli(capsys, *argv, "--archive-dir", str(generated.directory))
    assert code == 2 and err.count("\n") == 1 and problem in err, err


def test_empty_and_corrupt_ledgers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, "costs", "--archive-dir", str(tmp_path / "empty"))
    assert code == 2 and "empty ledger" in err and err.count("\n") == 1
    folder = tmp_path / "bad" / "date=2026-11-01"
    folder.mkdir(parents=True)
    (folder / "seg.parquet").write_bytes(b"PAR1garbagePAR1")
    code, _, err = run_cli(capsys, "sql", "SELECT 1", "--archive-dir", str(tmp_path / "bad"))
    assert code == 2 and "corrupt Parquet file" in err and "seg.parquet" in err


# -- a period reads only its date folders ----------------------------------------


@pytest.fixture(scope="module")
def quarter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three generated months in one archive (a seed each: distinct events)."""
    archive = tmp_path_factory.mktemp("quarter") / "archive"
    for i, month in enumerate(("2026-10", "2026-11", "2026-12")):
        write_archive(archive, 2_500, seed=30 + i, month=month)
    return archive


@pytest.mark.parametrize(
    "when",
    [
        ["--period", "2026-11"],
        ["--from", "2026-10-30", "--to", "2026-11-02"],
        ["--period", "2026-12-31", "--limit", "spend"],
        ["--from", "2026-12-30", "--by", "tenant,day"],
    ],
)
def test_costs_of_a_period_equal_those_read_from_the_whole_archive(
    quarter: Path,
    when: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["costs", "--archive-dir", str(quarter), "--json", *when]
    code, pruned, err = run_cli(capsys, *argv)
    assert code == 0, err
    whole_reads: list[object] = []

    def unpruned(args: object, since: object = None, until: object = None) -> object:
        whole_reads.append((since, until))
        return ledger_args.open_ledger_from(args)  # type: ignore[arg-type]

    monkeypatch.setattr(cli_costs, "open_ledger_from", unpruned)
    code, whole, err = run_cli(capsys, *argv)
    assert code == 0 and whole_reads and whole_reads[0] != (None, None), err
    assert pruned == whole
    report = json.loads(pruned)
    assert report[next(iter(report))][0]["events"] > 0


def test_costs_of_a_period_never_open_files_of_other_months(
    quarter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "archive"
    shutil.copytree(quarter, broken)
    bad = broken / "date=2026-10-05" / "seg.parquet"
    bad.write_bytes(b"PAR1garbagePAR1")
    outs = []
    for archive in (quarter, broken):
        code, out, err = run_cli(
            capsys, "costs", "--archive-dir", str(archive), "--period", "2026-11", "--json"
        )
        assert code == 0, err
        outs.append(out)
    assert outs[0] == outs[1]
    code, _, err = run_cli(capsys, "costs", "--archive-dir", str(broken), "--json")
    assert code == 2 and "corrupt Parquet file" in err and "seg.parquet" in err
