"""Spend forecast: when a counter reaches its cap at this period's rate, in ``mcpbg budgets``."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Scope, Window
from mcp_budget_governor.cli.budgets import _forecast_cell, print_report
from mcp_budget_governor.forecast import exhausts_at, projected_before_end
from mcp_budget_governor.projections.budgets import HEADERS, budget_report, table_rows

# In the future: the dedupe store judges markers by the real clock.
SIX_AM = datetime(2027, 3, 10, 6, tzinfo=UTC).timestamp()
POLICY = Policy.of(
    Limit("daily", cap=100, window=Window.DAY, scope=Scope.USER),
    Limit("monthly", cap=10_000, window=Window.MONTH, scope=Scope.USER),
    Limit("per_session", cap=5, window=Window.SESSION, scope=Scope.USER),
)


def test_the_rule() -> None:
    day = (SIX_AM - 6 * 3600, SIX_AM + 18 * 3600)
    assert exhausts_at(30, 100, *day, now=SIX_AM) == SIX_AM + 14 * 3600  # 5 an hour, 70 left
    assert projected_before_end(30, 100, *day, now=SIX_AM)
    assert not projected_before_end(20, 100, *day, now=SIX_AM)  # exactly at the end: not before
    assert exhausts_at(0, 100, *day, now=SIX_AM) is None  # no rate yet
    assert exhausts_at(100, 100, *day, now=SIX_AM) is None  # spent already: "exceeded" says it
    assert exhausts_at(5, 100, None, None, now=SIX_AM) is None  # a session has no period end
    assert exhausts_at(5, 100, *day, now=day[0]) is None  # the period has just begun


def test_budgets_shows_the_forecast_column_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    backend = MemoryBackend(clock=lambda: SIX_AM)
    governor = Governor(POLICY, backend, clock=lambda: SIX_AM)

    async def run() -> object:
        for i in range(30):  # a session each: the session cap stops none of them
            assert (await governor.check(Context(user="u_1", session=f"s-{i}"))).admitted
        return await budget_report(POLICY, backend, user="u_1", session="s-0", now=SIX_AM)

    report = asyncio.run(run())
    column = HEADERS.index("forecast")
    cells = {row[0]: row[column] for row in table_rows(report)}  # type: ignore[arg-type]
    # 30 calls by 06:00 is 5 an hour: the day's 100 by 20:00; the month's 10,000 not this month.
    assert cells == {"daily": "2027-03-10 20:00 UTC", "monthly": "-", "per_session": "-"}
    rows = {r["name"]: r for r in report.as_json()["rows"]}  # type: ignore[attr-defined]
    assert rows["daily"]["projected_before_end"] is True
    assert rows["monthly"]["projected_exhaust_at"] is not None
    assert rows["monthly"]["projected_before_end"] is False
    assert rows["per_session"]["projected_exhaust_at"] is None  # no period end to race
    print_report(report, title="budgets")  # type: ignore[arg-type]
    assert "forecast" in capsys.readouterr().out


def test_a_counter_on_course_to_run_out_shows_when() -> None:
    policy = Policy.of(Limit("daily", cap=100, window=Window.DAY, scope=Scope.USER))
    backend = MemoryBackend(clock=lambda: SIX_AM)
    governor = Governor(policy, backend, clock=lambda: SIX_AM)

    async def run() -> object:
        for _ in range(30):
            assert (await governor.check(Context(user="u_1"))).admitted
        return await budget_report(policy, backend, user="u_1", now=SIX_AM)

    report = asyncio.run(run())
    (row,) = table_rows(report)  # type: ignore[arg-type]
    assert row[HEADERS.index("forecast")] == "2027-03-10 20:00 UTC"
    (item,) = report.as_json()["rows"]  # type: ignore[attr-defined]
    assert item["projected_exhaust_at"] == "2027-03-10T20:00:00Z"
    assert item["projected_before_end"] is True
    assert _forecast_cell(item) == "2027-03-10 20:00 UTC"  # mcpbg budgets --api, the same cell
    assert _forecast_cell({**item, "projected_before_end": False}) == "-"


def test_the_console_budgets_table_shows_the_same_forecast() -> None:
    """``/dashboard/data`` carries the cell the page's forecast column draws
    (static/mcpbg-dashboard.js): what ``mcpbg budgets --api`` prints for the same row."""
    pytest.importorskip("starlette")
    from mcp_budget_governor.console.api import Console
    from mcp_budget_governor.console.auth import Tokens
    from mcp_budget_governor.console.dashboard import snapshot

    backend = MemoryBackend(clock=lambda: SIX_AM)
    governor = Governor(POLICY, backend, clock=lambda: SIX_AM)
    console = Console(POLICY, backend, Tokens("r" * 24, "w" * 24))

    async def run() -> dict[str, Any]:
        for i in range(30):
            assert (await governor.check(Context(user="u_1", session=f"s-{i}"))).admitted
        return await snapshot(console, now=SIX_AM)

    rows = [r for r in asyncio.run(run())["budgets"] if r["scope_values"].get("user") == "u_1"]
    cells = {r["name"]: r["shown"]["forecast"] for r in rows if r["name"] != "per_session"}
    assert cells == {"daily": "2027-03-10 20:00 UTC", "monthly": "-"}
    for r in rows:
        assert r["shown"]["forecast"] == _forecast_cell(r), r


# -- the alert: "projected to exhaust before the period ends", once per period ---------


def test_the_worker_alerts_a_projected_exhaustion_once_per_period() -> None:
    from mcp_budget_governor.planning import slot
    from mcp_budget_governor.stream.alerts import AlertEvaluator, MemoryDeduper, parse_alert

    spend = Limit("spend", cap=1_000, window=Window.DAY, scope=Scope.USER, alert_at=(80,))
    policy = Policy.of(spend)
    clock = [SIX_AM]
    backend = MemoryBackend(clock=lambda: clock[0])
    # Opt-in (MCPBG_ALERT_FORECAST=1); test_off_by_default covers the default.
    ev = AlertEvaluator(
        policy, backend, dedupe=MemoryDeduper(), clock=lambda: clock[0], forecast=True
    )

    async def charge(amount: int) -> list[Any]:
        s = slot(spend, Context(user="alice"), clock[0], UTC, amount, enforce=False)
        assert s is not None
        await backend.charge([s.op])
        return list(await ev.evaluate([s.ledger_charge()]))

    async def run() -> list[list[Any]]:
        out = [await charge(100)]  # 100 by 06:00: 1,000 only after the day ends
        clock[0] += 3600
        out.append(await charge(150))  # 250 by 07:00: 1,000 by 04:00 tomorrow; still not
        clock[0] += 3600
        out.append(await charge(150))  # 400 by 08:00: 1,000 by 20:00 today
        clock[0] += 600
        out.append(await charge(100))  # still projected: not again
        return out

    fired = asyncio.run(run())
    assert [len(f) for f in fired] == [0, 0, 1, 0]
    (alert,) = fired[2]
    assert (alert.kind, alert.limit, alert.scope, alert.level, alert.used) == (
        "forecast", "spend", "user=alice", 40, 400,
    )  # fmt: skip
    assert alert.marker.endswith(":forecast")
    assert parse_alert(alert.to_json()) == alert  # the JSON form carries the kind


def test_off_by_default() -> None:
    from mcp_budget_governor.planning import slot
    from mcp_budget_governor.stream.alerts import AlertEvaluator, MemoryDeduper
    from mcp_budget_governor.stream.config import WorkerConfig

    assert WorkerConfig.__dataclass_fields__["alert_forecast"].default == 0
    spend = Limit("spend", cap=1_000, window=Window.DAY, scope=Scope.USER, alert_at=(80,))
    backend = MemoryBackend(clock=lambda: SIX_AM)
    ev = AlertEvaluator(Policy.of(spend), backend, dedupe=MemoryDeduper(), clock=lambda: SIX_AM)

    async def run() -> list[Any]:
        s = slot(spend, Context(user="alice"), SIX_AM, UTC, 700, enforce=False)
        assert s is not None
        await backend.charge([s.op])
        return list(await ev.evaluate([s.ledger_charge()]))

    assert asyncio.run(run()) == []  # 70 % by 06:00 is on course, but nobody asked
