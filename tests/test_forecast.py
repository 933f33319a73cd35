"""Spend forecast: when a counter reaches its cap at this period's rate, in ``mcpbg budgets``."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Scope, Window
from mcp_budget_governor.cli.budgets import _forecast_cell, print_report
from mcp_budget_governor.forecast import exhausts_at, projected_before_end
from mcp_budget_governor.projections.budgets import HEADERS, budget_report, table_rows

SIX_AM = datetime(2026, 11, 29, 6, tzinfo=UTC).timestamp()
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
    assert cells == {"daily": "2026-11-29 20:00 UTC", "monthly": "-", "per_session": "-"}
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
    assert row[HEADERS.index("forecast")] == "2026-11-29 20:00 UTC"
    (item,) = report.as_json()["rows"]  # type: ignore[attr-defined]
    assert item["projected_exhaust_at"] == "2026-11-29T20:00:00Z"
    assert item["projected_before_end"] is True
    assert _forecast_cell(item) == "2026-11-29 20:00 UTC"  # mcpbg budgets --api, the same cell
    assert _forecast_cell({**item, "projected_before_end": False}) == "-"
