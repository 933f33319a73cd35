"""The one period rule of every command (``windows.parse_period`` / ``parse_range``)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.windows import Window, parse_bound, parse_period, parse_range, utc_bounds


def d(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def test_months_and_days_are_the_counters_buckets() -> None:
    assert parse_period("2026-11") == (d(2026, 11, 1), d(2026, 12, 1))
    assert parse_period("2026-12") == utc_bounds(Window.MONTH, d(2026, 12, 9))
    assert parse_period("2028-02-29") == (d(2028, 2, 29), d(2028, 3, 1))
    assert parse_period(" 2026-11\n") == parse_period("2026-11")  # blanks around are ignored
    assert parse_period("9999-11") == (d(9999, 11, 1), d(9999, 12, 1))
    assert parse_period("1970-01-01") == (d(1970, 1, 1), d(1970, 1, 2))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("2026-13", "expected a month YYYY-MM or a day YYYY-MM-DD"),
        ("2026-00", "expected a month"),
        ("2026-02-30", "expected a month"),
        ("2026-1", "expected a month"),
        ("99999-01", "expected a month"),
        ("november", "expected a month"),
        ("", "expected a month"),
        ("1969-12", "from 1970 on"),
        ("0001-01-01", "from 1970 on"),
        ("9999-12", "ends past year 9999"),
        ("9999-12-31", "ends past year 9999"),
    ],
)
def test_bad_periods_name_the_option(text: str, problem: str) -> None:
    with pytest.raises(InvalidInputError, match=f"^--since: {problem}") as err:
        parse_period(text, "--since")
    assert not isinstance(err.value.__cause__, ValueError | OverflowError)


def test_to_includes_its_day_and_a_time_is_an_instant() -> None:
    assert parse_range("2026-11-03", "2026-11-03") == (d(2026, 11, 3), d(2026, 11, 4))
    assert parse_range("2026-10", "2026-11") == (d(2026, 10, 1), d(2026, 12, 1))
    assert parse_range(None, "2026-11-30") == (None, d(2026, 12, 1))
    assert parse_range("2026-11-03T10:00Z", "2026-11-03T11:00") == (
        d(2026, 11, 3, 10),
        d(2026, 11, 3, 11),
    )
    assert parse_bound("2026-11-03T12:00+01:00", "--from", end=False) == d(2026, 11, 3, 11)
    with pytest.raises(InvalidInputError, match=r"^--to: must be after --from"):
        parse_range("2026-11-04", "2026-11-03")


@pytest.mark.parametrize(
    "text", ["yesterday", "2026-11-03T25:00", "0001-01-01T00:00+01:00", "1969-12-31T23:00Z"]
)
def test_bad_times_are_input_errors(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"^--to: "):
        parse_range(None, text)
