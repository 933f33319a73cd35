"""Self-contained HTML reports: spend over time per tenant with the caps, refusals by
reason, the moment the breaker tripped (``mcpbg demo``'s ``report.html``,
``mcpbg costs --html FILE``).

Chart.js and the drawing script are inlined, so the file opens anywhere, offline.

>>> html = render("t", "s", {"t": [0, 60], "tenants": {"acme": [0, 5]}}, [], None, [], [])
>>> "Chart.js v4" in html and 'id="spend"' in html and 'id="reasons"' in html
True
"""

from __future__ import annotations

import html as _html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from ..money import Unit, format_dollars
from ..policy import Policy
from ..scopes import Scope

#: The files ``mcpbg serve`` serves under ``/static/`` and the reports inline.
STATIC = {
    "chart.umd.min.js": "text/javascript",
    "mcpbg-charts.js": "text/javascript",
    "mcpbg-dashboard.js": "text/javascript",
    "chart.js.LICENSE.md": "text/markdown",
}

STYLE = """
:root { --ink:#0f172a; --muted:#64748b; --line:#e2e8f0; --card:#fff; --bg:#f1f5f9;
        --ok:#16a34a; --warn:#d97706; --bad:#dc2626; --accent:#2563eb; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
       color:var(--ink); background:var(--bg); }
header { background:#0f172a; color:#fff; padding:14px 28px; display:flex; align-items:baseline;
         gap:18px; flex-wrap:wrap; }
header h1 { margin:0; font-size:18px; font-weight:650; letter-spacing:.2px; }
header .sub { color:#cbd5e1; font-size:13px; }
header .right { margin-left:auto; color:#94a3b8; font-size:12px; }
main { padding:20px 28px 40px; display:grid; gap:18px;
       grid-template-columns:repeat(auto-fit,minmax(520px,1fr)); max-width:1500px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:10px;
        padding:16px 18px; box-shadow:0 1px 2px rgba(15,23,42,.04); min-width:0; }
.card.wide { grid-column:1/-1; }
.card h2 { margin:0 0 10px; font-size:14px; font-weight:650; color:#334155;
           text-transform:uppercase; letter-spacing:.5px; }
.chart { position:relative; height:320px; }
.chart.short { height:240px; }
.kpis { display:flex; gap:14px; flex-wrap:wrap; grid-column:1/-1; }
.kpi { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px 18px;
       min-width:170px; flex:1; }
.kpi .v { font-size:22px; font-weight:700; font-variant-numeric:tabular-nums; }
.kpi .l { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.4px; }
.kpi.bad .v { color:var(--bad); } .kpi.ok .v { color:var(--ok); }
table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
th { text-align:left; color:var(--muted); font-weight:600; font-size:12px; padding:6px 8px;
     border-bottom:1px solid var(--line); white-space:nowrap; }
td { padding:6px 8px; border-bottom:1px solid #f1f5f9; vertical-align:middle; }
td.n, th.n { text-align:right; }
tr:last-child td { border-bottom:0; }
.bar { height:8px; border-radius:4px; background:#e2e8f0; overflow:hidden; min-width:90px; }
.bar > i { display:block; height:100%; background:var(--accent); }
.bar.warn > i { background:var(--warn); } .bar.bad > i { background:var(--bad); }
.pill { display:inline-block; padding:1px 8px; border-radius:999px; font-size:12px;
        font-weight:600; background:#e2e8f0; color:#334155; white-space:nowrap; }
.pill.ok { background:#dcfce7; color:#166534; } .pill.bad { background:#fee2e2; color:#991b1b; }
.pill.warn { background:#fef3c7; color:#92400e; }
.muted { color:var(--muted); } .empty { color:var(--muted); padding:18px 0; text-align:center; }
code { font-size:12px; background:#f1f5f9; padding:1px 5px; border-radius:4px; }
footer { color:var(--muted); font-size:12px; padding:0 28px 24px; }
"""


_TEXT = ("tenant", "user", "tool", "breaker", "first", "last")


def static_file(name: str) -> tuple[str, str]:
    """A file of ``static/`` and its media type (KeyError: not one of :data:`STATIC`)."""
    media = STATIC[name]
    return resources.files(__package__).joinpath("static", name).read_text("utf-8"), media


def _script(name: str) -> str:
    return static_file(name)[0].replace("</script", "<\\/script")


def esc(value: Any) -> str:
    return _html.escape("" if value is None else str(value))


def table(headers: list[str], rows: list[list[Any]], numeric: tuple[str, ...] = ()) -> str:
    """An HTML table; cells are escaped text (``numeric`` headers right-aligned)."""
    if not rows:
        return '<div class="empty">nothing in this period</div>'
    head = "".join(f'<th class="{"n" if h in numeric else ""}">{esc(h)}</th>' for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"n" if h in numeric else ""}">{esc(v)}</td>'
            for h, v in zip(headers, row, strict=True)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def tenant_caps(policy: Policy | None, tenants: list[str]) -> list[dict[str, Any]]:
    """The caps to draw: each tenant's USD limits (value caps or default), and the
    global USD limits (breakers) as ``tenant: None``."""
    if policy is None:
        return []
    out: list[dict[str, Any]] = []
    for limit in policy:
        if limit.unit is not Unit.USD_MICROS:
            continue
        if limit.dimensions == (Scope.TENANT,):
            for tenant in tenants:
                cap = (limit.caps or {}).get(tenant, limit.cap)
                out.append({"tenant": tenant, "value": cap, "label": limit.name})
        elif not limit.dimensions:
            out.append({"tenant": None, "value": limit.cap, "label": f"{limit.name} (all tenants)"})
    return out


def script_json(value: Any) -> str:
    """``value`` as JSON safe inside any ``<script>`` element, whatever its strings hold:
    ``<``, ``>`` and ``&`` written as ``\\u003c`` and so on, so no ``</script>``,
    ``<!--`` or ``<script`` (which put the HTML parser in a "double-escaped" state
    and blank the page's charts) can appear in the element's text."""
    text = json.dumps(value)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(
    title: str,
    subtitle: str,
    series: dict[str, Any],
    caps: list[dict[str, Any]],
    trip: float | None,
    reasons: list[dict[str, Any]],
    sections: list[tuple[str, str]],
    *,
    kpis: list[tuple[str, str, str]] | None = None,
    relative: bool = False,
) -> str:
    """The report page: KPI tiles, the spend chart, the refusals chart, then ``sections``
    (title, HTML) as cards."""
    data = script_json(
        {"series": series, "caps": caps, "trip": trip, "reasons": reasons, "relative": relative}
    )
    tiles = "".join(
        f'<div class="kpi {esc(cls)}"><div class="v">{esc(v)}</div><div class="l">{esc(label)}'
        f"</div></div>"
        for label, v, cls in kpis or []
    )
    cards = "".join(
        f'<section class="card wide"><h2>{esc(t)}</h2>{body}</section>' for t, body in sections
    )
    trip_note = "" if trip is None else " · red dashed line: the breaker tripped"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width,initial-scale=1">
<title>{esc(title)}</title><style>{STYLE}</style></head>
<body><header><h1>{esc(title)}</h1><span class="sub">{esc(subtitle)}</span>
<span class="right">mcp-budget-governor</span></header>
<main>
<div class="kpis">{tiles}</div>
<section class="card wide"><h2>Spend over time per tenant</h2>
<div class="muted" style="margin:-4px 0 8px">dashed lines: caps{trip_note}</div>
<div class="chart"><canvas id="spend" aria-label="spend over time per tenant"></canvas></div>
</section>
<section class="card wide"><h2>Refusals by reason</h2>
<div class="chart short"><canvas id="reasons" aria-label="refusals by reason"></canvas></div>
</section>
{cards}
</main>
<footer>Charts by Chart.js (MIT licence, bundled). Amounts are exact USD from integer micros.
</footer>
<script>{_script("chart.umd.min.js")}</script>
<script>{_script("mcpbg-charts.js")}</script>
<script type="application/json" id="mcpbg-data">{data}</script>
<script>
const D = JSON.parse(document.getElementById("mcpbg-data").textContent);
mcpbgSpendChart(document.getElementById("spend"), D.series, D.caps, D.trip, D.relative);
mcpbgReasonChart(document.getElementById("reasons"), D.reasons);
</script>
</body></html>
"""


def _tripped(trip: float | None, first: float | None, relative: bool) -> str:
    """The breaker tile: when it tripped (from the first event, or the UTC time)."""
    from datetime import UTC, datetime

    if trip is None:
        return "not tripped"
    if relative and first is not None:
        s = round(trip - first)
        return f"tripped at +{s // 60}m{s % 60:02d}s"
    return "tripped " + datetime.fromtimestamp(trip, UTC).strftime("%H:%M:%SZ")


def write_costs_report(
    con: Any,
    flt: Any,
    path: str | Path,
    *,
    policy: Policy | None = None,
    title: str = "",
    relative: bool = False,
) -> Path:
    """``mcpbg costs --html``: the report of the filter's period, written to ``path``."""
    from ..projections.costs import costs_reports
    from .data import first_trip, refusals_by_reason, spend_series

    series = spend_series(con, flt)
    reasons = refusals_by_reason(con, flt)
    trip = first_trip(con, flt)
    reports = {r.title: r for r in costs_reports(con, flt, top=10)}
    total = reports["summary"]
    row = dict(zip(total.headers, total.rows[0], strict=True)) if total.rows else {}
    span = f"{row.get('first') or '-'} to {row.get('last') or '-'}"
    kpis = [
        ("spent", format_dollars(int(row.get("usd_micros") or 0)), ""),
        ("calls admitted", f"{int(row.get('calls') or 0):,}", ""),
        (
            "calls refused",
            f"{int(row.get('rejected') or 0):,}",
            "bad" if row.get("rejected") else "ok",
        ),
        (
            "breaker",
            _tripped(trip, series["t"][0] if series["t"] else None, relative),
            "bad" if trip is not None else "ok",
        ),
    ]
    sections = []
    for name in ("spend by tenant", "top 10 spenders", "spend by tool", "breaker trips"):
        r = reports.get(name)
        if r is None:
            continue
        keep = [
            h
            for h in r.headers
            if h not in ("cache_read_tokens", "cache_write_tokens", "model_calls", "events")
        ]
        rows = [
            [
                format_dollars(int(v)) if h in r.money else (f"{v:,}" if isinstance(v, int) else v)
                for h, v in zip(r.headers, raw, strict=True)
                if h in keep
            ]
            for raw in r.rows
        ]
        shown = [h.removesuffix("_micros").replace("usd", "spent") for h in keep]
        numeric = tuple(s for s, h in zip(shown, keep, strict=True) if h not in _TEXT)
        sections.append((name, table(shown, rows, numeric)))
    html = render(
        title or "mcpbg costs",
        span,
        series,
        tenant_caps(policy, list(series["tenants"])),
        trip,
        reasons,
        sections,
        kpis=kpis,
        relative=relative,
    )
    out = Path(path)
    out.write_text(html, "utf-8")
    return out
