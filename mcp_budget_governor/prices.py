"""Model prices and the cost of a model call, in integer USD micros.

Pricing rules:

- ``input_tokens`` is the whole prompt and *includes* ``cache_read_tokens`` and
  ``cache_write_tokens`` (the genai-prices convention, and OpenAI's). Uncached
  input is ``input_tokens - cache_read_tokens - cache_write_tokens``, so every
  token is billed exactly once; cache tokens exceeding the prompt are an error.
  Anthropic's API reports ``input_tokens`` *without* the cache tokens: such
  callers pass ``input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens``.
- Tiered prices (dearer above a context size) follow genai-prices exactly: the
  prompt size ``input_tokens`` (cache tokens included) picks the last tier whose
  ``start`` it *exceeds*, and that tier's rates then apply to every token of the
  call (input, output and cache alike), not just to the tokens past ``start``.
  Below every tier, the base rates apply.
- A cache price of ``None`` bills those tokens at the input price (of the same
  tier): an over-report beats a silent under-report.
- A price in USD per million tokens times a token count is micro-USD exactly,
  so the cost is ``sum(tokens * price)`` in exact Decimal arithmetic, rounded
  up once to a whole micro. It never under-reports and is at most one micro
  high; it must not exceed ``MAX_AMOUNT``.

``PriceTable.builtin()`` reads the data bundled with the ``genai-prices``
package; :mod:`mcp_budget_governor.prices_builtin` says how that data is read
and where it is simplified (always on the expensive side). Importing this
module imports no I/O library: genai-prices (whose package imports an HTTP
client for its updater) is loaded on the first ``builtin()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from decimal import MAX_EMAX, MIN_EMIN, ROUND_CEILING, Context, Decimal
from typing import TYPE_CHECKING, Any

from .errors import InvalidInputError, UnknownModelError
from .model_price import MicroPrice as MicroPrice
from .model_price import ModelPrice as ModelPrice
from .model_price import PriceInput as PriceInput
from .model_price import PriceTier as PriceTier
from .model_price import check_model, check_price, check_tiers
from .money import check_amount

if TYPE_CHECKING:
    BUILTIN_AS_OF: str  # module __getattr__ below

__all__ = ["BUILTIN_AS_OF", "MicroPrice", "ModelPrice", "PriceTable", "PriceTier"]

# 64 digits hold any cost up to MAX_AMOUNT tokens at a MAX_AMOUNT price with 30
# fractional digits to spare, so real prices are exact; a price with more digits
# than that is rounded up (ROUND_CEILING), which can only over-report.
_COST_PRECISION = 64


class PriceTable:
    """An immutable map from model name to :class:`ModelPrice`.

    >>> table = PriceTable().with_price("my-model", 3, 15)
    >>> table.cost_micros("my-model", input_tokens=3200, output_tokens=850)
    22350

    Lookup tries the exact name, then the name ignoring case. Tables from
    :meth:`builtin` (and tables derived from them) also resolve dated ids and
    aliases with genai-prices' own model matching, and accept a known provider
    prefix (``"anthropic:claude-sonnet-4-5"``, ``"openai/gpt-4o"``).
    """

    __slots__ = ("_builtin", "_folded", "_prices", "_version")

    def __init__(
        self,
        prices: Mapping[str, ModelPrice | MicroPrice] | None = None,
        *,
        version: str = "custom",
    ) -> None:
        """Build a table from ``{model: ModelPrice}`` (or the :class:`MicroPrice` of
        mcp-budget-governor 0.1.0); ``version`` is recorded with each cost."""
        if not isinstance(version, str) or not version:
            raise InvalidInputError("version", version, "expected a non-empty string")
        table: dict[str, ModelPrice] = {}
        for model, price in (prices or {}).items():
            check_model(model)
            if isinstance(price, MicroPrice):
                price = price.model_price()
            if not isinstance(price, ModelPrice):
                raise InvalidInputError(f"prices[{model!r}]", price, "expected a ModelPrice")
            table[model] = price
        self._init(table, version, builtin=False)

    def _init(self, prices: dict[str, ModelPrice], version: str, *, builtin: bool) -> None:
        self._prices = prices
        self._version = version
        self._builtin = builtin
        self._folded: dict[str, str] = {}
        for model in prices:
            # First listed wins when two ids differ only by case: deterministic.
            self._folded.setdefault(model.lower(), model)

    @classmethod
    def _make(cls, prices: dict[str, ModelPrice], version: str, *, builtin: bool) -> PriceTable:
        table = cls.__new__(cls)
        table._init(prices, version, builtin=builtin)
        return table

    @classmethod
    def builtin(cls) -> PriceTable:
        """The prices bundled with the installed ``genai-prices`` package.

        Parsed once per process (the table is immutable, so it is shared); see
        :mod:`mcp_budget_governor.prices_builtin` for how genai-prices data is simplified.
        """
        return _builtin_table()

    @property
    def version(self) -> str:
        """Where the prices come from, e.g. ``"custom"`` or ``"genai-prices 0.2.3"``."""
        return self._version

    @property
    def as_of(self) -> str | None:
        """For a builtin table (and tables derived from it), the UTC date (ISO) whose
        prices it holds: :data:`BUILTIN_AS_OF`. None for a table built by hand."""
        if not self._builtin:
            return None
        from .prices_builtin import builtin_data

        return builtin_data().as_of

    def with_price(
        self,
        model: str,
        input_per_mtok: PriceInput,
        output_per_mtok: PriceInput,
        cache_read_per_mtok: PriceInput | None = None,
        cache_write_per_mtok: PriceInput | None = None,
        *,
        tiers: Iterable[PriceTier] = (),
    ) -> PriceTable:
        """Return a new table with ``model`` priced as given (USD per million tokens).

        ``tiers`` optionally gives the rates for larger prompts (see
        :class:`PriceTier`). This table is left unchanged. On a builtin table
        the version gains ``"+overrides"`` so recorded costs show that the
        prices were edited.
        """
        check_model(model)
        price = ModelPrice(
            check_price(input_per_mtok, "input_per_mtok"),
            check_price(output_per_mtok, "output_per_mtok"),
            None
            if cache_read_per_mtok is None
            else check_price(cache_read_per_mtok, "cache_read_per_mtok"),
            None
            if cache_write_per_mtok is None
            else check_price(cache_write_per_mtok, "cache_write_per_mtok"),
            check_tiers(tiers),
        )
        prices = dict(self._prices)
        prices[model] = price
        version = self._version
        if self._builtin and not version.endswith("+overrides"):
            version += "+overrides"
        return PriceTable._make(prices, version, builtin=self._builtin)

    def _key_for(self, model: str) -> str | None:
        if model in self._prices:
            return model
        if (key := self._folded.get(model.lower())) is not None:
            return key
        if self._builtin:
            from .prices_builtin import builtin_candidates

            for name in builtin_candidates(model):
                if name in self._prices:
                    return name
                if (key := self._folded.get(name.lower())) is not None:
                    return key
        return None

    def price_of(self, model: str) -> ModelPrice:
        """The price of ``model``; raises :class:`UnknownModelError` when it has none."""
        check_model(model)
        key = self._key_for(model)
        if key is None:
            dated = None if self.as_of is None else f"{self._version} prices as of {self.as_of}"
            raise UnknownModelError(model, known=len(self), dated=dated)
        return self._prices[key]

    # -- the spellings of mcp-budget-governor 0.1.0 --------------------------

    @classmethod
    def of(cls, **models: tuple[PriceInput, PriceInput]) -> PriceTable:
        """A table from ``model=(input, output)`` USD per million tokens.

        >>> PriceTable.of(demo=(5, 25)).cost("demo", output_tokens=1_000)
        25000
        """
        return cls({name: ModelPrice(i, o) for name, (i, o) in models.items()})  # type: ignore[arg-type]

    def cost(self, model: str, *, input_tokens: int = 0, output_tokens: int = 0) -> int:
        """:meth:`cost_micros` with every count defaulting to zero."""
        return self.cost_micros(model, input_tokens=input_tokens, output_tokens=output_tokens)

    def price_for(self, model: str) -> ModelPrice:
        """:meth:`price_of`, as mcp-budget-governor 0.1.0 named it."""
        return self.price_of(model)

    @property
    def prices(self) -> dict[str, ModelPrice]:
        """Every model's price, by model id (a copy)."""
        return dict(self._prices)

    def cost_micros(
        self,
        model: str,
        *,
        input_tokens: int,
        output_tokens: int,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
    ) -> int:
        """Cost of one call in USD micros, rounded up; ``input_tokens`` includes cache tokens.

        ``input_tokens`` also picks the price tier, if the model has tiers.
        """
        prompt = check_amount(input_tokens, "input_tokens")
        output = check_amount(output_tokens, "output_tokens")
        cache_read = check_amount(cache_read_tokens, "cache_read_tokens")
        cache_write = check_amount(cache_write_tokens, "cache_write_tokens")
        if cache_read + cache_write > prompt:
            raise InvalidInputError(
                "cache_read_tokens + cache_write_tokens",
                cache_read + cache_write,
                f"{cache_read} + {cache_write} exceeds input_tokens ({prompt}), "
                "which must include the cache tokens",
            )
        rates = self.price_of(model).rates_for(prompt)
        terms = (
            (prompt - cache_read - cache_write, rates.input_per_mtok),
            (output, rates.output_per_mtok),
            (cache_read, _or(rates.cache_read_per_mtok, rates.input_per_mtok)),
            (cache_write, _or(rates.cache_write_per_mtok, rates.input_per_mtok)),
        )
        # A fresh context per call: contexts carry mutable flags.
        ctx = Context(prec=_COST_PRECISION, rounding=ROUND_CEILING, Emin=MIN_EMIN, Emax=MAX_EMAX)
        total = Decimal(0)
        for tokens, per_mtok in terms:
            total = ctx.fma(Decimal(tokens), per_mtok, total)
        micros = int(total.to_integral_value(rounding=ROUND_CEILING, context=ctx))
        return check_amount(micros, "cost_micros")

    def __contains__(self, model: object) -> bool:
        """Whether :meth:`price_of` would find a price for ``model``."""
        if not isinstance(model, str) or not model.strip():
            return False
        return self._key_for(model) is not None

    def __len__(self) -> int:
        """Number of model ids priced (aliases and prefixed names not counted)."""
        return len(self._prices)

    def models(self) -> list[str]:
        """The priced model ids, sorted."""
        return sorted(self._prices)

    def __repr__(self) -> str:
        return f"PriceTable(version={self._version!r}, models={len(self)})"


def _or(value: Decimal | None, default: Decimal) -> Decimal:
    return default if value is None else value


def __getattr__(name: str) -> Any:
    # BUILTIN_AS_OF: the date PriceTable.builtin() takes its prices for (in force
    # that day, plus rises already scheduled), e.g. "2026-12-01". Computed with the
    # table on first use, so importing this module still loads no genai-prices.
    if name == "BUILTIN_AS_OF":
        from .prices_builtin import builtin_data

        return builtin_data().as_of
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _builtin_table() -> PriceTable:
    from .prices_builtin import builtin_data

    data = builtin_data()
    return PriceTable._make(dict(data.prices), data.version, builtin=True)
