/* The mcpbg dashboard: draws /dashboard/data, refreshes itself. */
"use strict";
const REFRESH_MS = Number(document.body.dataset.refresh || 5) * 1000;
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) =>
  ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"})[c]);
const usd = (m) => "$" + (m / 1e6).toFixed(2);
const count = (n) => Number(n).toLocaleString("en-US");  // 1,868, as the CLI prints counts
const amount = (v, unit) => unit === "usd_micros" ? usd(v) : String(v);
let spendChart = null, reasonChart = null;
function tableOf(headers, rows, numeric) {
  if (!rows.length) return '<div class="empty">nothing yet</div>';
  const th = headers.map((h) => `<th class="${numeric.includes(h) ? "n" : ""}">${esc(h)}</th>`).join("");
  const tr = rows.map((r) => "<tr>" + r.map((c, i) =>
    `<td class="${numeric.includes(headers[i]) ? "n" : ""}">${c}</td>`).join("") + "</tr>").join("");
  return `<table><thead><tr>${th}</tr></thead><tbody>${tr}</tbody></table>`;
}
function bar(spent, limit) {
  const f = limit > 0 ? Math.min(spent / limit, 1) : 1;
  const cls = f >= 1 ? "bad" : f >= 0.8 ? "warn" : "";
  return `<div class="bar ${cls}"><i style="width:${(f * 100).toFixed(1)}%"></i></div>`;
}
function draw(d) {
  $("period").textContent = "today (" + d.period + ", UTC) · counters at " + d.at;
  $("breakers").innerHTML = d.breakers.map((b) => `<div class="kpi ${b.exceeded ? "bad" : "ok"}"
    data-breaker="${esc(b.name)}"><div class="v">${b.exceeded ? "TRIPPED" : "closed"}</div>
    <div class="l">breaker ${esc(b.name)} · ${esc(b.shown.spent)} of ${esc(b.shown.cap)}</div></div>`).join("")
    || '<div class="kpi"><div class="v">-</div><div class="l">no global breaker in the policy</div></div>';
  const rows = d.budgets.filter((r) => r.scope !== "global").sort((a, b) =>
    (a.scope + a.who + a.name).localeCompare(b.scope + b.who + b.name));
  $("budgets").innerHTML = tableOf(["limit", "scope", "who", "window", "spent", "limit ", "used", "source", "remaining", "state", "forecast"],
    rows.map((r) => [esc(r.name), esc(r.scope), esc(r.who), esc(r.window), esc(r.shown.spent),
      esc(r.shown.cap), bar(r.spent, r.limit + r.grant), esc(r.limit_source) + (r.grant ? " + grant" : ""),
      esc(r.shown.remaining), r.exceeded ? '<span class="pill bad">exceeded</span>' : '<span class="pill ok">ok</span>',
      esc(r.shown.forecast)]),
    ["spent", "limit ", "remaining"]);
  $("alerts").innerHTML = tableOf(["time", "kind", "limit", "scope", "level", "used", "cap", "bucket"],
    (d.alerts || []).map((a) => [esc(a.time), `<span class="pill ${a.kind === "breaker" ? "bad" : "warn"}">${esc(a.kind)}</span>`,
      esc(a.limit), esc(a.scope), esc(a.level + "%"), esc(amount(a.used, a.unit)), esc(amount(a.cap, a.unit)),
      esc(a.bucket)]), ["level", "used", "cap"]);
  if (d.ledger_error) {
    $("top").innerHTML = $("refusals").innerHTML = `<div class="empty">${esc(d.ledger_error)}</div>`;
    return;
  }
  spendChart = mcpbgSpendChart($("spend"), d.series, d.caps, d.trip, false, spendChart);
  reasonChart = mcpbgReasonChart($("reasons"), d.reasons, reasonChart);
  $("top").innerHTML = tableOf(["user", "tenant", "calls", "refused", "spent"],
    d.top.map((r) => [esc(r.user), esc(r.tenant), count(r.calls), count(r.rejected), esc("$" + r.usd)]),
    ["calls", "refused", "spent"]);
  $("refusals").innerHTML = tableOf(["time", "tenant", "user", "tool", "reason"],
    d.refusals.map((r) => [esc(r.time), esc(r.tenant), esc(r.user), esc(r.tool),
      `<span class="pill ${r.status === 503 ? "bad" : "warn"}">${esc(r.reason)}</span>`]), []);
}
async function refresh() {
  try {
    const r = await fetch("/dashboard/data", {credentials: "same-origin"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    draw(await r.json());
    $("status").textContent = "updated " + new Date().toISOString().slice(11, 19) + "Z";
    document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
  } catch (e) { $("status").textContent = "refresh failed: " + e.message; }
}
refresh();
setInterval(refresh, REFRESH_MS);
