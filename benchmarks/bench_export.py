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

    .venv/bin/python benchmarks/bench_export.py                  # 1,000,000 events, 3 rounds
    .venv/bin/python benchmarks/bench_export.py --events 100000 --rounds 1
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
from _common import loadavg, progress, table
from ledger_gen import write_archive

from mcp_budget_governor.focus import Granularity, parse_period
from mcp_budget_governor.projections.focus_export import ExportOptions, export_focus
from mcp_budget_governor.projections.ledger_view import open_ledger

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()

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
