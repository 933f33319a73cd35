"""The live dashboard of ``mcpbg serve``: budgets, breakers, alerts, spend, spenders, refusals.

``GET /dashboard`` is the page (server-rendered HTML, Chart.js from ``/static/``);
it reads ``GET /dashboard/data`` (:func:`snapshot`) every few seconds and
redraws in place, so it stays live without a reload.

>>> "/static/mcpbg-dashboard.js" in page()
True
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, Protocol

from ..policy import Policy
from .report import STYLE


class Source(Protocol):
    """What the page reads: an ``api.Console``, the app that serves it (above this module)."""

    policy: Policy
    backend: Any

    def ledger(self, since: Any = None, until: Any = None) -> Any: ...

    async def worker_alerts(self, n: int, limit: str | None = None) -> list[dict[str, Any]]: ...


#: Seconds between two refreshes of the page's data.
REFRESH = 5
#: How many of the worker's latest alerts the page lists.
ALERTS_SHOWN = 15


async def snapshot(
    console: Source, period: str | None = None, now: float | None = None
) -> dict[str, Any]:
    """Everything the page draws, as JSON: budget rows, breakers, the spend series with
    caps, top spenders, refusals by reason and the latest ones (today, or ``period``),
    and the stream worker's latest alerts (kept in Redis, whatever the period).
    ``now`` (default: the clock) is when the counters' forecasts are taken."""
    from starlette.concurrency import run_in_threadpool

    from ..money import Unit
    from ..projections.budgets import budget_report, format_amount
    from ..projections.costs import Filter, costs_json, spend
    from ..windows import parse_period
    from .data import (
        counter_totals,
        first_trip,
        latest_refusals,
        refusals_by_reason,
        spend_series,
    )

    report = await budget_report(console.policy, console.backend, now=now)
    rows: list[dict[str, Any]] = []
    for b in report.rows:
        j = b.as_json(report.tz, now=report.at)
        j["shown"] = {
            k: format_amount(b.limit.unit, getattr(b, k)) for k in ("spent", "cap", "remaining")
        }
        j["shown"]["forecast"] = b.forecast(report.at)  # the cell `mcpbg budgets` prints
        j["who"] = b.who
        rows.append(j)
    breakers = [r for r in rows if r["scope"] == "global"]
    alerts = await console.worker_alerts(ALERTS_SHOWN)
    day = period or datetime.fromtimestamp(time.time(), UTC).strftime("%Y-%m-%d")
    start, end = parse_period(day)
    flt = Filter(start, end)

    def read() -> dict[str, Any]:
        try:
            con = console.ledger(start, end)
        except Exception as exc:  # no ledger, or an empty one: the counters still show
            return {"ledger_error": str(exc)}
        try:
            return {
                "ledger_spent": counter_totals(con, [card["key"] for card in breakers]),
                "series": spend_series(con, flt),
                "trip": first_trip(con, flt),
                "top": costs_json([spend(con, ["user", "tenant"], flt, top=10)])[
                    "spend by user, tenant"
                ],
                "reasons": refusals_by_reason(con, flt),
                "refusals": latest_refusals(con, flt, 15),
            }
        finally:
            con.close()

    ledger = await run_in_threadpool(read)
    # One source for the cards and the chart beside them: with a ledger, a breaker
    # card's spend is the ledger's total for its counter, as the chart's is; what the
    # counters hold stays beside it (they differ only while the projection lags, or
    # over counters that were never fed this ledger).
    for card in breakers:
        total = ledger.get("ledger_spent", {}).get(card["key"])
        if total is not None:
            card["counters_spent"] = card["spent"]
            card["spent"] = total
            card["shown"]["spent"] = format_amount(Unit(card["unit"]), total)
            card["source"] = "ledger"
        else:
            card["source"] = "counters"
    ledger.pop("ledger_spent", None)
    caps = []
    for r in rows:  # the counters' effective caps (run-time caps and plans included)
        if r["unit"] == "usd_micros" and r["scope"] == "tenant":
            caps.append(
                {"tenant": r["scope_values"]["tenant"], "value": r["limit"], "label": r["name"]}
            )
        elif r["unit"] == "usd_micros" and r["scope"] == "global":
            caps.append({"tenant": None, "value": r["limit"], "label": f"{r['name']} (all)"})
    return {
        "at": report.as_json()["at"],
        "period": day,
        "budgets": rows,
        "breakers": breakers,
        "caps": caps,
        "alerts": alerts,
        **ledger,
    }


def page() -> str:
    """The dashboard's HTML: the layout, filled in by its script from ``/dashboard/data``."""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width,initial-scale=1">
<title>mcpbg dashboard</title><style>{STYLE}
.grow {{ flex:1 }} #status {{ font-size:12px }}
</style></head>
<body data-refresh="{REFRESH}"><header><h1>mcpbg dashboard</h1><span class="sub" id="period"></span>
<span class="right" id="status">loading…</span></header>
<main>
<div class="kpis" id="breakers"></div>
<section class="card wide"><h2>Spend over time per tenant</h2>
<div class="muted" style="margin:-4px 0 8px">
dashed lines: caps · red dashed line: breaker tripped</div>
<div class="chart"><canvas id="spend"></canvas></div></section>
<section class="card"><h2>Top spenders</h2><div id="top"></div></section>
<section class="card"><h2>Refusals by reason</h2>
<div class="chart short"><canvas id="reasons"></canvas></div></section>
<section class="card wide"><h2>Budget alerts (stream worker)</h2><div id="alerts"></div></section>
<section class="card wide"><h2>Latest refusals</h2><div id="refusals"></div></section>
<section class="card wide"><h2>Budgets per tenant and user</h2><div id="budgets"></div></section>
</main>
<footer>Refreshes every {REFRESH} s · data: <code>/dashboard/data</code> ·
API: <code>/openapi.json</code> · charts by Chart.js (MIT, bundled)</footer>
<script src="/static/chart.umd.min.js"></script>
<script src="/static/mcpbg-charts.js"></script>
<script src="/static/mcpbg-dashboard.js"></script>
</body></html>
"""
