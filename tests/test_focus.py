"""The FOCUS mapping rules (``mcp_budget_governor.focus``): pure functions, no I/O.

Each self-enforced rule has a test that a row breaking it is reported, so
removing or weakening a rule fails here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction
from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.focus import (
    FOCUS_1_2,
    METERS,
    SUBCATEGORY_PARENT,
    VERSIONS,
    Granularity,
    Meter,
    ascii_text,
    decimal_text,
    list_cost_micros,
    parse_range,
    rate_text,
    sku_id,
    sku_price_id,
    split_cost,
    tier_rates,
)
from mcp_budget_governor.focus_checks import check_columns, check_row
from mcp_budget_governor.prices import ModelPrice, PriceTier
from mcp_budget_governor.windows import parse_period

# A row as the exporter renders it (a token meter row), which obeys every rule.
GOOD: dict[str, str | None] = {
    "BilledCost": "0.009601",
    "BillingAccountId": "mcpbg",
    "BillingAccountName": "mcp-budget-governor",
    "BillingCurrency": "USD",
    "BillingPeriodEnd": "2026-12-01T00:00:00Z",
    "BillingPeriodStart": "2026-11-01T00:00:00Z",
    "ChargeCategory": "Usage",
    "ChargeClass": None,
    "ChargeDescription": "claude-sonnet-4-5 input tokens (uncached)",
    "ChargeFrequency": "Usage-Based",
    "ChargePeriodEnd": "2026-11-03T11:00:00Z",
    "ChargePeriodStart": "2026-11-03T10:00:00Z",
    "CommitmentDiscountStatus": None,
    "ConsumedQuantity": "3200.0",
    "ConsumedUnit": "Tokens",
    "ContractedCost": "0.009601",
    "EffectiveCost": "0.009601",
    "InvoiceId": None,
    "InvoiceIssuerName": "mcp-budget-governor",
    "ListCost": "0.0096",
    "ListUnitPrice": "3.0",
    "PricingCategory": "Standard",
    "PricingQuantity": "0.0032",
    "PricingUnit": "1000000 Tokens",
    "ProviderName": "mcp-budget-governor",
    "PublisherName": "mcp-budget-governor",
    "ServiceCategory": "AI and Machine Learning",
    "ServiceName": "LLM Inference",
    "ServiceSubcategory": "Generative AI",
    "SkuId": "claude-sonnet-4-5:input",
    "SkuMeter": "Input Tokens",
    "SkuPriceDetails": None,
    "SkuPriceId": "claude-sonnet-4-5:input:3.0",
    "SubAccountId": "acme",
    "SubAccountName": "acme",
    "Tags": '{"tenant":"acme","user":"u1","tool":"search"}',
    "x_UserId": "u1",
    "x_ToolName": "search",
    "x_ModelId": "claude-sonnet-4-5",
    "x_Meter": "input",
    "x_EventCount": "2",
}


def broken(**changes: str | None) -> list[str]:
    return check_row({**GOOD, **changes})


def test_the_reference_row_passes() -> None:
    assert check_row(GOOD) == []
    assert check_columns(list(GOOD)) == []
    assert list(GOOD) == list(FOCUS_1_2.names)


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("ChargeCategory", "Usage-Based"),
        ("ChargeFrequency", "Usage"),
        ("PricingCategory", "List"),
        ("ServiceCategory", "AI"),
        ("ServiceSubcategory", "LLM"),
        ("ChargeClass", "Refund"),
        ("CommitmentDiscountStatus", "Partial"),
    ],
)
def test_values_outside_the_allowed_lists_are_reported(column: str, value: str) -> None:
    problems = broken(**{column: value})
    assert any(p.startswith(f"{column}: {value!r} is not an allowed value") for p in problems)


def test_a_subcategory_under_the_wrong_parent_is_reported() -> None:
    (problem,) = broken(ServiceCategory="Compute")  # Generative AI belongs to AI and ML
    assert "belongs to 'AI and Machine Learning', not 'Compute'" in problem
    assert SUBCATEGORY_PARENT["Generative AI"] == "AI and Machine Learning"


def test_list_cost_must_be_unit_price_times_quantity_exactly() -> None:
    (problem,) = broken(ListCost="0.009601")  # billed rounding is not list cost
    assert problem.startswith("ListCost: 0.009601 is not ListUnitPrice x PricingQuantity")
    assert broken(ListCost="0.00960") == []  # same value, other spelling


def test_contracted_cost_equals_billed_cost_without_a_contracted_price() -> None:
    (problem,) = broken(ContractedCost="0.0096")
    assert problem.startswith("ContractedCost: 0.0096 must equal BilledCost")
    assert check_row({**GOOD, "ContractedCost": "0.0096", "ContractedUnitPrice": "3.0"}) == []


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"ChargePeriodEnd": "2026-11-03T10:00:00Z"}, "must be before ChargePeriodEnd"),
        ({"ChargePeriodStart": "2026-10-31T23:00:00Z"}, "within the billing period"),
        ({"ChargePeriodEnd": "2026-12-01T01:00:00Z"}, "within the billing period"),
    ],
)
def test_periods_must_be_ordered(changes: dict[str, str], expected: str) -> None:
    assert any(expected in p for p in broken(**changes))


def test_strings_must_be_printable_ascii() -> None:
    (problem,) = broken(x_UserId="müller")
    assert problem == "x_UserId: 'müller' is not printable ASCII"
    assert broken(ChargeDescription="a\nb") == ["ChargeDescription: 'a\\nb' is not printable ASCII"]


@pytest.mark.parametrize("value", ["1", "1e-3", "1,5", ".5", "1.", "0x1"])
def test_decimals_need_digits_around_a_decimal_point(value: str) -> None:
    assert f"BilledCost: {value!r} is not a decimal with a decimal point" in broken(
        BilledCost=value, ContractedCost=value, EffectiveCost=value
    )


@pytest.mark.parametrize(
    "value", ["2026-11-03 10:00:00Z", "2026-11-03T10:00:00", "2026-11-03T10:00:00+00:00"]
)
def test_times_must_be_utc_with_a_z(value: str) -> None:
    assert f"ChargePeriodStart: {value!r} is not YYYY-MM-DDTHH:MM:SSZ" in broken(
        ChargePeriodStart=value
    )


def test_integers_and_non_nullable_columns() -> None:
    assert broken(x_EventCount="2.0") == ["x_EventCount: '2.0' is not an integer"]
    assert broken(BillingCurrency=None) == ["BillingCurrency: must not be null"]
    assert broken(BillingCurrency="") == ["BillingCurrency: must not be null"]


def test_custom_columns_need_the_x_prefix_and_focus_columns_must_all_be_there() -> None:
    assert check_columns([*FOCUS_1_2.names, "UserId"]) == [
        "column 'UserId': a custom column must start with x_"
    ]
    assert check_columns([n for n in FOCUS_1_2.names if n != "BilledCost"]) == [
        "column 'BilledCost': missing"
    ]
    custom = [c.name for c in FOCUS_1_2.columns if c.name[0].islower()]
    assert custom and all(n.startswith("x_") for n in custom)


def test_versions_are_kept_by_name() -> None:
    assert VERSIONS["1.2"] is FOCUS_1_2
    assert FOCUS_1_2.column("BilledCost").nullable is False
    with pytest.raises(KeyError):
        FOCUS_1_2.column("Nope")


def test_meter_constants_obey_the_allowed_values() -> None:
    for spec in METERS.values():
        row = {
            "ServiceCategory": spec.service_category,
            "ServiceSubcategory": spec.service_subcategory,
        }
        assert check_row(row) == [], spec
    assert list(Meter)[:4] == [
        Meter.INPUT,
        Meter.OUTPUT,
        Meter.CACHE_READ,
        Meter.CACHE_WRITE,
    ]


# --- text and numbers ---------------------------------------------------------


def test_ascii_text_escapes_only_what_it_must_and_reverses() -> None:
    assert ascii_text("u_42@acme.io") == "u_42@acme.io"
    assert ascii_text("50%") == "50%25"  # so that unquoting gives the value back
    assert ascii_text("é\n") == "%C3%A9%0A"


@given(st.text())
def test_ascii_text_is_printable_ascii_and_reversible(value: str) -> None:
    text = ascii_text(value)
    assert all(0x20 <= ord(ch) < 0x7F for ch in text)
    assert unquote(text, errors="strict") == value


@given(st.integers(min_value=-(10**40), max_value=10**40), st.integers(min_value=0, max_value=30))
def test_decimal_text_is_exact(units: int, scale: int) -> None:
    text = decimal_text(units, scale)
    assert "." in text and "e" not in text.lower()
    assert Fraction(Decimal(text)) == Fraction(units, 10**scale)


def test_decimal_text_examples() -> None:
    assert decimal_text(0, 6) == "0.0"
    assert decimal_text(1_000_000, 6) == "1.0"
    assert decimal_text(-1, 6) == "-0.000001"
    assert rate_text(Decimal("0.075")) == "0.075"
    assert rate_text(Decimal("15")) == "15.0"
    assert rate_text(Decimal("1.50")) == "1.5"


def test_sku_ids_name_one_parent() -> None:
    sku = sku_id("gpt-4o", Meter.CACHE_READ)
    assert sku == "gpt-4o:cache_read"
    price = sku_price_id(sku, "1.25")
    assert price.rsplit(":", 1) == [sku, "1.25"]
    # Different meters of one model, and a tool named like a model, never share an id.
    ids = {sku_id("gpt-4o", m) for m in Meter}
    assert len(ids) == len(Meter)


# --- the cost split ------------------------------------------------------------


@given(
    st.integers(min_value=-(2**53), max_value=2**53),
    st.lists(st.integers(min_value=0, max_value=2**53), min_size=4, max_size=4),
    st.lists(st.integers(min_value=0, max_value=2**53), min_size=4, max_size=4),
)
def test_split_sums_exactly_and_stays_within_a_micro_of_proportional(
    charged: int, weights: list[int], tokens: list[int]
) -> None:
    shares = split_cost(charged, weights, tokens)
    assert sum(shares) == charged
    use = weights if sum(weights) else tokens if sum(tokens) else [1, 0, 0, 0]
    for share, weight in zip(shares, use, strict=True):
        exact = Fraction(abs(charged) * weight, sum(use))
        assert abs(abs(share) - exact) < 1
        assert share == 0 or (share > 0) == (charged > 0)


def test_split_gives_leftovers_to_the_largest_remainders_then_the_earlier_meter() -> None:
    assert split_cost(10, [3, 3, 3, 0], [1, 1, 1, 0]) == (4, 3, 3, 0)
    assert split_cost(11, [1, 2, 0, 0], [0, 0, 0, 0]) == (4, 7, 0, 0)  # 3.67 / 7.33
    assert split_cost(5, [0, 0, 0, 0], [0, 1, 0, 1]) == (0, 3, 0, 2)  # token counts
    assert split_cost(5, [0, 0, 0, 0], [0, 0, 0, 0]) == (5, 0, 0, 0)  # input takes it
    assert split_cost(-10, [3, 3, 3, 0], [1, 1, 1, 0]) == (-4, -3, -3, 0)


def test_split_of_a_priced_call_bills_each_meter_its_list_cost_rounded() -> None:
    rates = [Decimal("3"), Decimal("15"), Decimal("0.3"), Decimal("3.75")]
    tokens = [1_234, 567, 8_901, 2_345]
    exact = [Fraction(t) * Fraction(r) for t, r in zip(tokens, rates, strict=True)]
    charged = -((-sum(exact).numerator) // sum(exact).denominator)  # prices.py rounds up once
    shares = split_cost(
        charged, [list_cost_micros(t, r) for t, r in zip(tokens, rates, strict=True)], tokens
    )
    assert sum(shares) == charged
    assert all(abs(s - e) < 1 for s, e in zip(shares, exact, strict=True))


def test_split_refuses_bad_weights() -> None:
    with pytest.raises(ValueError, match="one per meter"):
        split_cost(1, [1, 2], [1])
    with pytest.raises(ValueError, match="negative"):
        split_cost(1, [-1, 2], [1, 1])


def test_tier_rates_put_the_base_first_and_fill_missing_cache_prices() -> None:
    price = ModelPrice(
        Decimal(3),
        Decimal(15),
        None,
        Decimal("3.75"),
        tiers=(PriceTier(200_000, Decimal(6), Decimal("22.5"), Decimal("0.6"), None),),
    )
    assert tier_rates(price) == [
        (-1, (Decimal(3), Decimal(15), Decimal(3), Decimal("3.75"))),
        (200_000, (Decimal(6), Decimal("22.5"), Decimal("0.6"), Decimal(6))),
    ]


# --- periods -------------------------------------------------------------------


def test_periods() -> None:
    assert parse_period("2026-11") == (
        datetime(2026, 11, 1, tzinfo=UTC),
        datetime(2026, 12, 1, tzinfo=UTC),
    )
    assert parse_period("2026-12")[1] == datetime(2027, 1, 1, tzinfo=UTC)
    for bad in ("2026-13", "2026-00", "november", "2026-1", "", "1969-12"):
        with pytest.raises(InvalidInputError, match="--period"):
            parse_period(bad)


def test_ranges_align_to_the_granularity() -> None:
    lo, hi = parse_range("2026-11-03", "2026-11-03T12:00Z", Granularity.HOUR)
    assert (lo.hour, hi.hour) == (0, 12)
    with pytest.raises(InvalidInputError, match=r"--from.*whole hour"):
        parse_range("2026-11-03T10:30", "2026-11-04", Granularity.HOUR)
    with pytest.raises(InvalidInputError, match=r"--to.*whole day"):
        parse_range("2026-11-03", "2026-11-04T10:00", Granularity.DAY)
    with pytest.raises(InvalidInputError, match=r"--to.*after --from"):
        parse_range("2026-11-04", "2026-11-03", Granularity.DAY)
    with pytest.raises(InvalidInputError, match=r"--from.*UTC date"):
        parse_range("yesterday", "2026-11-03", Granularity.DAY)
    # A time with an offset is converted to UTC first.
    assert parse_range("2026-11-03T01:00+01:00", "2026-11-04", Granularity.HOUR)[0].hour == 0
