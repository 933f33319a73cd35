"""Money, windows and buckets: pure rules, no services."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from mcp_budget_governor import InvalidInputError, Window, format_usd, usd
from mcp_budget_governor.counters import MAX_COUNTER, fits, overflow, stays_exact
from mcp_budget_governor.money import check_amount
from mcp_budget_governor.windows import GRACE_SECONDS, SESSION_TTL_SECONDS, bucket_for, zone


def ts(*parts: int, tz: str | None = None) -> float:
    return datetime(*parts, tzinfo=zone(tz) if tz else UTC).timestamp()  # type: ignore[misc]


def test_usd_is_exact_integer_micros() -> None:
    assert usd(25) == 25_000_000
    assert usd("0.05") == usd(0.05) == usd(Decimal("0.05")) == 50_000
    assert usd(0.1) + usd(0.2) == usd(0.3)
    assert usd("0.0000001") == 1  # a fraction of a micro rounds up, never down
    assert isinstance(usd(1.5), int)
    assert format_usd(1_500_000) == "1.500000" and format_usd(-5) == "-0.000005"
    for bad in (-1, float("nan"), float("inf"), "abc", True, None, 10**12):
        with pytest.raises(InvalidInputError) as info:
            usd(bad)  # type: ignore[arg-type]
        assert info.value.field == "usd"


def test_check_amount() -> None:
    assert check_amount(5, "x") == 5
    assert check_amount(-5, "x", allow_negative=True) == -5
    for bad in (-1, 1.0, "1", True, 2**53):
        with pytest.raises(InvalidInputError):
            check_amount(bad, "x")


def test_fits_rule() -> None:
    assert fits(0, 1, 1) and not fits(1, 1, 1)
    assert fits(0, 0, 1) and not fits(1, 0, 1) and not fits(0, 0, 0)
    assert fits(10, 5, 15) and not fits(11, 5, 15)


def test_the_exact_range_rule() -> None:
    top = MAX_COUNTER
    assert stays_exact(top - 5, 0, 5, inline=True) and not stays_exact(top - 5, 0, 6, inline=True)
    assert stays_exact(0, top - 5, 5, inline=False) and not stays_exact(0, top, 1, inline=False)
    # Each part and the total: a total in range with a part outside is refused.
    assert not stays_exact(top + 1, -2, 0, inline=True)
    assert not stays_exact(top, top, 0, inline=False)
    assert stays_exact(-top, 0, 0, inline=True) and not stays_exact(-top, 0, -1, inline=True)
    err = overflow("mcpbg:v1:spend:user=a:20261129", 7)
    assert (err.limit, err.amount, err.bound) == ("spend", 7, MAX_COUNTER)
    assert "limit 'spend': charging 7" in str(err) and str(MAX_COUNTER) in str(err)


def test_utc_buckets_and_bounds() -> None:
    now = ts(2026, 11, 29, 19, 14, 37)
    assert bucket_for(Window.MINUTE, now).label == "20261129T1914"
    assert bucket_for(Window.HOUR, now).label == "20261129T19"
    day = bucket_for(Window.DAY, now)
    assert day.label == "20261129"
    assert (day.start, day.end) == (ts(2026, 11, 29), ts(2026, 11, 30))
    month = bucket_for(Window.MONTH, ts(2026, 12, 31, 23, 59, 59))
    assert month.label == "202612" and month.end == ts(2027, 1, 1)
    assert day.expire_at(now) == int(ts(2026, 11, 30)) + GRACE_SECONDS
    assert day.seconds_left(now) == int(ts(2026, 11, 30) - now) == 17_123
    assert (
        bucket_for(Window.MINUTE, ts(2026, 1, 1, 0, 0, 59)).seconds_left(
            ts(2026, 1, 1, 0, 0, 59) + 0.5
        )
        == 1
    )
    session = bucket_for(Window.SESSION, now)
    assert session.end is None and session.seconds_left(now) is None
    assert session.expire_at(now) == int(now) + SESSION_TTL_SECONDS


def test_time_zone_buckets() -> None:
    tz = zone("America/New_York")
    # 03:00 UTC on Nov 29 is still Nov 28 in New York.
    now = ts(2026, 11, 29, 3, 0)
    day = bucket_for(Window.DAY, now, tz)
    assert day.label == "20261128@America/New_York"
    assert day.end == ts(2026, 11, 29, tz="America/New_York")
    # DST: the local day of the spring change lasts 23 hours.
    spring = bucket_for(Window.DAY, ts(2026, 3, 8, 12, tz="America/New_York"), tz)
    assert spring.end is not None and spring.start is not None
    assert spring.end - spring.start == 23 * 3600
    assert bucket_for(Window.MONTH, now, tz).label == "202611@America/New_York"
    # MINUTE and HOUR stay UTC whatever the zone.
    assert bucket_for(Window.HOUR, now, tz).label == "20261129T03"
    assert zone(None) is UTC and zone("UTC") is UTC
