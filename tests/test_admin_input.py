"""Numbers, dates and names people type into the CLI and the admin API: one shape,
one line of error naming the field (``numbers.py``, ``admin.py``)."""

from __future__ import annotations

from datetime import date, datetime, time
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest

from mcp_budget_governor.admin import parse_until
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.money import MAX_AMOUNT, usd
from mcp_budget_governor.numbers import dollars, whole
from mcp_budget_governor.policy_file import loads

ZONE = "Pacific/Auckland"  # far from UTC: a date read in UTC is 13 hours off
POLICY = loads(f'timezone = "{ZONE}"\n[[limits]]\nname = "a"\ncap = 1\nwindow = "day"\n')


@pytest.mark.parametrize(
    "text",
    ["\u00b2", "\u0661\u0662", "1_000", " 5", "5 ", "+5", "-5", "5.0", "", "0x10", "1e3", "\uff15"],
)
def test_a_whole_number_is_ascii_digits_only(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"^cap: expected a whole number of ASCII digits"):
        whole(text, "cap")


def test_a_whole_number_is_in_its_range() -> None:
    assert whole("0", "cap") == 0 and whole(str(MAX_AMOUNT), "cap") == MAX_AMOUNT
    with pytest.raises(InvalidInputError, match="from 0 to"):
        whole(str(MAX_AMOUNT + 1), "cap")
    with pytest.raises(InvalidInputError, match="from 1 to 9"):
        whole("0", "n", least=1, most=9)
    with pytest.raises(InvalidInputError, match="ASCII digits"):
        whole("9" * 31, "cap")  # too long to be worth converting


@pytest.mark.parametrize(
    ("text", "micros"),
    [("5", 5_000_000), ("5.25", 5_250_000), ("0.000001", 1), ("9007199254.740991", MAX_AMOUNT)],
)
def test_dollars_are_exact_micros(text: str, micros: int) -> None:
    assert dollars(text, "cap_usd") == micros


@pytest.mark.parametrize(
    "text",
    ["1E+999999999999999999", "1e3", "\u0661.\u0665", "1_000", " 5", "5.", ".5", "5.0000001",
     "-1", "NaN", "Infinity", "9007199254.740992"],
)  # fmt: skip
def test_anything_else_is_one_line_naming_the_field(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"^cap_usd: ") as err:
        dollars(text, "cap_usd")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["1E+999999999999999999", "1e17", Decimal("1E+999999")])
def test_usd_refuses_an_overflowing_figure_as_bad_input(text: str | Decimal) -> None:
    """Decimal arithmetic on it once raised ``decimal.Overflow`` (a 500 at the API)."""
    with pytest.raises(InvalidInputError, match=r"^usd: exceeds the largest amount"):
        usd(text)


@pytest.mark.parametrize("text", ["\u0661\u0662", "1_000", "\u00b2"])
def test_usd_reads_ascii_digits_only(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"^usd: not a number"):
        usd(text)


def test_every_until_date_form_is_read_in_the_policys_zone() -> None:
    start = datetime.combine(date(2030, 1, 1), time(), tzinfo=ZoneInfo(ZONE))
    assert parse_until(POLICY, "2030-01-01") == start
    assert parse_until(POLICY, "20300101") == start
    # ISO week 1 of 2030 starts on Monday 2029-12-31.
    monday = datetime.combine(date(2029, 12, 31), time(), tzinfo=ZoneInfo(ZONE))
    assert parse_until(POLICY, "2030-W01") == parse_until(POLICY, "2030W011") == monday
    # A time names its zone, or is UTC.
    assert parse_until(POLICY, "2030-01-01T00:00:00+00:00") == datetime.fromisoformat(
        "2030-01-01T00:00:00+00:00"
    )
    with pytest.raises(InvalidInputError, match=r"^--until: expected an ISO date or time"):
        parse_until(POLICY, "\u0662\u0660\u0663\u0660-01-01")


@pytest.mark.parametrize(
    "argv",
    [
        ["costs", "--top", "\u0661\u0662"],
        ["sql", "SELECT 1", "--max-rows", "\u00b2"],
        ["reconcile", "--older-than", "1_000"],
        ["budgets", "--max-keys", " 5"],
    ],
)
def test_the_cli_reads_counts_as_ascii_digits(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``type=int`` took ``"١٢"`` for 12 and ``"1_000"`` for 1000."""
    from mcp_budget_governor.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"argument {argv[-2]}: expected a whole number of ASCII digits" in err
