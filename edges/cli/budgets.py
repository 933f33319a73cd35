"""``mcpbg budgets``: what each limit has counted in its current period, and what is left.

Exit code 1 when any row is exceeded (spent at or past its limit, so the next
call it gates is refused), like the other commands that find a problem; 0
otherwise; 2 for bad input (a malformed policy file names its line) or an
unreachable Redis or Postgres (``--postgres URL``: the counters in Postgres).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from ..numbers import whole_argument
from .counters_args import add_counters_options
from .ledger_args import (
    add_ledger_options,
    add_option,
    open_ledger_from,
    policy_spec,
    setting,
)

if TYPE_CHECKING:
    from ..counters import Backend
    from ..policy import Policy
    from ..projections.budgets import BudgetReport

_SCOPES = ("user", "tenant", "tool", "session", "agent")


def register(sub: Any) -> None:
    from ..console.auth import variables

    p = sub.add_parser(
        "budgets",
        help="one row per limit and counter: spent, limit, remaining, exceeded",
        description="Without --user/--tenant/--tool/--session/--agent, every counter in "
        "Redis (a bounded SCAN of mcpbg:v1:*, of every master on a redis+cluster:// URL) in "
        "its current period; with --postgres, the "
        "counters in Postgres instead. With --archive-dir or --ledger-dir, also the open "
        "reservations on those counters and each session root's forks, read from the "
        "ledger. Exit code 1 when any row is exceeded.",
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=["list"],
        help="list: the same table (`mcpbg budgets list`, as the gateways spell it)",
    )
    add_option(
        p, "policy", "the policy: a .toml file or package.module:attribute (default ./policy.toml)"
    )
    add_counters_options(p)
    add_ledger_options(p)  # open reservations and session forks are only in the ledger
    for scope in _SCOPES:
        p.add_argument(f"--{scope}", help=f"only the counters of this {scope}")
    p.add_argument(
        "--max-keys",
        type=whole_argument(),
        default=None,
        help="list at most this many counter keys (default 10000); the output says when it stopped",
    )
    p.add_argument("--json", action="store_true", help="print JSON (amounts as integers)")
    p.add_argument(
        "--api",
        metavar="URL",
        help="read the rows from a running `mcpbg serve` at URL instead of Redis (token: "
        f"{variables()})",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..policy_file import load_policy
    from ..projections.budgets import DEFAULT_MAX_KEYS
    from .counters_args import counters_store, open_counters
    from .render import fail

    if args.api:
        return _run_api(args)
    # The policy first: a bad policy file is the error to see.
    policy = load_policy(policy_spec(args))
    store, url = counters_store(args)
    max_keys = DEFAULT_MAX_KEYS if args.max_keys is None else args.max_keys
    if max_keys < 1:
        return fail("budgets", f"--max-keys: expected a positive number (got {max_keys})")
    filters = {s: getattr(args, s) for s in _SCOPES if getattr(args, s) is not None}
    backend = open_counters(args)
    if store == "postgres_url":
        report = asyncio.run(_report(policy, backend, filters, max_keys))
    else:
        from redis.exceptions import ResponseError

        from ..errors import InvalidInputError
        from ..urls import redact

        try:
            report = asyncio.run(_report(policy, backend, filters, max_keys))
        except ResponseError as exc:  # e.g. a database index the server does not have
            raise InvalidInputError("--redis-url", redact(url), f"refused: {exc}") from None
    if setting(args, "archive_dir") is not None or setting(args, "ledger_dir") is not None:
        report = _with_ledger(args, report)
    if args.json:
        json.dump(report.as_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_report(report, title=_title(filters))
    return 1 if report.exceeded else 0


def _with_ledger(args: argparse.Namespace, report: BudgetReport) -> BudgetReport:
    """The report with the ledger's open reservations and session forks."""
    from ..projections.budgets import LedgerHolds, session_root, with_ledger
    from ..projections.ledger_view import LedgerError

    try:
        con = open_ledger_from(args)
    except LedgerError as exc:
        if not str(exc).startswith("empty ledger"):
            raise
        # A ledger with no events yet: nothing reserved, no forks seen (known, not guessed).
        holds = LedgerHolds((), {r: () for r in map(session_root, report.rows) if r is not None})
        return dataclasses.replace(report, holds=holds)
    try:
        return with_ledger(report, con)
    finally:
        con.close()


def _forecast_cell(row: dict[str, Any]) -> str:
    """The forecast column of an API row (``projections.budgets.BudgetRow.forecast``)."""
    at = row.get("projected_exhaust_at")
    if not at or not row.get("projected_before_end"):
        return "-"
    return f"{at[:10]} {at[11:16]} UTC"


def _run_api(args: argparse.Namespace) -> int:
    """The same rows from ``GET /v1/budgets`` (the server runs :func:`budget_report`)."""
    from ..money import Unit
    from ..projections.budgets import HEADERS, NOT_KNOWN, NUMERIC, format_amount
    from .api_client import get_json
    from .render import console, print_table

    params: dict[str, Any] = {s: getattr(args, s) for s in _SCOPES}
    params["max_keys"] = args.max_keys
    doc = get_json(args.api, "/v1/budgets", params)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        rows = []
        for r in doc["rows"]:
            unit = Unit(r["unit"])
            values = r["scope_values"]
            who = (
                " ".join(f"{k}={v}" for k, v in values.items())
                if len(values) > 1
                else (next(iter(values.values()), "*") or "(hashed)")
            )
            grant = f" + grant {format_amount(unit, r['grant'])}" if r["grant"] else ""
            rows.append(
                (
                    r["name"],
                    r["scope"],
                    who,
                    r["window"],
                    r["period"],
                    format_amount(unit, r["spent"]),
                    format_amount(unit, r["limit"]),
                    r["limit_source"] + grant,
                    format_amount(unit, r["remaining"]),
                    "yes" if r["exceeded"] else "no",
                    _forecast_cell(r),
                )
            )
        print_table(
            _title({s: getattr(args, s) for s in _SCOPES if getattr(args, s)}),
            HEADERS,
            rows,
            numeric=NUMERIC,
        )
        console().print(NOT_KNOWN, markup=False, highlight=False)  # the server reads no ledger
    return 1 if any(r["exceeded"] for r in doc["rows"]) else 0


async def _report(
    policy: Policy, backend: Backend, filters: dict[str, str], max_keys: int
) -> BudgetReport:
    from rich.console import Console
    from rich.status import Status

    from ..projections.budgets import budget_report

    # Listing a large keyspace takes a while: say what it is doing (on stderr,
    # and only for a person watching, so --json output and pipes stay clean).
    err = Console(stderr=True)
    status = err.status("reading counters") if err.is_terminal else contextlib.nullcontext()

    def progress(limit: str, listed: int) -> None:
        if isinstance(status, Status):
            status.update(f"listing the counters of {limit} ({listed:,} keys so far)")

    try:
        with status:
            return await budget_report(
                policy,
                backend,
                max_keys=max_keys,
                user=filters.get("user"),
                tenant=filters.get("tenant"),
                tool=filters.get("tool"),
                session=filters.get("session"),
                agent=filters.get("agent"),
                progress=progress,
            )
    finally:
        await backend.aclose()


def print_report(report: BudgetReport, *, title: str | None = "budgets") -> None:
    """Print a budgets report as a table, and say when the listing was cut (the demo uses it)."""
    from ..projections.budgets import (
        HEADERS,
        NOT_KNOWN,
        NUMERIC,
        RESERVATION_HEADERS,
        SESSION_HEADERS,
        reservation_rows,
        session_rows,
        table_rows,
    )
    from .render import console, print_table

    # Ids are caller data: print_table shows "[bold]" in one as written, not as markup.
    print_table(title, HEADERS, table_rows(report), numeric=NUMERIC)
    out = console()
    if not report.rows:
        out.print("no counters in the current period")
    sessions = session_rows(report)
    if sessions:
        print_table("session roots", SESSION_HEADERS, sessions)
    if report.holds is None:
        out.print(NOT_KNOWN, markup=False, highlight=False)
    elif report.holds.reservations:
        print_table(
            "open reservations", RESERVATION_HEADERS, reservation_rows(report), numeric=("amount",)
        )
    else:
        out.print("no open reservations in the ledger")
    if report.truncated:
        out.print(
            f"listing stopped at {report.listed:,} keys (--max-keys): more counters exist "
            "than are shown; narrow with --user/--tenant or raise --max-keys"
        )


def _title(filters: dict[str, str]) -> str:
    if not filters:
        return "budgets: every active counter"
    return "budgets: " + ", ".join(f"{k} {v}" for k, v in filters.items())
