"""PriceTable: exact micros, rounding up, cache billing, validation and the builtin data."""

from __future__ import annotations

import dataclasses
from datetime import UTC, date, datetime, time
from decimal import ROUND_CEILING, Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_budget_governor import MAX_AMOUNT, InvalidInputError, UnknownModelError
from mcp_budget_governor.prices import ModelPrice, PriceTable, PriceTier
from mcp_budget_governor.prices_builtin import _convert

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
    assert all(isinstance(v, Decimal) for v in dataclasses.astuple(price)[:4])
    assert price.tiers == ()


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


# --- tiers --------------------------------------------------------------------


@pytest.fixture
def tiered() -> PriceTable:
    # 3/15 up to 200k prompt tokens, 6/22.5 above; cache reads priced in both,
    # cache writes only above (below, they are billed at the base input price).
    return PriceTable().with_price(
        "m",
        3,
        15,
        "0.3",
        tiers=[PriceTier(200_000, Decimal(6), Decimal("22.5"), Decimal("0.6"), Decimal(12))],
    )


def test_a_tier_applies_only_once_the_prompt_exceeds_its_start(tiered: PriceTable) -> None:
    price = tiered.price_of("m")
    assert price.rates_for(0) is price
    assert price.rates_for(200_000) is price
    assert price.rates_for(200_001) is price.tiers[0]
    assert cost(tiered, input_tokens=3200, output_tokens=850) == 3200 * 3 + 850 * 15
    assert cost(tiered, input_tokens=200_000, output_tokens=1000) == 600_000 + 15_000
    # Past the start, the tier's rates apply to *every* token of the call.
    assert cost(tiered, input_tokens=200_001, output_tokens=1000) == 1_200_006 + 22_500


def test_cache_tokens_count_towards_the_tier_and_use_its_rates(tiered: PriceTable) -> None:
    # 250k prompt, mostly cached: the tier is picked by the whole prompt.
    assert cost(tiered, input_tokens=250_000, cache_read_tokens=200_000) == (
        50_000 * 6 + 200_000 * Decimal("0.6")
    )
    # A missing cache price falls back to the input price of the *same* tier.
    assert cost(tiered, input_tokens=1000, cache_write_tokens=1000) == 3000
    assert cost(tiered, input_tokens=300_000, cache_write_tokens=100_000) == (
        200_000 * 6 + 100_000 * 12
    )


def test_several_tiers_pick_the_last_one_passed() -> None:
    d = Decimal
    tiers = (PriceTier(256_000, d(4), d(4)), PriceTier(32_000, d(2), d(2)))  # stored sorted
    price = ModelPrice(Decimal(1), Decimal(1), None, None, tiers)
    assert [t.start for t in price.tiers] == [32_000, 256_000]
    t = PriceTable({"m": price})
    assert [cost(t, input_tokens=n) for n in (32_000, 32_001, 256_000, 256_001)] == [
        32_000,
        64_002,
        512_000,
        1_024_004,
    ]
    # Tiers may also be cheaper: they are rates, not surcharges.
    cheaper = ModelPrice(d(2), d(2), tiers=(PriceTier(0, d(1), d(1)),))
    assert PriceTable({"m": cheaper}).cost_micros("m", input_tokens=10, output_tokens=10) == 20


def test_model_price_stays_positional_and_tiers_are_immutable() -> None:
    price = ModelPrice(3, 15, "0.3", "3.75")  # type: ignore[arg-type]
    assert price == PriceTable().with_price("m", 3, 15, "0.3", "3.75").price_of("m")
    assert price.tiers == ()
    tier = PriceTier(100, "1.5", 2)  # type: ignore[arg-type]
    assert tier.input_per_mtok == Decimal("1.5")
    assert tier.cache_read_per_mtok is None
    assert isinstance(ModelPrice(Decimal(1), Decimal(1), tiers=[tier]).tiers, tuple)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier.start = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("tiers", "field"),
    [
        ("abc", "tiers"),
        (5, "tiers"),
        ([(100, 1, 1)], "tiers"),
        ([PriceTier(100, Decimal(1), Decimal(1)), PriceTier(100, Decimal(2), Decimal(2))], "tiers"),
    ],
)
def test_bad_tiers_raise(tiers: Any, field: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        PriceTable().with_price("m", 1, 1, tiers=tiers)
    assert info.value.field == field
    with pytest.raises(InvalidInputError):
        ModelPrice(Decimal(1), Decimal(1), tiers=tiers)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((-1, 1, 1), "start"),
        ((True, 1, 1), "start"),
        ((1.5, 1, 1), "start"),
        ((0, -1, 1), "input_per_mtok"),
        ((0, 1, "x"), "output_per_mtok"),
        ((0, 1, 1, -1), "cache_read_per_mtok"),
        ((0, 1, 1, None, float("inf")), "cache_write_per_mtok"),
    ],
)
def test_bad_tier_values_raise_naming_the_field(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        PriceTier(*args)
    assert info.value.field == field


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


def test_builtin_tiers_bill_ordinary_calls_at_the_base_rate(builtin: PriceTable) -> None:
    # claude-sonnet-4-5: 3/15 up to a 200k-token prompt, 6/22.5 above.
    assert builtin.cost_micros("claude-sonnet-4-5", input_tokens=3200, output_tokens=850) == 22350
    assert builtin.cost_micros("claude-sonnet-4-5", input_tokens=200_000, output_tokens=0) == (
        600_000
    )
    assert builtin.cost_micros("claude-sonnet-4-5", input_tokens=250_000, output_tokens=0) == (
        1_500_000
    )
    # The dated id resolves to the same tiered price.
    assert builtin.price_of("claude-sonnet-4-5-20250929").tiers[0].start == 200_000


# --- cross-check against genai-prices' own calculation (bundled data only) ----------

_MIXES = [  # (input incl. cache, output, cache read, cache write)
    (0, 0, 0, 0),
    (3200, 850, 0, 0),
    (1000, 50, 800, 0),
    (40_000, 2_000, 30_000, 5_000),
    (150_000, 2_000, 100_000, 20_000),
    (250_000, 5_000, 50_000, 10_000),
    (600_000, 1_000, 0, 300_000),
]


def _sample(builtin: PriceTable) -> list[str]:
    models = builtin.models()
    tiered = [m for m in models if builtin.price_of(m).tiers]
    flat = [m for m in models if not builtin.price_of(m).tiers]
    named = [
        "claude-sonnet-4-5",
        "claude-haiku-5-5",
        "gemini-2.5-pro",
        "gpt-4o",
        "deepseek-chat",  # off-peak discount
        "gemini-4-argon",  # scheduled price change
    ]
    sample = [m for m in named if m in models]
    sample += tiered[:: max(1, len(tiered) // 25)][:25] + flat[:: max(1, len(flat) // 25)][:25]
    return list(dict.fromkeys(sample))


def _moments(info: Any, now: datetime) -> list[datetime]:
    """When to ask genai-prices: now, or for prices that change, every moment that may differ."""
    from genai_prices import types as gp

    if isinstance(info.prices, gp.ModelPrice):
        return [now]
    constraints = [entry.constraint for entry in info.prices]
    days = {now.date()} | {
        c.start_date
        for c in constraints
        if isinstance(c, gp.StartDateConstraint) and c.start_date > now.date()
    }
    times = {time(hour, minute) for hour in range(24) for minute in (0, 30)} | {
        t.replace(tzinfo=None)
        for c in constraints
        if isinstance(c, gp.TimeOfDateConstraint)
        for t in (c.start_time, c.end_time)
    }
    return [datetime.combine(day, t, UTC) for day in days for t in times]


def _genai_micros(model: str, mix: tuple[int, int, int, int], now: datetime) -> tuple[int, bool]:
    """genai-prices' price of ``mix`` in micros, rounded up; and whether it varies in time.

    The highest over the 5-minute and 1-hour cache-write prices and, for prices
    that change in time, over every moment from now on: our documented
    conservative choices.
    """
    from genai_prices import Usage
    from genai_prices.data import providers

    from mcp_budget_governor.prices_builtin import builtin_data

    # The same provider listing the builtin table priced the model from.
    provider_id = builtin_data().sources[model]
    provider = next(p for p in providers if p.id == provider_id)
    info = next(i for i in provider.models if i.id == model)
    prompt, output, read, write = mix
    tokens = {
        "input_tokens": prompt,
        "output_tokens": output,
        "cache_read_tokens": read,
        "cache_write_tokens": write,
    }
    usages = [Usage(**tokens)]
    if write:
        usages.append(Usage(**tokens, cache_write_1h_tokens=write))  # all 1-hour writes
    moments = _moments(info, now)
    usd = max(
        info.calc_price(usage, provider, genai_request_timestamp=moment).total_price
        for usage in usages
        for moment in moments
    )
    return int((usd * 1_000_000).to_integral_value(rounding=ROUND_CEILING)), len(moments) > 1


def test_costs_match_genai_prices_calc_price(builtin: PriceTable) -> None:
    now = datetime.now(UTC)
    sample = _sample(builtin)
    assert len(sample) >= 50
    assert sum(1 for m in sample if builtin.price_of(m).tiers) >= 25
    checked = 0
    mismatches = []
    for model in sample:
        starts = [tier.start for tier in builtin.price_of(model).tiers]
        # Both sides of every threshold, with cache tokens.
        edges = [(n, 100, s // 2, s // 4) for s in starts for n in (s, s + 1)]
        for mix in _MIXES + edges:
            prompt, output, read, write = mix
            ours = builtin.cost_micros(
                model,
                input_tokens=prompt,
                output_tokens=output,
                cache_read_tokens=read,
                cache_write_tokens=write,
            )
            theirs, varies = _genai_micros(model, mix, now)
            # Prices varying in time take, rate by rate, the highest of them,
            # which may exceed the highest single moment.
            if ours != theirs and not (varies and ours > theirs):
                mismatches.append((model, mix, ours, theirs))
            checked += 1
    assert not mismatches
    assert checked > 400


def test_the_public_calc_price_agrees_for_a_tiered_model(builtin: PriceTable) -> None:
    from genai_prices import Usage, calc_price

    for prompt, output in ((3200, 850), (250_000, 850)):
        result = calc_price(
            Usage(input_tokens=prompt, output_tokens=output),
            "claude-sonnet-4-5",
            provider_id="anthropic",
        )
        micros = (result.total_price * 1_000_000).to_integral_value(rounding=ROUND_CEILING)
        assert builtin.cost_micros(
            "claude-sonnet-4-5", input_tokens=prompt, output_tokens=output
        ) == int(micros)


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


def _tiered(base: str, *tiers: tuple[int, str]) -> Any:
    from genai_prices import types as gp

    return gp.TieredPrices(
        base=Decimal(base), tiers=[gp.Tier(start=s, price=Decimal(p)) for s, p in tiers]
    )


def test_tiered_prices_are_kept_as_tiers_merged_across_components() -> None:
    from genai_prices import types as gp

    price = _convert(
        _info(
            gp.ModelPrice(
                input_mtok=_tiered("3", (200_000, "6")),
                output_mtok=_tiered("15", (200_000, "22.5")),
                # Its own extra threshold, listed out of order.
                cache_read_mtok=_tiered("0.3", (200_000, "0.6"), (128_000, "0.4")),
                cache_write_mtok=Decimal("3.75"),
                cache_write_1h_mtok=_tiered("6", (200_000, "12")),
            )
        ),
        date(2026, 1, 1),
    )
    d = Decimal
    assert price == ModelPrice(
        d(3),
        d(15),
        d("0.3"),
        d(6),  # the dearer 1-hour write price
        (
            PriceTier(128_000, d(3), d(15), d("0.4"), d(6)),
            PriceTier(200_000, d(6), d("22.5"), d("0.6"), d(12)),
        ),
    )


def test_tiers_that_change_no_rate_are_dropped() -> None:
    from genai_prices import types as gp

    price = _convert(
        _info(
            gp.ModelPrice(
                input_mtok=Decimal(3),
                output_mtok=Decimal(15),
                # The 5-minute write price rises above 200k but stays below the 1-hour one.
                cache_write_mtok=_tiered("3.75", (200_000, "5")),
                cache_write_1h_mtok=Decimal(6),
            )
        ),
        date(2026, 1, 1),
    )
    assert price == ModelPrice(Decimal(3), Decimal(15), None, Decimal(6))


def test_a_missing_five_minute_write_price_counts_as_the_input_price() -> None:
    from genai_prices import types as gp

    price = _convert(
        _info(
            gp.ModelPrice(
                input_mtok=_tiered("3", (200_000, "8")),
                output_mtok=Decimal(15),
                cache_write_1h_mtok=Decimal(6),
            )
        ),
        date(2026, 1, 1),
    )
    assert price == ModelPrice(
        Decimal(3),
        Decimal(15),
        None,
        Decimal(6),
        (PriceTier(200_000, Decimal(8), Decimal(15), None, Decimal(8)),),
    )


def test_dated_tiered_prices_take_the_highest_at_every_prompt_size() -> None:
    from genai_prices import types as gp

    info = _info(
        [
            gp.ConditionalPrice(
                constraint=None,
                prices=gp.ModelPrice(
                    input_mtok=_tiered("3", (200_000, "6")), output_mtok=Decimal(15)
                ),
            ),
            gp.ConditionalPrice(
                constraint=gp.StartDateConstraint(start_date=date(2027, 1, 1)),
                prices=gp.ModelPrice(input_mtok=Decimal(4), output_mtok=Decimal(10)),
            ),
        ]
    )
    assert _convert(info, date(2026, 1, 1)) == ModelPrice(
        Decimal(4), Decimal(15), tiers=(PriceTier(200_000, Decimal(6), Decimal(15)),)
    )
    assert _convert(info, date(2027, 1, 1)) == ModelPrice(Decimal(4), Decimal(10))


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
