"""Weekly windows and billing-day months: the pure bucket rules, then the governor
rolling over at the right instant in a non-UTC zone across a DST change, on both
backends.

Expected instants are written as UTC wall clocks with the zone's known offsets
(CET +1, CEST +2, EST -5, EDT -4), not recomputed by the rule under test.
"""

from __future__ import annotations

import copy
import pickle
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import redis.asyncio as aioredis

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    PolicyError,
    RedisBackend,
    Scope,
    Window,
)
from mcp_budget_governor.planning import slot
from mcp_budget_governor.policy_file import PolicyFileError, loads
from mcp_budget_governor.windows import bucket_for, bucket_of, utc_bounds, zone

BERLIN = zone("Europe/Berlin")
NEW_YORK = zone("America/New_York")


def utc(*parts: int) -> float:
    return datetime(*parts, tzinfo=UTC).timestamp()  # type: ignore[misc]


# -- the pure rules -------------------------------------------------------------


def test_week_starts_monday_midnight_local_across_spring_forward() -> None:
    # 2026-03-29 (Sunday) Berlin moves from CET (+1) to CEST (+2).
    week = bucket_for(Window.WEEK, utc(2026, 3, 29, 12), BERLIN)
    assert week.label == "2026W13@Europe/Berlin"
    assert week.start == utc(2026, 3, 22, 23)  # Mon 23 March 00:00 CET
    assert week.end == utc(2026, 3, 29, 22)  # Mon 30 March 00:00 CEST
    assert week.end - week.start == 7 * 86400 - 3600  # a week one hour short
    last = bucket_for(Window.WEEK, week.end - 1, BERLIN)
    after = bucket_for(Window.WEEK, week.end, BERLIN)
    assert last == week and after.label == "2026W14@Europe/Berlin"
    assert after.start == week.end


def test_week_across_fall_back_and_iso_year_edges() -> None:
    # 2026-10-25 Berlin back to CET: that week is an hour long.
    week = bucket_for(Window.WEEK, utc(2026, 10, 24), BERLIN)
    assert (week.start, week.end) == (utc(2026, 10, 18, 22), utc(2026, 10, 25, 23))
    # New York, 2026-11-01 back to EST.
    ny = bucket_for(Window.WEEK, utc(2026, 11, 1, 12), NEW_YORK)
    assert (ny.start, ny.end) == (utc(2026, 10, 26, 4), utc(2026, 11, 2, 5))
    # ISO weeks: 2027-01-01 (Friday) is in week 53 of 2026; 2024-12-30 in week 1 of 2025.
    assert bucket_for(Window.WEEK, utc(2027, 1, 1, 12)).label == "2026W53"
    assert bucket_for(Window.WEEK, utc(2024, 12, 30, 12)).label == "2025W01"


def test_billing_month_starts_on_its_day_in_local_time() -> None:
    # Billing day 15 in New York; DST starts 2026-03-08, so the period Feb 15 -> Mar 15
    # begins at EST midnight and ends at EDT midnight.
    period = bucket_for(Window.MONTH, utc(2026, 3, 1), NEW_YORK, anchor=15)
    assert period.label == "202602+15@America/New_York"
    assert (period.start, period.end) == (utc(2026, 2, 15, 5), utc(2026, 3, 15, 4))
    assert bucket_for(Window.MONTH, period.end - 1, NEW_YORK, anchor=15) == period
    nxt = bucket_for(Window.MONTH, period.end, NEW_YORK, anchor=15)
    assert nxt.label == "202603+15@America/New_York" and nxt.start == period.end
    assert nxt.end == utc(2026, 4, 15, 4)
    # Day 1 is the calendar month, label unchanged.
    assert bucket_for(Window.MONTH, utc(2026, 3, 1, 6), NEW_YORK, anchor=1).label == (
        "202603@America/New_York"
    )


@pytest.mark.parametrize(
    ("at", "label", "start", "end"),
    [
        # Day 31 starts on the last day of shorter months.
        ((2026, 2, 27), "202601+31", (2026, 1, 31), (2026, 2, 28)),
        ((2026, 2, 28), "202602+31", (2026, 2, 28), (2026, 3, 31)),
        ((2026, 4, 30), "202604+31", (2026, 4, 30), (2026, 5, 31)),
        ((2026, 12, 31), "202612+31", (2026, 12, 31), (2027, 1, 31)),
        # Day 29: Feb 29 in a leap year, Feb 28 otherwise.
        ((2024, 2, 29), "202402+29", (2024, 2, 29), (2024, 3, 29)),
        ((2025, 2, 28), "202502+29", (2025, 2, 28), (2025, 3, 29)),
        ((2025, 1, 5), "202412+29", (2024, 12, 29), (2025, 1, 29)),
    ],
)
def test_late_billing_days_clamp_to_month_end(
    at: tuple[int, int, int], label: str, start: tuple[int, int, int], end: tuple[int, int, int]
) -> None:
    anchor = int(label[-2:])
    period = bucket_for(Window.MONTH, utc(*at, 12), anchor=anchor)
    assert (period.label, period.start, period.end) == (label, utc(*start), utc(*end))


def test_labels_parse_back_to_their_buckets() -> None:
    for tz in (BERLIN, NEW_YORK, UTC):
        for day in range(0, 800, 3):
            now = utc(2026, 1, 1, 7) + day * 86400
            for window, anchor in ((Window.WEEK, 1), (Window.MONTH, 1), (Window.MONTH, 31)):
                b = bucket_for(window, now, tz, anchor)
                assert bucket_of(window, b.label) == b
    for bad in ("2026W54", "2026W00", "2026-W01", "202602+01", "202602+32", "202602+1"):
        window = Window.WEEK if "W" in bad else Window.MONTH
        assert bucket_of(window, bad) is None, bad
    assert bucket_of(Window.WEEK, "2026W53") is not None  # 2026 has 53 ISO weeks
    assert bucket_of(Window.WEEK, "2027W53") is None
    assert bucket_of(Window.DAY, "2026W10") is None


def test_utc_bounds_of_a_week() -> None:
    lo, hi = utc_bounds(Window.WEEK, datetime(2026, 12, 3, tzinfo=UTC))
    assert (lo.isoformat(), hi - lo) == ("2026-11-30T00:00:00+00:00", timedelta(days=7))


def test_per_value_anchors_pick_the_counter_bucket() -> None:
    lim = Limit(
        "tenant_month",
        cap=10,
        window=Window.MONTH,
        scope=Scope.TENANT,
        anchor_day=10,
        anchors={"acme": 20},
    )
    now = utc(2026, 11, 15, 12)
    acme = slot(lim, Context(tenant="acme"), now, UTC, 1, enforce=True)
    other = slot(lim, Context(tenant="initech"), now, UTC, 1, enforce=True)
    assert acme is not None and other is not None
    assert acme.key.endswith(":202610+20") and other.key.endswith(":202611+10")
    both = Limit(
        "pair",
        cap=1,
        window="month",
        scope=("user", "tenant"),
        anchors={"user=u1,tenant=acme": 3},
    )
    assert both.anchors == {"tenant=acme,user=u1": 3}  # stored in canonical order
    assert both.anchor_for(("acme", "u1")) == 3 and both.anchor_for(("acme", "u2")) == 1
    # A limit stays a frozen value: hashable, picklable (spawned workers get policies).
    assert pickle.loads(pickle.dumps(both)) == both and hash(both) == hash(copy.deepcopy(both))
    with pytest.raises(TypeError):
        both.anchors["tenant=acme,user=u9"] = 4  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"anchor_day": 0}, "Limit('m').anchor_day", 0),
        ({"anchor_day": 32}, "Limit('m').anchor_day", 32),
        ({"anchor_day": 15.0}, "Limit('m').anchor_day", 15.0),
        ({"anchor_day": True}, "Limit('m').anchor_day", True),
        ({"anchor_day": 15, "window": Window.DAY}, "Limit('m').anchor_day", 15),
        ({"anchors": {"acme": 0}}, "Limit('m').anchors.acme", 0),
        ({"anchors": {"acme": 5}, "window": Window.WEEK}, "Limit('m').anchors", {"acme": 5}),
        ({"anchors": {"acme": 5}, "scope": None}, "Limit('m').anchors", {"acme": 5}),
        (
            {"anchors": {"tenant=acme": 5}, "scope": ("tenant", "user")},
            "Limit('m').anchors",
            "tenant=acme",
        ),
    ],
)
def test_bad_billing_days_name_field_and_value(
    kwargs: dict[str, object], field: str, value: object
) -> None:
    args: dict[str, object] = {"window": Window.MONTH, "scope": Scope.TENANT, **kwargs}
    with pytest.raises(PolicyError) as exc:
        Limit("m", cap=1, **args)  # type: ignore[arg-type]
    assert exc.value.field == field and exc.value.value == value


@pytest.mark.parametrize(
    ("line", "field", "shown"),
    [
        ("anchor_day = 0", "limits[0].anchor_day", "(got 0)"),
        ("anchor_day = 32", "limits[0].anchor_day", "(got 32)"),
        ("anchor_day = 15.5", "limits[0].anchor_day", "(got 15.5)"),
        ("anchors = { acme = 40 }", "limits[0].anchors.acme", "(got 40)"),
    ],
)
def test_bad_billing_days_in_a_file_carry_the_line(line: str, field: str, shown: str) -> None:
    text = f'[[limits]]\nname = "m"\ncap = 5\nscope = "tenant"\n\nwindow = "month"\n{line}\n'
    with pytest.raises(PolicyFileError) as exc:
        loads(text, source="p.toml")
    assert exc.value.line == 7
    assert str(exc.value).startswith(f"p.toml:7: {field}: ") and str(exc.value).endswith(shown)
    week = text.replace('"month"', '"week"').replace(line, "anchor_day = 3")
    with pytest.raises(PolicyFileError, match=r"^p\.toml:7: limits\[0\]\.anchor_day: billing days"):
        loads(week, source="p.toml")


def test_policy_file_billing_days() -> None:
    policy = loads(
        'timezone = "Europe/Berlin"\n[[limits]]\nname = "m"\ncap_usd = "100"\n'
        'scope = "tenant"\nwindow = "month"\nanchor_day = 31\nanchors = { acme = 15 }\n'
        '[[limits]]\nname = "w"\ncap = 7\nwindow = "week"\n'
    )
    assert policy["m"].anchor_day == 31 and policy["m"].anchor_for(("acme",)) == 15
    assert policy["w"].window is Window.WEEK


# -- the governor, on both backends ---------------------------------------------


def next_transition(tz: ZoneInfo, after: float) -> float:
    """The first UTC offset change of ``tz`` after ``after`` (on the hour, within 13 months)."""
    t = after - after % 3600 + 3600
    before = datetime.fromtimestamp(t, tz).utcoffset()
    for _ in range(24 * 400):
        t += 3600
        if datetime.fromtimestamp(t, tz).utcoffset() != before:
            return t
    raise AssertionError(f"no DST change in {tz}")


@pytest.fixture(params=["memory", "redis"])
async def counted(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Backend, str]]:
    """A backend and a limit-name prefix unique to this test; Redis keys removed after."""
    prefix = f"wb{uuid.uuid4().hex[:10]}"
    if request.param == "memory":
        yield MemoryBackend(), prefix
        return
    url = request.getfixturevalue("redis_url")
    backend = RedisBackend.from_url(url, timeout=2.0)
    yield backend, prefix
    await backend.aclose()
    client = aioredis.Redis.from_url(url)
    keys = [k async for k in client.scan_iter(match=f"mcpbg:v1:{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def roll_over(gov: Governor, ctx: Context, clock: list[float], end: float) -> None:
    """At ``end - 1`` the limit (cap 2) refuses its third call for one second; at ``end``
    a fresh period admits."""
    clock[0] = end - 1
    assert [(await gov.check(ctx)).admitted for _ in range(3)] == [True, True, False]
    refusal = await gov.check(ctx)
    assert refusal.retry_after == 1 and refusal.resets_at is not None
    assert refusal.resets_at.timestamp() == end
    clock[0] = end
    assert (await gov.check(ctx)).admitted


async def test_weekly_limit_rolls_over_across_dst(counted: tuple[Backend, str]) -> None:
    # Future instants: Redis expires counters on its own clock.
    backend, prefix = counted
    tz = ZoneInfo("Europe/Berlin")
    change = next_transition(tz, time.time() + 86400)
    sunday = datetime.fromtimestamp(change, tz).date()
    assert sunday.weekday() == 6  # Berlin changes on Sundays
    offset = datetime.fromtimestamp(change, tz).utcoffset()
    assert offset is not None
    # Monday 00:00 after the change, in the new offset, as a UTC instant.
    monday = datetime(sunday.year, sunday.month, sunday.day, tzinfo=UTC) + timedelta(days=1)
    end = (monday - offset).timestamp()
    clock = [end - 3 * 86400]
    limit = Limit(f"{prefix}_week", cap=2, window=Window.WEEK, scope=Scope.USER)
    gov = Governor(Policy.of(limit, timezone="Europe/Berlin"), backend, clock=lambda: clock[0])
    await roll_over(gov, Context(user="u1"), clock, end)
    assert await gov.usage(limit.name, Context(user="u1")) == 1


async def test_billing_day_month_rolls_over_across_dst(counted: tuple[Backend, str]) -> None:
    backend, prefix = counted
    tz = ZoneInfo("America/New_York")
    change = next_transition(tz, time.time() + 86400)
    local = datetime.fromtimestamp(change, tz)
    # Bill on the day after the change: the period ending then began in the old offset.
    day = (local + timedelta(days=1)).day
    offset = local.utcoffset()
    assert offset is not None
    start_of_day = datetime(local.year, local.month, day, tzinfo=UTC) - offset
    end = start_of_day.timestamp()
    limit = Limit(
        f"{prefix}_month",
        cap=2,
        window=Window.MONTH,
        scope=Scope.TENANT,
        anchor_day=day,
        anchors={"acme": 1},  # acme bills by calendar month: a different counter
    )
    clock = [end - 86400]
    policy = Policy.of(limit, timezone="America/New_York")
    gov = Governor(policy, backend, clock=lambda: clock[0])
    await roll_over(gov, Context(tenant="initech"), clock, end)
    before = bucket_for(Window.MONTH, end - 1, tz, day)
    assert before.start is not None
    start_offset = datetime.fromtimestamp(before.start, tz).utcoffset()
    assert start_offset is not None and start_offset != offset  # the period spans the change
    # The calendar-month tenant was untouched by the other's three calls.
    clock[0] = end - 1
    assert (await gov.check(Context(tenant="acme"))).admitted
    assert await gov.usage(limit.name, Context(tenant="acme")) == 1


async def test_budgets_list_each_value_in_its_own_billing_period() -> None:
    """``mcpbg budgets`` without values lists per-value-anchored counters of their own
    current period, and shows weeks and billing months as people read them."""
    from mcp_budget_governor.projections.budgets import budget_report, period

    clock = [utc(2026, 11, 18, 12)]
    backend = MemoryBackend(clock=lambda: clock[0])
    month = Limit("tm", cap=10, window=Window.MONTH, scope=Scope.TENANT, anchors={"acme": 20})
    week = Limit("uw", cap=10, window=Window.WEEK, scope=Scope.USER)
    policy = Policy.of(month, week, timezone="Europe/Berlin")
    gov = Governor(policy, backend, clock=lambda: clock[0])
    for tenant in ("acme", "initech"):
        assert (await gov.check(Context(tenant=tenant, user=f"u-{tenant}"))).admitted
    report = await budget_report(policy, backend, now=clock[0])
    rows = {(r.limit.name, r.values): r for r in report.rows}
    assert set(rows) == {
        ("tm", ("acme",)),
        ("tm", ("initech",)),
        ("uw", ("u-acme",)),
        ("uw", ("u-initech",)),
    }
    acme, initech = rows[("tm", ("acme",))], rows[("tm", ("initech",))]
    assert acme.key.endswith(":202610+20@Europe/Berlin") and acme.spent == 1
    assert initech.key.endswith(":202611@Europe/Berlin") and initech.spent == 1
    assert period(Window.MONTH, acme.bucket, BERLIN) == "2026-10-20 to 2026-11-19 (Europe/Berlin)"
    assert period(Window.MONTH, initech.bucket, BERLIN) == "2026-11 (Europe/Berlin)"
    assert period(Window.WEEK, rows[("uw", ("u-acme",))].bucket, BERLIN) == (
        "2026-W47 (Europe/Berlin)"
    )
    # Once acme's period has ended, its old counter is no current row.
    clock[0] = utc(2026, 11, 20, 12)
    report = await budget_report(policy, backend, now=clock[0])
    assert ("tm", ("acme",)) not in {(r.limit.name, r.values) for r in report.rows}


def test_costs_by_iso_week(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mcpbg costs --by week``: spend per ISO week (UTC), equal to sums made without DuckDB."""
    import json
    from collections import defaultdict

    import pyarrow.parquet as pq

    from mcp_budget_governor.cli import main
    from testing.ledger_gen import write_archive

    archive = write_archive(tmp_path / "archive", 1500, seed=5, month="2026-11").directory
    table = pq.ParquetDataset(archive).read()
    data = {name: table.column(name).to_pylist() for name in ("limit", "amount", "time")}
    want: dict[str, int] = defaultdict(int)
    for limit, amount, at in zip(data["limit"], data["amount"], data["time"], strict=True):
        if limit == "spend":
            iso = at.astimezone(UTC).isocalendar()
            want[f"{iso.year}-W{iso.week:02d}"] += amount
    assert main(["costs", "--archive-dir", str(archive), "--by", "week", "--json",
                 "--limit", "spend"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    (rows,) = report.values()
    assert {r["week"]: r["usd_micros"] for r in rows} == dict(want)
    assert [r["week"] for r in rows] == sorted(want)  # in time order
    assert len(want) >= 4  # November spans five ISO weeks
