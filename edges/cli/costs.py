"""``mcpbg costs``: spend by user, tenant, tool, model and day; top spenders; breaker trips.

Read from the ledger (``--archive-dir`` / ``--ledger-dir``), with the one
money rule of ``projections/ledger_view.py`` (each event's USD once).
Amounts are exact dollars rendered from integer micros.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any

from ..numbers import whole_argument
from .ledger_args import add_ledger_options, add_option, open_ledger_from, setting

_JSON_ONLY = ("cache_read_tokens", "cache_write_tokens")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "costs",
        help="spend by user, tenant, tool, model and day; top spenders; breaker trips",
        description="Without --by: a summary, spend by tenant, the top users, spend by tool, "
        "model and day, and breaker trips. USD counts each event once (its first USD "
        "charge); --limit reads one limit's charges instead.",
    )
    add_ledger_options(p)
    p.add_argument("--period", help="a month YYYY-MM or a day YYYY-MM-DD (UTC)")
    p.add_argument("--from", dest="start", help="from this day YYYY-MM-DD or time (UTC, inclusive)")
    p.add_argument(
        "--to", dest="end", help="through this day YYYY-MM-DD (inclusive), or to a time (UTC)"
    )
    for name in ("user", "tenant", "tool", "model"):
        p.add_argument(f"--{name}", help=f"only this {name}")
    p.add_argument("--limit", help="USD of this limit's charges (instead of once per event)")
    p.add_argument(
        "--session",
        help="one session and its forks: the spend split into tools and models, by tool and "
        "model, and (with --policy) the session budget line",
    )
    add_option(p, "policy", "with --session: the session budget line; with --html: the caps drawn")
    p.add_argument(
        "--by",
        help="group by these, comma-separated: user, tenant, tool, model, agent, day, hour, "
        "week (ISO, 2026-W48), month, type",
    )
    p.add_argument("--top", type=whole_argument(), help="keep the first N rows of each table")
    p.add_argument("--json", action="store_true", help="print JSON (usd as exact decimals)")
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write a self-contained HTML report of the period (spend over time per "
        "tenant, refusals by reason, breaker trips)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import InvalidInputError
    from ..projections.costs import Filter, costs_json, costs_reports
    from ..windows import parse_period, parse_range

    start: datetime | None
    end: datetime | None
    if args.period is not None:
        if args.start is not None or args.end is not None:
            raise InvalidInputError("--period", args.period, "give --period or --from/--to")
        start, end = parse_period(args.period)
    else:
        start, end = parse_range(args.start, args.end)
    if args.top is not None and args.top < 1:
        raise InvalidInputError("--top", args.top, "at least 1")
    policy = None
    policy_spec = setting(args, "policy") if args.session is not None or args.html else None
    if policy_spec is not None:
        from ..policy_file import load_policy

        policy = load_policy(policy_spec)  # a bad policy file is the error to see first
    flt = Filter(
        start, end, args.user, args.tenant, args.tool, args.model, args.limit, args.session
    )
    # A period or --from/--to reads only those days' archive folders.
    con = open_ledger_from(args, since=start, until=end)
    try:
        if start is not None or end is not None:  # the rule of mcpbg export focus: exit 2
            from ..projections.ledger_view import require_events

            lo = start or datetime(1970, 1, 1, tzinfo=UTC)
            hi = end or datetime(9999, 12, 31, tzinfo=UTC)
            given = [
                f"--{o} {v}"
                for o, v in (("period", args.period), ("from", args.start), ("to", args.end))
                if v is not None
            ]
            require_events(con, lo, hi, " ".join(given))
        by = [b.strip() for b in args.by.split(",") if b.strip()] if args.by else None
        reports = costs_reports(con, flt, by=by, top=args.top, policy=policy)
    finally:
        con.close()
    if getattr(args, "html", None):
        from ..console.report import write_costs_report

        con = open_ledger_from(args, since=start, until=end)
        try:
            path = write_costs_report(con, flt, args.html, policy=policy)
        finally:
            con.close()
        print(f"report written: {path}", file=sys.stderr)
    if args.json:
        json.dump(costs_json(reports), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        for r in reports:
            _print(r)
    return 0


def _print(report: Any) -> None:
    from ..money import format_dollars
    from .render import print_table

    # Cache-token sums stay in --json: the table must fit a terminal.
    keep = [i for i, h in enumerate(report.headers) if h not in _JSON_ONLY]
    money = set(report.money)
    headers = [
        report.headers[i].removesuffix("_usd_micros").removesuffix("_micros")
        if report.headers[i] in money
        else report.headers[i]
        for i in keep
    ]
    numeric = [
        h
        for h in headers
        if h
        not in (
            "user",
            "tenant",
            "tool",
            "model",
            "agent",
            "day",
            "hour",
            "week",
            "month",
            "type",
            "breaker",
            "kind",
            "limit",
            "first",
            "last",
        )
    ]
    rows = []
    for row in report.rows:
        cells = []
        for h, v in ((report.headers[i], row[i]) for i in keep):
            if h in money:
                cells.append(format_dollars(int(v)))
            elif isinstance(v, int):
                cells.append(f"{v:,}")
            else:
                cells.append("-" if v is None else v)
        rows.append(cells)
    print_table(report.title, headers, rows, numeric=numeric)
