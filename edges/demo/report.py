"""The demo's narration and report: what :mod:`.runner` prints and writes.

The opening lines, the calls and budgets tables, the DuckDB cost summary over
the ledger, the FOCUS file and ``summary.json``. Rendering only: the run
itself (server, agents, clock, projection) is :mod:`.runner`'s.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console

from mcp_budget_governor import Context, Governor, PriceTable
from mcp_budget_governor.money import format_dollars
from mcp_budget_governor.urls import redact as redact_url

from . import scenario
from .options import DemoOptions, DemoResult
from .scenario import AGENTS, FLAT_PRICES, MODEL, POLICY, SPEND_LIMITS

#: The FOCUS 1.2 file the demo writes into its output folder.
FOCUS_FILE = "focus-costs.csv"
#: The self-contained HTML report (charts) the demo writes there.
REPORT_FILE = "report.html"


def intro(
    console: Console, options: DemoOptions, out: Path, topic: str, prices: PriceTable
) -> None:
    counters = (
        f"Postgres at {redact_url(options.postgres_url)}"
        if options.postgres_url
        else f"Redis at {redact_url(options.redis_url)}"
        if options.redis_url
        else "in-process counters"
    )
    ledger = (
        f"Kafka topic {topic} at {redact_url(options.kafka_url)}"
        if options.kafka_url
        else f"a file ledger in {out / 'ledger'}"
    )
    console.rule("[bold]mcpbg demo")
    console.print(
        f"An MCP server (FastMCP, in process) governed by BudgetMiddleware: {len(AGENTS)} agents "
        f"of {len({a.tenant for a in AGENTS})} tenants burst tool calls at it for "
        f"{options.seconds // 60} simulated minutes.\n"
        f"Counters: {counters}. Ledger: {ledger}. Output folder: {out.resolve()}\n"
        f"Tools: search ({format_dollars(FLAT_PRICES['search'])}/call), "
        f"fetch ({format_dollars(FLAT_PRICES['fetch'])}/call), summarise ({MODEL} tokens priced "
        f"from {prices.version}).\n"
        f"Policy: {scenario.describe(POLICY)}.\n"
        "Polite agents wait out a retry hint and stop when their budget is spent; "
        "runaway-loop ignores every refusal.\n"
    )


async def budgets(console: Console, governor: Governor, result: DemoResult, now: float) -> None:
    from mcp_budget_governor.cli.render import table

    rows = []
    for agent in AGENTS:
        refused = Counter(
            {what: n for (user, what), n in result.outcomes.items() if user == agent.user}
        )
        admitted = refused.pop("admitted", 0)
        spent = await governor.usage("per_user_spend", Context(user=agent.user))
        rows.append(
            [
                agent.user,
                agent.tenant,
                f"{admitted:,}",
                f"{sum(refused.values()):,}",
                ", ".join(f"{r.split(':', 1)[1]} x{n:,}" for r, n in sorted(refused.items()))
                or "-",
                format_dollars(spent),
            ]
        )
    console.print()
    console.print(
        table(
            "Calls by agent",
            ["user", "tenant", "admitted", "refused", "refused by", "spent today"],
            rows,
            numeric=["admitted", "refused", "spent today"],
            width=console.width,
        )
    )
    await _budgets_table(console, governor, now)


async def _budgets_table(console: Console, governor: Governor, now: float) -> None:
    from mcp_budget_governor.cli.render import table
    from mcp_budget_governor.projections.budgets import HEADERS, NUMERIC, budget_report, table_rows

    # Every counter of the current periods, as `mcpbg budgets` lists them.
    report = await budget_report(governor.policy, governor.backend, now=now)
    console.print(
        table(
            "Budgets now (mcpbg budgets)",
            HEADERS,
            table_rows(report),
            numeric=NUMERIC,
            width=console.width,
        )
    )


def costs(console: Console, options: DemoOptions, out: Path) -> None:
    """Spend by tenant, user and tool, and the calls the breaker shed: `mcpbg costs` reports."""
    from mcp_budget_governor.cli.render import table
    from mcp_budget_governor.projections.costs import Filter, breaker_trips, spend

    con = _open_ledger(options, out)
    try:
        report = spend(con, ["tenant", "user", "tool"], Filter())
        trips = breaker_trips(con, Filter())
        kinds = con.execute(
            "SELECT replace(replace(type, 'mcpbg.', ''), '.v1', ''), count(DISTINCT id) "
            "FROM ledger_raw GROUP BY ALL ORDER BY 2 DESC"
        ).fetchall()
    finally:
        con.close()
    shown = ["tenant", "user", "tool", "calls", "rejected", "input_tokens", "output_tokens"]
    at = [report.headers.index(name) for name in [*shown, "usd_micros"]]
    rows = [
        [*(_cell(row[i]) for i in at[:-1]), format_dollars(int(row[at[-1]]))] for row in report.rows
    ]
    console.print(
        table(
            "Cost by tenant, user and tool (DuckDB over the ledger, as mcpbg costs)",
            [*shown, "cost"],
            rows,
            numeric=[*shown[3:], "cost"],
            width=console.width,
        )
    )
    console.print(
        table(
            "Calls shed by the breaker",
            trips.headers,
            [[_cell(v) for v in row] for row in trips.rows],
            numeric=["trips"],
            width=console.width,
        )
    )
    total = sum(n for _, n in kinds)
    console.print(
        f"Ledger: {total:,} events, " + ", ".join(f"{n:,} {kind}" for kind, n in kinds) + " "
        f"(each cost is one event charging {', '.join(SPEND_LIMITS)})"
    )


def _cell(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def write_focus(console: Console, options: DemoOptions, out: Path, now: float) -> Path | None:
    from mcp_budget_governor.focus import Granularity
    from mcp_budget_governor.projections.focus_export import ExportOptions, export_focus

    path = out / FOCUS_FILE
    con = _open_ledger(options, out)
    try:
        day = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        result = export_focus(
            con, path, ExportOptions(day, day + timedelta(days=1), Granularity.HOUR)
        )
    finally:
        con.close()
    console.print(
        f"\nFOCUS 1.2 cost and usage file: {path} ({result.rows:,} rows, "
        f"{format_dollars(result.billed_micros)} billed)"
    )
    return path


def write_html(console: Console, options: DemoOptions, out: Path) -> Path:
    """``report.html``: spend over simulated time per tenant with the caps, refusals by
    reason, the breaker's trip (``console/report.py``, as ``mcpbg costs --html``)."""
    from mcp_budget_governor.console.report import write_costs_report
    from mcp_budget_governor.projections.costs import Filter

    path = out / REPORT_FILE
    con = _open_ledger(options, out)
    try:
        write_costs_report(
            con,
            Filter(),
            path,
            policy=POLICY,
            title="mcpbg demo",
            relative=True,
        )
    finally:
        con.close()
    console.print(f"Charts (spend over time, refusals, the breaker): {path.resolve()}")
    return path


def _open_ledger(options: DemoOptions, out: Path) -> Any:
    from mcp_budget_governor.projections.ledger_view import open_ledger

    if options.kafka_url:
        return open_ledger(archive_dir=out / "archive")
    return open_ledger(ledger_dir=out / "ledger")


def closing(console: Console, result: DemoResult, out: Path, *, serving: bool = False) -> None:
    if result.tripped_at is not None:
        when = scenario.clock_label(result.tripped_at)
        cap = POLICY["global_spend"].cap
        console.print(
            f"Global breaker: TRIPPED at simulated {when} with "
            f"{format_dollars(result.spent)} spent of "
            f"{format_dollars(cap)} (calls that completed are charged in full, even past the cap); "
            "every caller shed since."
        )
    else:
        console.print("Global breaker: not tripped.")
    summary = {
        "calls": result.calls,
        "ledger_events": result.events,
        "breaker_tripped_at_s": result.tripped_at,
        "global_spend_micros": result.spent,
        "focus_file": str(result.focus_file) if result.focus_file else None,
        "report_file": str(result.report_file) if result.report_file else None,
        "outcomes": {f"{u} {w}": n for (u, w), n in sorted(result.outcomes.items())},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"Everything the demo wrote is in {out.resolve()}/")
    if serving:
        console.print("The console on the demo's data starts now:")
    else:
        console.print(
            "Next, the dashboard on this data: scripts/demo --serve (installed: mcpbg demo --serve)"
        )
