"""``mcpbg sql "<query>"``: any SQL over the ledger view.

Views: ``ledger`` (one row per charge, deduplicated), ``ledger_raw`` (before
deduplication) and ``costs`` (one row per event, with the one USD rule);
``projections/ledger_view.py`` documents their columns. Output: a table, or
``--csv`` (string cells that would start a spreadsheet formula get a
leading ``'``, ``csv_safety``) / ``--json``. Integers stay integers (money is USD micros; render
it with ``format_usd`` or divide in SQL as a DECIMAL, never a float).
The query is free SQL with no period option, so the whole ledger is opened
(unlike ``mcpbg costs --period`` and ``mcpbg export focus``, which read only
their days' archive folders).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Any

from ..numbers import whole_argument
from .ledger_args import add_ledger_options, open_ledger_from


def register(sub: Any) -> None:
    p = sub.add_parser(
        "sql",
        help="run SQL over the ledger views (ledger, ledger_raw, costs)",
        description='Example: mcpbg sql "SELECT tenant, sum(usd_micros) FROM costs GROUP BY 1"',
    )
    p.add_argument("query", help="the SQL to run")
    add_ledger_options(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="print CSV")
    out.add_argument("--json", action="store_true", help="print JSON (one object per row)")
    p.add_argument(
        "--max-rows",
        type=whole_argument(),
        default=1000,
        help="rows shown in a table (default 1000)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import duckdb

    from ..errors import InvalidInputError
    from .render import console, print_table

    if not args.query.strip():
        raise InvalidInputError("query", args.query, "an SQL statement")
    con = open_ledger_from(args)
    try:
        try:
            cursor = con.execute(args.query)
            headers = [d[0] for d in cursor.description or ()]
            rows = cursor.fetchall() if headers else []
        except duckdb.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidInputError("query", _short(args.query), first) from None
    finally:
        con.close()
    if args.csv:
        from ..csv_safety import cell

        # Spreadsheets open this: a string cell never starts a formula; numbers stay numbers.
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow([cell(h) for h in headers])
        writer.writerows(["" if v is None else cell(v) for v in row] for row in rows)
    elif args.json:
        json.dump(
            [dict(zip(headers, row, strict=True)) for row in rows],
            sys.stdout,
            indent=2,
            default=str,
        )
        sys.stdout.write("\n")
    else:
        shown = rows[: max(args.max_rows, 0)]
        print_table(
            None,
            headers,
            shown,
            numeric=[h for h, v in zip(headers, rows[0], strict=True) if isinstance(v, int | float)]
            if rows
            else [],
        )
        if len(rows) > len(shown):
            console().print(f"... {len(rows) - len(shown):,} more rows (--max-rows N, --csv)")
    return 0


def _short(query: str) -> str:
    text = " ".join(query.split())
    return text if len(text) <= 60 else text[:57] + "..."
