"""A real browser (Debian's headless Chromium, driven by Playwright) on the dashboard and
the demo's report.html.

Skipped with the reason when Playwright or /usr/bin/chromium is missing (scripts/test
installs chromium when it runs as root). Screenshots are kept in
``$MCPBG_TEST_ARTIFACTS`` (default ``test-artifacts/`` at the repository root).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("playwright.sync_api", reason="Playwright (PyPI playwright) is not installed")
pytest.importorskip("starlette")

from playwright.sync_api import BrowserContext, sync_playwright

from mcp_budget_governor import Context, Governor, RedisBackend
from mcp_budget_governor.cli.budgets import _forecast_cell
from mcp_budget_governor.money import Unit
from mcp_budget_governor.policy_file import load_policy
from mcp_budget_governor.producers.file_ledger import FileLedger
from mcp_budget_governor.projections.budgets import format_amount
from testing.console_server import READ, Served, serve_console

CHROMIUM = os.environ.get("MCPBG_TEST_CHROMIUM", "/usr/bin/chromium")
REPO = Path(__file__).resolve().parent.parent
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(
    shutil.which(CHROMIUM) is None,
    reason=f"no Chromium at {CHROMIUM} (apt-get install chromium; scripts/test does as root)",
)


def artifacts() -> Path:
    folder = Path(os.environ.get("MCPBG_TEST_ARTIFACTS") or REPO / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, redis_service: Any) -> Iterator[Served]:
    with serve_console(tmp_path_factory.mktemp("browser"), redis_service, 8) as s:
        yield s


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[BrowserContext]:
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh --user-data-dir
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context
        finally:
            context.close()


def _wait_for(page: Any, expression: str, within: float = 60.0) -> None:
    """Wait until ``expression`` is true in ``page``: polled through ``evaluate``, as
    Playwright's ``wait_for_function`` evaluates strings with ``eval``, which the
    console's Content-Security-Policy (rightly) forbids."""
    deadline = time.monotonic() + within
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {within:.0f} s: {expression}"
        page.wait_for_timeout(100)


def _api(served: Served, path: str) -> Any:
    req = urllib.request.Request(served.url + path, headers={"Authorization": f"Bearer {READ}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


async def _refused_call(served: Served, user: str) -> None:
    gov = Governor(
        load_policy(str(served.policy)),
        RedisBackend.from_url(served.redis_url, timeout=5.0),
        ledger=FileLedger(served.ledger, fsync="always"),
    )
    async with gov:
        ctx = Context(user=user, tenant="initech", tool="search")
        decisions = [await gov.check(ctx) for _ in range(5)]  # the 5th: the breaker sheds it
        assert not decisions[-1].admitted


def test_dashboard_shows_the_api_numbers_and_a_new_refusal(
    served: Served, browser: BrowserContext
) -> None:
    page = browser.new_page()
    page.goto(f"{served.url}/dashboard?token={READ}")  # the token moves into a cookie
    assert page.url.endswith("/dashboard")
    _wait_for(page, "Number(document.body.dataset.loaded || 0) >= 1")
    # The numbers the API returns, in the budgets table.
    rows = _api(served, "/v1/budgets")["rows"]
    spend = next(r for r in rows if r["name"] == "tenant_spend" and
                 r["scope_values"]["tenant"] == "acme")  # fmt: skip
    shown = format_amount(Unit.USD_MICROS, spend["spent"])
    row = page.locator("#budgets tr", has_text="tenant_spend").filter(has_text="acme")
    assert shown in row.inner_text()
    # The forecast column: the cell `mcpbg budgets --api` prints for the same API row
    # (polled: the page and the API may read the clock on either side of a minute).
    assert page.locator("#budgets th").last.inner_text() == "forecast"
    deadline = time.monotonic() + 60
    while True:
        now = next(r for r in _api(served, "/v1/budgets")["rows"] if r["key"] == spend["key"])
        if row.locator("td").last.inner_text() == _forecast_cell(now):
            break
        assert time.monotonic() < deadline, (row.inner_text(), _forecast_cell(now))
        page.wait_for_timeout(500)
    breaker = page.locator('[data-breaker="global_spend"]').inner_text()
    assert "TRIPPED" in breaker
    assert page.evaluate("Chart.getChart(document.getElementById('spend')).data.datasets.length")
    # A governed call the breaker refuses shows up without a reload.
    # (in a thread of its own: Playwright's sync API keeps an event loop in this one)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _refused_call(served, "u-browser")).result(timeout=120)
    _wait_for(page, "document.getElementById('refusals').innerText.includes('u-browser')")
    text = page.locator("#refusals tr", has_text="u-browser").first.inner_text()
    assert "global_spend: breaker tripped (503)" in text
    page.screenshot(path=str(artifacts() / "dashboard.png"), full_page=True)


@pytest.mark.slow
def test_the_demo_report_opens_with_its_charts(tmp_path: Path, browser: BrowserContext) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "mcp_budget_governor.cli", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = out / "report.html"
    assert "report.html" in proc.stdout  # the demo says where
    page = browser.new_page()
    page.goto(report.as_uri())
    page.wait_for_function("Chart.getChart(document.getElementById('reasons')) !== undefined")
    spend = page.evaluate(
        "Chart.getChart(document.getElementById('spend')).data.datasets.map(d => d.label)"
    )
    assert {"acme", "globex", "all tenants"} <= set(spend)
    assert any(label.startswith("global_spend") for label in spend)  # the breaker's cap
    reasons = page.evaluate("Chart.getChart(document.getElementById('reasons')).data.labels")
    assert "global_spend: breaker tripped (503)" in reasons
    assert page.evaluate(
        "Chart.getChart(document.getElementById('spend')).options.plugins.mcpbgTrip.at"
    )
    assert "tripped at" in page.locator(".kpis").inner_text()
    page.screenshot(path=str(artifacts() / "demo-report.png"), full_page=True)


@pytest.mark.parametrize("tenant", ["<!--<script>", "</script><b>x", "a&b\u2028c"])
def test_a_report_draws_its_charts_whatever_a_tenant_is_named(
    tmp_path: Path, browser: BrowserContext, tenant: str
) -> None:
    """A tenant named ``<!--<script>`` once put the report's inline script in the HTML
    parser's "double-escaped" state, and its charts stayed blank."""
    from mcp_budget_governor.console.report import render

    series = {"t": [0, 60], "tenants": {tenant: [0, 5_000_000], "acme": [0, 1_000_000]}}
    caps = [{"tenant": tenant, "value": 9_000_000, "label": f"cap of {tenant}"}]
    reasons = [{"reason": f"{tenant}: budget_exceeded", "refusals": 3, "status": 429}]
    path = tmp_path / "report.html"
    path.write_text(render(tenant, "s", series, caps, None, reasons, [(tenant, "<p>x</p>")]))
    page = browser.new_page()
    page.goto(path.as_uri())
    page.wait_for_function("Chart.getChart(document.getElementById('reasons')) !== undefined")
    labels = page.evaluate(
        "Chart.getChart(document.getElementById('spend')).data.datasets.map(d => d.label)"
    )
    assert {tenant, "acme"} <= set(labels)
    reasons_drawn = page.evaluate("Chart.getChart(document.getElementById('reasons')).data.labels")
    assert reasons_drawn == [f"{tenant}: budget_exceeded"]
    assert page.title() == tenant


@pytest.mark.slow
def test_from_the_demos_printed_link_to_a_dashboard_of_its_spend(
    tmp_path: Path, browser: BrowserContext
) -> None:
    """The newcomer's path: `mcpbg demo --serve`, then the link it prints, in a browser."""
    from mcp_budget_governor import format_usd
    from testing.demo_server import demo_serving

    with demo_serving(tmp_path / "out") as demo:
        spent = json.loads((demo.out / "summary.json").read_text())["global_spend_micros"]
        page = browser.new_page()
        page.goto(demo.link)  # one-time: sets the cookie, lands on the dashboard
        assert page.url == demo.base + "/dashboard"
        _wait_for(page, "Number(document.body.dataset.loaded || 0) >= 1")
        card = page.locator('[data-breaker="global_spend"]').inner_text()
        assert "TRIPPED" in card and format_usd(spent) in card, card
        tenants = page.evaluate(
            "Chart.getChart(document.getElementById('spend')).data.datasets.map(d => d.label)"
        )
        assert {"acme", "globex"} <= set(tenants)
        top = page.locator("#top").inner_text()  # counts with thousands separators
        assert re.search(r"\b\d{1,3}(,\d{3})+\b", top) and not re.search(r"(?<![.\d])\d{4,}", top)
        page.screenshot(path=str(artifacts() / "demo-dashboard.png"), full_page=True)
