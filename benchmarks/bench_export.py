"""FOCUS export of 1,000,000 archived ledger events (``mcpbg export focus``), against a plain COPY.

Side by side, in one run, on one archive (``ledger_gen.write_archive``: a
month of 1,000,000 events, 45 % of them with a USD cost), each scenario on a
fresh DuckDB connection from ``open_ledger`` and timed from that call to the
file being in place:

- **baseline: COPY of the costs view** — ``COPY (SELECT * FROM costs WHERE
  <month>) TO 'x.parquet'``: DuckDB reading, deduplicating and grouping the
  archive per event and writing it out, with no FOCUS work at all. The
  export reads the same view, so the ratio is what the FOCUS work costs.
- **baseline: COPY of the 11 columns the export reads** — the same, with
  only the columns the export uses (DuckDB then skips the others): the
  floor for anything reading this view.
- **export, Parquet, hourly** — ``export_focus`` as ``mcpbg export focus
  --period <month> --out x.parquet`` runs it: the cost split, the per-hour
  aggregation, the rule checks, the atomic write.
- **export, CSV, hourly** — the same to CSV (FOCUS text: ~0.5 GB for a
  million rows).
- **export, Parquet, daily** — ``--granularity day``.

Rounds are interleaved (each round runs every scenario once) so that load
from other processes spreads over all of them; the median is reported. Every
export is checked: its BilledCost total must equal the generator's own USD
total (computed without DuckDB), else the run fails (exit status 1).

    .venv/bin/python -m benchmarks.bench_export                  # 1,000,000 events, 3 rounds
    .venv/bin/python -m benchmarks.bench_export --events 100000 --rounds 1

``--year``: a year-long archive instead (12 months of ``--events`` each,
default 100,000), and one month (November) exported to Parquet and summed as
``mcpbg costs --period`` does, each twice, side by side: reading the whole
archive (``open_ledger(dir)``: every day scanned and deduplicated, the month
kept by the ``WHERE``) and reading the month's date folders only
(``open_ledger(dir, since=, until=)``, what the commands do). Both must give
the same rows and the generator's USD total for the month, else exit 1.

    .venv/bin/python -m benchmarks.bench_export --year           # 12 x 100,000 events, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

from mcp_budget_governor.focus import Granularity
from mcp_budget_governor.projections.focus_export import ExportOptions, export_focus
from mcp_budget_governor.projections.ledger_view import open_ledger
from mcp_budget_governor.windows import parse_period
from testing.bench import loadavg, progress, table
from testing.ledger_gen import write_archive

MONTH = "2026-11"


#: The columns of the costs view the export reads.
NARROW = (
    '"time", tenant, "user", tool, model, "type", usd_micros, input_tokens, output_tokens, '
    "cache_read_tokens, cache_write_tokens"
)


def baseline(archive: Path, out: Path, columns: str = "*") -> dict[str, Any]:
    start, end = parse_period(MONTH)
    began = time.perf_counter()
    con = open_ledger(archive)
    con.execute(
        f'COPY (SELECT {columns} FROM costs WHERE "time" >= ? AND "time" < ?) '
        f"TO '{out}' (FORMAT parquet, COMPRESSION zstd)",
        [start, end],
    )
    seconds = time.perf_counter() - began
    (rows,) = con.execute(f"SELECT count(*) FROM read_parquet('{out}')").fetchone() or (0,)
    con.close()
    return {"seconds": seconds, "rows": rows, "bytes": out.stat().st_size, "billed": None}


def export(archive: Path, out: Path, granularity: Granularity) -> dict[str, Any]:
    began = time.perf_counter()
    con = open_ledger(archive)
    result = export_focus(con, out, ExportOptions(*parse_period(MONTH), granularity=granularity))
    seconds = time.perf_counter() - began
    con.close()
    return {
        "seconds": seconds,
        "rows": result.rows,
        "bytes": out.stat().st_size,
        "billed": result.billed_micros,
        "stages": result.stages,
    }


YEAR = tuple(f"2026-{m:02d}" for m in range(1, 13))


def year_export(archive: Path, out: Path, pruned: bool) -> dict[str, Any]:
    """Export ``MONTH`` of a year-long archive, reading its folders only or everything."""
    start, end = parse_period(MONTH)
    began = time.perf_counter()
    con = open_ledger(archive, since=start, until=end) if pruned else open_ledger(archive)
    result = export_focus(con, out, ExportOptions(start, end), check=True)
    seconds = time.perf_counter() - began
    con.close()
    return {"seconds": seconds, "rows": result.rows, "billed": result.billed_micros}


def year_costs(archive: Path, pruned: bool) -> dict[str, Any]:
    """``mcpbg costs --period MONTH``'s summary and spend by tenant, as the command reads them."""
    from mcp_budget_governor.projections.costs import Filter, spend, summary

    start, end = parse_period(MONTH)
    began = time.perf_counter()
    con = open_ledger(archive, since=start, until=end) if pruned else open_ledger(archive)
    flt = Filter(start, end)
    total = summary(con, flt)
    by_tenant = spend(con, ["tenant"], flt)
    seconds = time.perf_counter() - began
    con.close()
    return {
        "seconds": seconds,
        "rows": len(by_tenant.rows),
        "billed": int(total.rows[0][-1]),
        "answer": [total.rows, by_tenant.rows],
    }


def year_main(args: argparse.Namespace) -> int:
    """A year of archive, one month read: whole archive vs the month's date folders."""
    per_month = args.events
    with tempfile.TemporaryDirectory(prefix="mcpbg-bench-export-year-") as tmp:
        folder = Path(tmp)
        archive = folder / "archive"
        month_usd = 0
        files = rows = 0
        for i, month in enumerate(YEAR):
            stats = write_archive(archive, per_month, seed=args.seed * 100 + i, month=month)
            files += stats.files
            rows += stats.rows
            if month == MONTH:
                month_usd = stats.usd_micros
        progress(f"{len(YEAR)} months x {per_month:,} events: {rows:,} rows in {files:,} files")
        scenarios: dict[str, Callable[[], dict[str, Any]]] = {
            "export focus 2026-11, whole archive read": lambda: year_export(
                archive, folder / "w.parquet", pruned=False
            ),
            "export focus 2026-11, its date folders": lambda: year_export(
                archive, folder / "p.parquet", pruned=True
            ),
            "costs --period 2026-11, whole archive read": lambda: year_costs(archive, False),
            "costs --period 2026-11, its date folders": lambda: year_costs(archive, True),
        }
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
        failed = False
        for round_no in range(1, args.rounds + 1):
            for name, run in scenarios.items():
                result = run()
                runs[name].append(result)
                ok = result["billed"] == month_usd
                failed |= not ok
                progress(
                    f"round {round_no}: {name}: {result['seconds']:.2f} s, {result['rows']:,} rows"
                    + ("" if ok else f"  BILLED {result['billed']} != {month_usd}")
                    + f"  (load {loadavg()})"
                )
        names = list(scenarios)
        for whole, pruned in ((names[0], names[1]), (names[2], names[3])):
            a, b = runs[whole][-1], runs[pruned][-1]
            if (a["rows"], a.get("answer")) != (b["rows"], b.get("answer")):
                failed = True
                print(f"FAILED: {pruned} differs from {whole}", file=sys.stderr)
        if (folder / "w.parquet").read_bytes() != (folder / "p.parquet").read_bytes():
            failed = True
            print("FAILED: the pruned export's file differs from the whole read's", file=sys.stderr)

    lines = []
    summary: dict[str, Any] = {}
    for i, (name, results) in enumerate(runs.items()):
        seconds = statistics.median(r["seconds"] for r in results)
        base = statistics.median(r["seconds"] for r in runs[names[i - i % 2]])
        summary[name] = {"median_seconds": seconds, "seconds": [r["seconds"] for r in results]}
        lines.append([name, f"{seconds:.2f}", f"{base / seconds:.1f}x", f"{results[-1]['rows']:,}"])
    print(
        f"One month of a 12-month archive ({len(YEAR)} x {per_month:,} events, {rows:,} rows, "
        f"{files:,} files), median of {args.rounds} round(s)"
    )
    print(
        table(
            ["scenario", "seconds", "speed-up", "rows"],
            lines,
            [False, True, True, True],
        )
    )
    print(f"python {platform.python_version()}, duckdb {duckdb.__version__}, load {loadavg()}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"events_per_month": per_month, "rounds": args.rounds, "scenarios": summary},
                indent=2,
            )
        )
    if failed:
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--events", type=int, help="events (default 1,000,000; with --year: per month, 100,000)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument(
        "--year",
        action="store_true",
        help="12 months of --events each (default 100,000): one month read whole vs pruned",
    )
    args = parser.parse_args()
    if args.events is None:
        args.events = 100_000 if args.year else 1_000_000
    if args.year:
        return year_main(args)

    with tempfile.TemporaryDirectory(prefix="mcpbg-bench-export-") as tmp:
        folder = Path(tmp)
        progress(f"writing {args.events:,} events of {MONTH} to {folder / 'archive'} ...")
        stats = write_archive(folder / "archive", args.events, seed=args.seed, month=MONTH)
        progress(f"  {stats.rows:,} rows in {stats.files} files, {stats.seconds:.1f} s")
        archive = folder / "archive"
        scenarios: dict[str, Callable[[], dict[str, Any]]] = {
            "baseline: COPY costs view -> Parquet": lambda: baseline(archive, folder / "b.parquet"),
            "baseline: COPY its 11 columns read": lambda: baseline(
                archive, folder / "n.parquet", NARROW
            ),
            "export focus, Parquet, hourly": lambda: export(
                archive, folder / "h.parquet", Granularity.HOUR
            ),
            "export focus, CSV, hourly": lambda: export(
                archive, folder / "h.csv", Granularity.HOUR
            ),
            "export focus, Parquet, daily": lambda: export(
                archive, folder / "d.parquet", Granularity.DAY
            ),
        }
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
        failed = False
        for round_no in range(1, args.rounds + 1):
            for name, run in scenarios.items():
                result = run()
                runs[name].append(result)
                ok = result["billed"] is None or result["billed"] == stats.usd_micros
                failed |= not ok
                progress(
                    f"round {round_no}: {name}: {result['seconds']:.2f} s, {result['rows']:,} rows"
                    + ("" if ok else f"  BILLED {result['billed']} != {stats.usd_micros}")
                    + f"  (load {loadavg()})"
                )

    base = statistics.median(r["seconds"] for r in runs[next(iter(scenarios))])
    lines = []
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        last = results[-1]
        summary[name] = {
            "median_seconds": seconds,
            "seconds": [r["seconds"] for r in results],
            "rows": last["rows"],
            "bytes": last["bytes"],
            "stages": last.get("stages"),
        }
        lines.append(
            [
                name,
                f"{seconds:.2f}",
                f"{seconds / base:.2f}x",
                f"{args.events / seconds:,.0f}",
                f"{last['rows']:,}",
                f"{last['bytes'] / 1e6:,.1f}",
            ]
        )
    print(
        f"FOCUS export, {args.events:,} ledger events ({stats.usd_micros / 1e6:,.2f} USD), "
        f"median of {args.rounds} round(s)"
    )
    print(
        table(
            ["scenario", "seconds", "vs baseline", "events/s", "rows", "MB"],
            lines,
            [False, True, True, True, True, True],
        )
    )
    print(f"python {platform.python_version()}, duckdb {duckdb.__version__}, load {loadavg()}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "events": args.events,
                    "rounds": args.rounds,
                    "usd_micros": stats.usd_micros,
                    "scenarios": summary,
                    "loadavg": loadavg(),
                },
                indent=2,
            )
        )
    if failed:
        print("FAILED: an export's BilledCost total differs from the ledger's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
