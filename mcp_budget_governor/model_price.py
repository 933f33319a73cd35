"""One model's prices, the rows of a price table: below both the table (prices) and
the bundled genai-prices data it is read from (prices_builtin)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Context, Decimal, localcontext
from itertools import pairwise
from typing import Any, TypeAlias

from .errors import InvalidInputError
from .money import MAX_AMOUNT, MICROS_PER_USD, check_amount, to_decimal, usd

__all__ = ["MicroPrice", "ModelPrice", "PriceInput", "PriceTier"]

PriceInput: TypeAlias = int | float | str | Decimal
"""What a price argument may be; floats are read through their shortest repr."""

_REQUIRED = ("input_per_mtok", "output_per_mtok")
_OPTIONAL = ("cache_read_per_mtok", "cache_write_per_mtok")


def check_price(value: Any, field: str) -> Decimal:
    price = to_decimal(value, field)
    if price < 0:
        raise InvalidInputError(field, value, "must not be negative")
    if price > MAX_AMOUNT:
        # One token would already cost more than the largest amount.
        raise InvalidInputError(field, value, f"exceeds the largest amount ({MAX_AMOUNT})")
    return price


def check_model(model: Any, field: str = "model") -> str:
    if not isinstance(model, str) or not model.strip():
        raise InvalidInputError(field, model, "expected a non-empty model name")
    return model


def check_prices(obj: ModelPrice | PriceTier) -> None:
    for name in _REQUIRED + _OPTIONAL:
        value = getattr(obj, name)
        if value is None and name in _OPTIONAL:
            continue
        # Frozen dataclass: normalise in place once, at construction.
        object.__setattr__(obj, name, check_price(value, name))


@dataclass(frozen=True, slots=True)
class PriceTier:
    """Rates that replace a model's base rates once the prompt exceeds ``start`` tokens.

    ``start`` is a token count (the prompt size, cache tokens included); the
    rates follow :class:`ModelPrice`'s rules, and a cache price of ``None``
    bills those tokens at this tier's input price.
    """

    start: int
    input_per_mtok: Decimal
    output_per_mtok: Decimal
    cache_read_per_mtok: Decimal | None = None
    cache_write_per_mtok: Decimal | None = None

    def __post_init__(self) -> None:
        check_amount(self.start, "start")
        check_prices(self)


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """Prices of one model in USD per million tokens.

    A cache price of ``None`` means "bill those tokens at the input price".
    Arguments may be ``int``, ``float``, ``str`` or ``Decimal``; they are stored
    as ``Decimal`` and must be finite and non-negative. The four rates are the
    base rates; ``tiers`` (stored sorted by ``start``, starts distinct) replace
    them for larger prompts, see :meth:`rates_for`.
    """

    input_per_mtok: Decimal
    output_per_mtok: Decimal
    cache_read_per_mtok: Decimal | None = None
    cache_write_per_mtok: Decimal | None = None
    tiers: tuple[PriceTier, ...] = ()

    def __post_init__(self) -> None:
        check_prices(self)
        object.__setattr__(self, "tiers", check_tiers(self.tiers))

    @classmethod
    def from_dollars(cls, input_per_mtok: PriceInput, output_per_mtok: PriceInput) -> MicroPrice:
        """mcp-budget-governor 0.1.0's constructor, and its result: the price in integer
        USD micros per million tokens (:class:`MicroPrice`), which a :class:`PriceTable`
        takes as the ``ModelPrice(input, output)`` it stands for.

        >>> ModelPrice.from_dollars(5, 25).input_per_mtok
        5000000
        """
        return MicroPrice(usd(input_per_mtok), usd(output_per_mtok))

    def rates_for(self, prompt_tokens: int) -> ModelPrice | PriceTier:
        """The rates billed when the prompt (cache tokens included) has ``prompt_tokens`` tokens.

        That is the last tier whose ``start`` the prompt exceeds, else these base
        rates; the rates apply to every token of the call.
        """
        for tier in reversed(self.tiers):
            if prompt_tokens > tier.start:
                return tier
        return self


@dataclass(frozen=True, slots=True)
class MicroPrice:
    """A model's input and output prices as mcp-budget-governor 0.1.0 held them:
    integer USD micros per million tokens (``MicroPrice(5_000_000, 25_000_000)``
    is $5 and $25). Code written for it reads them as it did; a price table holds
    the :class:`ModelPrice` it stands for (:meth:`model_price`).
    """

    input_per_mtok: int
    output_per_mtok: int

    def __post_init__(self) -> None:
        for name in _REQUIRED:
            check_amount(getattr(self, name), name)

    def model_price(self) -> ModelPrice:
        """The same price in dollars per million tokens, exactly."""
        with localcontext(Context(prec=40)):  # any amount's digits: the quotient is exact
            return ModelPrice(
                Decimal(self.input_per_mtok) / MICROS_PER_USD,
                Decimal(self.output_per_mtok) / MICROS_PER_USD,
            )


def check_tiers(tiers: Any) -> tuple[PriceTier, ...]:
    """``tiers`` as a tuple sorted by start; raises unless PriceTiers with distinct starts."""
    if isinstance(tiers, str | bytes) or not isinstance(tiers, Iterable):
        raise InvalidInputError("tiers", tiers, "expected an iterable of PriceTier")
    ordered: list[PriceTier] = []
    for tier in tiers:
        if not isinstance(tier, PriceTier):
            raise InvalidInputError("tiers", tier, "expected a PriceTier")
        ordered.append(tier)
    ordered.sort(key=lambda tier: tier.start)
    for below, above in pairwise(ordered):
        if below.start == above.start:
            raise InvalidInputError("tiers", tiers, f"two tiers start at {above.start}")
    return tuple(ordered)
