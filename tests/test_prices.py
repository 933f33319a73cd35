"""PriceTable: exact micros, rounding up, cache billing, validation and the builtin data."""

from __future__ import annotations

import dataclasses
from datetime import date
from decimal import ROUND_CEILING, Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_budget_governor import MAX_AMOUNT, InvalidInputError, UnknownModelError
from mcp_budget_governor.prices import ModelPrice, PriceTable, _convert

TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


@pytest.fixture
def table() -> PriceTable:
    return PriceTable().with_price(
        "m", 3, 15, cache_read_per_mtok="0.3", cache_write_per_mtok="3.75"
    )


def cost(table: PriceTable, **tokens: Any) -> int:
    return table.cost_micros("m", **{"input_tokens": 0, "output_tokens": 0, **tokens})


# --- construction -------------------------------------------------------------


def test_with_price_returns_a_new_table_and_leaves_the_old_one_alone() -> None:
    empty = PriceTable()
    one = empty.with_price("m", 3, 15)
    two = one.with_price("m", 4, 16)
    assert "m" not in empty
    assert len(empty) == 0
    assert one.price_of("m") == ModelPrice(Decimal(3), Decimal(15))
    assert two.price_of("m") == ModelPrice(Decimal(4), Decimal(16))
    assert one.version == two.version == "custom"
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.price_of("m").input_per_mtok = Decimal(0)  # type: ignore[misc]


def test_prices_accept_int_float_str_decimal_exactly() -> None:
    price = PriceTable().with_price("m", 1, 0.1, "0.30", Decimal("2.5")).price_of("m")
    assert price == ModelPrice(Decimal(1), Decimal("0.1"), Decimal("0.3"), Decimal("2.5"))
    assert all(isinstance(v, Decimal) for v in dataclasses.astuple(price))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((-1, 15), "input_per_mtok"),
        ((3, "-0.01"), "output_per_mtok"),
        ((3, 15, -1), "cache_read_per_mtok"),
        ((3, 15, None, -1), "cache_write_per_mtok"),
        ((True, 15), "input_per_mtok"),
        ((3, "abc"), "output_per_mtok"),
        ((float("nan"), 15), "input_per_mtok"),
        ((MAX_AMOUNT + 1, 15), "input_per_mtok"),
    ],
)
def test_bad_prices_raise_naming_the_field(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        PriceTable().with_price("m", *args)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("model", ["", "   ", None, 3])
def test_bad_model_names_raise(model: Any) -> None:
    with pytest.raises(InvalidInputError) as info:
        PriceTable().with_price(model, 3, 15)
    assert info.value.field == "model"


def test_constructor_takes_a_mapping_and_a_version() -> None:
    t = PriceTable(
        {"b": ModelPrice(Decimal(1), Decimal(2)), "a": ModelPrice(Decimal(3), Decimal(4))}
    )
    assert t.models() == ["a", "b"]
    assert len(t) == 2
    assert t.version == "custom"
    assert PriceTable(version="mine 1").version == "mine 1"
    with pytest.raises(InvalidInputError):
        PriceTable({"a": (1, 2)})  # type: ignore[dict-item]


# --- cost -----------------------------------------------------------------------


def test_exact_micros_for_a_hand_computed_call(table: PriceTable) -> None:
    assert cost(table, input_tokens=3200, output_tokens=850) == 3200 * 3 + 850 * 15 == 22350


def test_a_fraction_of_a_micro_rounds_up_once() -> None:
    t = PriceTable().with_price("m", "0.3", "0.3")
    assert t.cost_micros("m", input_tokens=1, output_tokens=0) == 1
    assert t.cost_micros("m", input_tokens=10, output_tokens=0) == 3
    # Rounded once in total, not per component: 0.3 + 0.3 -> 1, not 2.
    assert t.cost_micros("m", input_tokens=1, output_tokens=1) == 1
    assert t.cost_micros("m", input_tokens=0, output_tokens=0) == 0


def test_cache_reads_are_billed_at_the_cache_price_and_not_also_as_input(
    table: PriceTable,
) -> None:
    # 1000-token prompt of which 800 are cache reads: 200 * 3 + 800 * 0.3.
    assert cost(table, input_tokens=1000, cache_read_tokens=800) == 600 + 240
    # Cache writes likewise: 200 * 3 + 800 * 3.75.
    assert cost(table, input_tokens=1000, cache_write_tokens=800) == 600 + 3000
    assert cost(table, input_tokens=1000, cache_read_tokens=500, cache_write_tokens=500) == (
        500 * Decimal("0.3") + 500 * Decimal("3.75")
    )


def test_a_missing_cache_price_bills_at_the_input_price() -> None:
    t = PriceTable().with_price("m", 3, 15)
    assert t.cost_micros("m", input_tokens=1000, output_tokens=0, cache_read_tokens=800) == 3000
    assert t.cost_micros("m", input_tokens=1000, output_tokens=0, cache_write_tokens=800) == 3000


def test_cache_tokens_beyond_the_prompt_raise(table: PriceTable) -> None:
    with pytest.raises(InvalidInputError) as info:
        cost(table, input_tokens=100, cache_read_tokens=80, cache_write_tokens=40)
    assert info.value.field == "cache_read_tokens + cache_write_tokens"
    message = str(info.value)
    assert message.startswith("cache_read_tokens + cache_write_tokens:")
    assert "80 + 40" in message
    assert "100" in message


@pytest.mark.parametrize("field", TOKEN_FIELDS)
@pytest.mark.parametrize("bad", [-1, True, 1.0, "5", None, MAX_AMOUNT + 1])
def test_bad_token_counts_raise_naming_the_field(table: PriceTable, field: str, bad: Any) -> None:
    with pytest.raises(InvalidInputError) as info:
        cost(table, **{"input_tokens": 10, field: bad})
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_a_cost_above_the_largest_amount_raises() -> None:
    t = PriceTable().with_price("m", MAX_AMOUNT, 0)
    assert t.cost_micros("m", input_tokens=1, output_tokens=0) == MAX_AMOUNT
    with pytest.raises(InvalidInputError) as info:
        t.cost_micros("m", input_tokens=2, output_tokens=0)
    assert info.value.field == "cost_micros"


# --- lookup -------------------------------------------------------------------


def test_unknown_model_raises_naming_it(table: PriceTable) -> None:
    with pytest.raises(UnknownModelError) as info:
        table.price_of("no-such-model")
    assert info.value.model == "no-such-model"
    assert "no-such-model" in str(info.value)
    assert "1 models known" in str(info.value)
    with pytest.raises(UnknownModelError, match="no-such-model"):
        table.cost_micros("no-such-model", input_tokens=1, output_tokens=1)
    with pytest.raises(UnknownModelError, match="table is empty"):
        PriceTable().price_of("x")


def test_lookup_is_exact_first_then_case_insensitive() -> None:
    t = PriceTable().with_price("My-Model", 1, 1).with_price("my-model", 2, 2)
    assert t.price_of("My-Model").input_per_mtok == 1
    assert t.price_of("my-model").input_per_mtok == 2
    assert t.price_of("MY-MODEL").input_per_mtok == 1  # first added wins among case twins
    assert "MY-MODEL" in t
    assert 3 not in t
    assert "" not in t
    # Custom tables do not strip provider prefixes.
    assert "openai:my-model" not in t


# --- builtin ------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin() -> PriceTable:
    return PriceTable.builtin()


def test_builtin_is_versioned_shared_and_sizeable(builtin: PriceTable) -> None:
    assert builtin.version.startswith("genai-prices ")
    assert PriceTable.builtin() is builtin
    assert len(builtin) > 500
    assert builtin.models() == sorted(builtin.models())


@pytest.mark.parametrize(
    "model",
    [
        "claude-opus-4-1",
        "claude-sonnet-4-5",
        "claude-sonnet-4-5-20250929",  # dated id, via genai-prices' matcher
        "claude-3-5-haiku-latest",
        "gpt-4o",
        "gpt-4o-2024-08-06",  # documented alias
        "gpt-4o-mini",
        "gpt-4.1",
        "gemini-2.5-pro",
        "gemini-2.5-flash",
        "GPT-4O",
        "anthropic:claude-sonnet-4-5",
        "openai/gpt-4.1",
        "google-gla:gemini-2.5-flash",
    ],
)
def test_builtin_prices_well_known_models(builtin: PriceTable, model: str) -> None:
    assert model in builtin
    price = builtin.price_of(model)
    assert price.input_per_mtok > 0
    assert price.output_per_mtok > price.input_per_mtok
    assert builtin.cost_micros(model, input_tokens=1000, output_tokens=100) > 0


def test_builtin_prefers_the_vendor_and_resolves_prefixes_to_the_same_price(
    builtin: PriceTable,
) -> None:
    assert builtin.price_of("openai:gpt-4o") == builtin.price_of("gpt-4o")
    assert builtin.price_of("anthropic/claude-opus-4-1") == builtin.price_of("claude-opus-4-1")
    # gpt-4o is also listed by resellers; the vendor (OpenAI) list price is used.
    assert builtin.price_of("gpt-4o").input_per_mtok == Decimal("2.5")


def test_builtin_leaves_out_what_it_cannot_price(builtin: PriceTable) -> None:
    for model in ("text-embedding-3-small", "whisper-1", "not-a-model", "claude-not-a-model"):
        assert model not in builtin
        with pytest.raises(UnknownModelError):
            builtin.price_of(model)


def test_with_price_on_builtin_overrides_and_marks_the_version(builtin: PriceTable) -> None:
    edited = builtin.with_price("gpt-4o", 1, 2).with_price("in-house", 1, 1)
    assert edited.version == builtin.version + "+overrides"
    assert edited.price_of("gpt-4o").input_per_mtok == 1
    assert edited.price_of("openai:gpt-4o").input_per_mtok == 1  # prefixes see overrides
    assert "in-house" in edited
    assert builtin.price_of("gpt-4o").input_per_mtok == Decimal("2.5")
    assert "in-house" not in builtin
    assert len(edited) == len(builtin) + 1


def test_genai_prices_is_not_imported_by_the_module() -> None:
    import subprocess
    import sys

    code = "import sys, mcp_budget_governor.prices; print('genai_prices' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- conversion of genai-prices data (synthetic, independent of the bundled data) ---


def _info(prices: Any) -> Any:
    from genai_prices import types as gp

    return gp.ModelInfo(id="x", match=gp.ClauseEquals(equals="x"), prices=prices)


def test_tiered_prices_use_the_highest_tier() -> None:
    from genai_prices import types as gp

    def tiered(base: str, top: str) -> gp.TieredPrices:
        return gp.TieredPrices(
            base=Decimal(base), tiers=[gp.Tier(start=200_000, price=Decimal(top))]
        )

    price = _convert(
        _info(
            gp.ModelPrice(
                input_mtok=tiered("3", "6"),
                output_mtok=tiered("15", "22.5"),
                cache_read_mtok=Decimal("0.3"),
                cache_write_mtok=Decimal("3.75"),
                cache_write_1h_mtok=tiered("6", "12"),
            )
        ),
        date(2026, 1, 1),
    )
    assert price == ModelPrice(Decimal(6), Decimal("22.5"), Decimal("0.3"), Decimal(12))


def test_dated_prices_use_the_current_and_every_later_price() -> None:
    from genai_prices import types as gp

    def at(start: date | None, inp: str, out: str) -> gp.ConditionalPrice:
        constraint = None if start is None else gp.StartDateConstraint(start_date=start)
        return gp.ConditionalPrice(
            constraint=constraint,
            prices=gp.ModelPrice(input_mtok=Decimal(inp), output_mtok=Decimal(out)),
        )

    info = _info(
        [at(None, "10", "40"), at(date(2025, 6, 1), "2", "8"), at(date(2027, 1, 1), "3", "6")]
    )
    # Before the cut: the old price is live (and the later ones may still come).
    assert _convert(info, date(2025, 1, 1)) == ModelPrice(Decimal(10), Decimal(40))
    # After the cut, before the scheduled change: highest of now and later.
    assert _convert(info, date(2026, 1, 1)) == ModelPrice(Decimal(3), Decimal(8))
    assert _convert(info, date(2027, 6, 1)) == ModelPrice(Decimal(3), Decimal(6))


def test_inexpressible_prices_are_skipped() -> None:
    from genai_prices import types as gp

    assert _convert(_info(gp.ModelPrice(input_mtok=Decimal("0.02"))), date(2026, 1, 1)) is None
    per_request = gp.ModelPrice(
        input_mtok=Decimal(1), output_mtok=Decimal(1), requests_kcount=Decimal(5)
    )
    assert _convert(_info(per_request), date(2026, 1, 1)) is None


# --- properties ---------------------------------------------------------------

prices = st.decimals(min_value=0, max_value=1000, places=6, allow_nan=False, allow_infinity=False)
counts = st.integers(min_value=0, max_value=10**9)


@given(
    price=st.tuples(prices, prices, st.none() | prices, st.none() | prices),
    tokens=st.tuples(counts, counts, counts, counts),
    field=st.sampled_from(TOKEN_FIELDS),
    extra=st.integers(min_value=1, max_value=10**6),
)
def test_cost_is_exact_rounded_up_and_monotonic(
    price: tuple[Decimal, Decimal, Decimal | None, Decimal | None],
    tokens: tuple[int, int, int, int],
    field: str,
    extra: int,
) -> None:
    t = PriceTable().with_price("m", *price)
    cache_read, cache_write = tokens[2], tokens[3]
    usage = {
        "input_tokens": tokens[0] + cache_read + cache_write,
        "output_tokens": tokens[1],
        "cache_read_tokens": cache_read,
        "cache_write_tokens": cache_write,
    }
    p_in, p_out, p_read, p_write = price
    exact = (
        tokens[0] * p_in
        + tokens[1] * p_out
        + cache_read * (p_in if p_read is None else p_read)
        + cache_write * (p_in if p_write is None else p_write)
    )
    got = t.cost_micros("m", **usage)
    assert exact <= got < exact + 1
    assert got == int(exact.to_integral_value(rounding=ROUND_CEILING))

    # More of any token kind never costs less (cache tokens are part of the prompt).
    more = dict(usage, **{field: usage[field] + extra})
    if field in ("cache_read_tokens", "cache_write_tokens"):
        more["input_tokens"] += extra
    assert t.cost_micros("m", **more) >= got
