"""``mcpbg demo --serve``: the console one command from the demo, on the demo's own data.

The demo runs as a subprocess (testing/demo_server.py) and prints a one-time login
link; that link, once, sets the read token's cookie and leads to the dashboard,
whose breaker card and spend chart both say what the demo spent.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

pytest.importorskip("starlette")

from testing.demo_server import DemoServing, demo_serving


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoServing]:
    with demo_serving(tmp_path_factory.mktemp("demo-serve") / "out") as serving:
        yield serving


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _get(url: str, cookie: str | None = None) -> tuple[int, dict[str, str], bytes]:
    opener = urllib.request.build_opener(_NoRedirect)
    req = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_demo_says_how_to_see_it_in_the_console(tmp_path: Path) -> None:
    from tests.test_demo import run_demo

    proc = run_demo(tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.rstrip().splitlines()[-1]
    assert "scripts/demo --serve" in last and "mcpbg demo --serve" in last


@pytest.fixture(scope="module")
def login(demo: DemoServing) -> tuple[int, dict[str, str]]:
    """The one use of the demo's login link: its status and headers."""
    status, headers, _ = _get(demo.link)
    return status, headers


def test_the_login_link_works_once_and_carries_no_token(
    demo: DemoServing, login: tuple[int, dict[str, str]]
) -> None:
    assert "token" not in demo.link
    status, headers = login
    assert status == 303 and headers["location"] == "/dashboard"
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    again, _, body = _get(demo.link)  # spent: a copied or logged link opens nothing
    assert again == 401 and b"used already" in body
    page, _, html = _get(demo.base + "/dashboard", cookie.split(";")[0])
    assert page == 200 and b"mcpbg dashboard" in html
    assert _get(demo.base + "/dashboard")[0] == 401  # without the cookie: nothing


def test_the_breaker_card_and_the_chart_agree_on_the_demo_spend(
    demo: DemoServing, login: tuple[int, dict[str, str]]
) -> None:
    spent = json.loads((demo.out / "summary.json").read_text())["global_spend_micros"]
    assert spent > 0
    _, _, raw = _get(demo.base + "/dashboard/data", login[1]["set-cookie"].split(";")[0])
    data = json.loads(raw)
    (card,) = data["breakers"]
    assert card["source"] == "ledger" and card["spent"] == spent == card["counters_spent"]
    series = data["series"]["tenants"]
    assert sum(values[-1] for values in series.values()) == spent  # the chart's last point


def test_the_demo_story_lies_in_the_past(demo: DemoServing) -> None:
    """Refusals, the breaker table and the ledger carry times up to now, never ahead."""
    now = time.time()
    if now % 86_400 < 600:  # pragma: no cover
        pytest.skip("in a UTC day's first minutes the story may end ahead (SimClock)")
    times = []
    for path in sorted((demo.out / "ledger").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            times.append(datetime.fromisoformat(json.loads(line)["time"]).timestamp())
    assert times and max(times) <= now


async def test_over_counters_that_never_saw_the_ledger_the_card_still_reads_the_ledger(
    demo: DemoServing,
) -> None:
    """The bug this fixes: `mcpbg serve` over an empty Redis showed $0 on the breaker card
    beside a chart of the ledger's spend. Now both read the ledger; the counters' 0 stays
    beside it as what enforcement holds."""
    from mcp_budget_governor import MemoryBackend
    from mcp_budget_governor.console.api import Console
    from mcp_budget_governor.console.auth import Tokens
    from mcp_budget_governor.console.dashboard import snapshot
    from mcp_budget_governor.demo.scenario import POLICY

    spent = json.loads((demo.out / "summary.json").read_text())["global_spend_micros"]
    console = Console(
        POLICY, MemoryBackend(), Tokens("r" * 16, "w" * 16), ledger_dir=str(demo.out / "ledger")
    )
    (card,) = (await snapshot(console))["breakers"]
    assert (card["spent"], card["counters_spent"], card["source"]) == (spent, 0, "ledger")
