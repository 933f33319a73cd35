"""``mcpbg export focus``: the ledger's costs as a FinOps FOCUS 1.2 CostAndUsage file."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ..errors import InvalidInputError
from ..money import format_dollars
from ..windows import parse_period
from .ledger_args import add_ledger_options, setting
from .render import install_hint


def register(sub: Any) -> None:
    export = sub.add_parser("export", help="export the ledger's costs (FinOps FOCUS)")
    kinds = export.add_subparsers(dest="export_kind", required=True)
    focus = kinds.add_parser(
        "focus",
        help="FOCUS 1.2 CostAndUsage rows, per hour (or day), tenant, user, tool, model and meter",
        description="Write the ledger's USD costs of a period as FinOps FOCUS 1.2 "
        "CostAndUsage rows (CSV or Parquet, by the --out suffix). The file appears whole "
        "or not at all. Exit 0 written, 2 bad input (the message names it).",
    )
    when = focus.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--period", help="a UTC calendar month YYYY-MM (e.g. 2026-11) or day YYYY-MM-DD"
    )
    when.add_argument("--from", dest="start", help="start (UTC day or time, inclusive)")
    focus.add_argument(
        "--to",
        dest="end",
        help="end with --from: through this UTC day (inclusive), or up to this time",
    )
    focus.add_argument("--out", required=True, help="the file to write: NAME.csv or NAME.parquet")
    focus.add_argument(
        "--granularity", choices=("hour", "day"), default="hour", help="row period (default hour)"
    )
    add_ledger_options(focus)
    focus.add_argument(
        "--prices",
        help="package.module:attribute of the PriceTable that priced the calls "
        "(default: the built-in table)",
    )
    focus.add_argument(
        "--billing-account", default="mcpbg", help="BillingAccountId (default mcpbg)"
    )
    focus.add_argument(
        "--provider",
        default="mcp-budget-governor",
        help="ProviderName, PublisherName and InvoiceIssuerName (default mcp-budget-governor)",
    )
    focus.add_argument("--quiet", action="store_true", help="no progress lines and no summary")
    focus.set_defaults(run=run)


def _load_prices(spec: str) -> Any:
    import importlib

    from ..prices import PriceTable

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidInputError("--prices", spec, "expected package.module:attribute")
    # A module in the working folder is found, as `python -m` would find it.
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        value = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise InvalidInputError("--prices", spec, f"cannot load it: {exc}") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if not isinstance(value, PriceTable):
        raise InvalidInputError("--prices", spec, "is not a PriceTable")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        from ..focus import Granularity, parse_range
        from ..projections.focus_export import ExportOptions, export_focus
        from ..projections.ledger_view import open_ledger
    except ImportError as exc:
        print(
            f"mcpbg export: {exc}; install the duckdb extra: " + install_hint("duckdb"),
            file=sys.stderr,
        )
        return 2
    granularity = Granularity(args.granularity)
    if args.period is not None:
        if args.end is not None:
            raise InvalidInputError("--to", args.end, "goes with --from, not --period")
        start, end = parse_period(args.period)
        label = f"--period {args.period}"
    else:
        if args.end is None:
            raise InvalidInputError("--to", None, "required with --from")
        start, end = parse_range(args.start, args.end, granularity)
        label = f"--from {args.start} --to {args.end}"
    prices = _load_prices(args.prices) if args.prices else None
    archive = setting(args, "archive_dir")
    ledger = setting(args, "ledger_dir")
    began = time.monotonic()

    def progress(stage: str) -> None:
        if not args.quiet:
            print(f"mcpbg export focus: {time.monotonic() - began:5.1f}s {stage}", file=sys.stderr)

    progress("opening the ledger")
    # Only the period's date folders are read (a year-long archive is not scanned).
    con = open_ledger(archive, ledger, since=start, until=end)
    try:
        result = export_focus(
            con,
            args.out,
            ExportOptions(
                start,
                end,
                granularity,
                billing_account_id=args.billing_account,
                provider=args.provider,
                label=label,
            ),
            prices=prices,
            progress=progress,
        )
    finally:
        con.close()
    if not args.quiet:
        from .render import print_table

        print_table(
            f"FOCUS 1.2 export of {start:%Y-%m-%dT%H:%MZ} .. {end:%Y-%m-%dT%H:%MZ}",
            ["file", "format", "rows", "costed events", "BilledCost", "seconds"],
            [
                [
                    str(result.path),
                    result.format,
                    f"{result.rows:,}",
                    f"{result.events:,}",
                    format_dollars(result.billed_micros),
                    f"{result.seconds:.2f}",
                ]
            ],
            numeric=["rows", "costed events", "BilledCost", "seconds"],
        )
    return 0
