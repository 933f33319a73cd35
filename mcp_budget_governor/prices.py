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
package (never its network updater). The data is more detailed than
``ModelPrice``; where it must be simplified, it errs on the expensive side:

- Tiers are kept exact. genai-prices tiers each price separately (its own
  thresholds), all selected by the same prompt size; they are merged into
  ``PriceTier`` rows giving every rate in force above each threshold.
- Prices changing over time use the price in force when the table is built
  *and* every price already scheduled to start later (the highest of them for
  each rate and prompt size), so a long-lived process never bills below list
  price after a scheduled rise. Peak/off-peak prices use the peak price.
- The cache-write price is the higher of the 5-minute and 1-hour write prices.
- Not covered, so callers using them must price them with ``with_price``:
  opt-in service tiers (batch, flex, and the dearer priority and fast), fees
  per search or request, and audio/image tokens (billed at the text rate).
- Models without both an input and an output token price (embeddings, speech)
  or with a per-request fee are left out: an unknown model raises rather than
  being billed zero. When several providers list one model id, the model's own
  vendor (as genai-prices recognises it: ``anthropic`` for ``claude-*``,
  ``openai`` for ``gpt-*``, ...) wins, otherwise the first provider listing it.

Importing this module imports no I/O library: genai-prices (whose package
imports an HTTP client for its updater) is loaded on the first ``builtin()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import MAX_EMAX, MIN_EMIN, ROUND_CEILING, Context, Decimal
from itertools import pairwise
from typing import TYPE_CHECKING, Any, TypeAlias

from .errors import InvalidInputError, UnknownModelError
from .money import MAX_AMOUNT, check_amount, to_decimal

if TYPE_CHECKING:
    from genai_prices import types as gp
    from genai_prices.data_snapshot import DataSnapshot

    BUILTIN_AS_OF: str  # module __getattr__ below

__all__ = ["BUILTIN_AS_OF", "ModelPrice", "PriceTable", "PriceTier"]

PriceInput: TypeAlias = int | float | str | Decimal
"""What a price argument may be; floats are read through their shortest repr."""

_REQUIRED = ("input_per_mtok", "output_per_mtok")
_OPTIONAL = ("cache_read_per_mtok", "cache_write_per_mtok")

# 64 digits hold any cost up to MAX_AMOUNT tokens at a MAX_AMOUNT price with 30
# fractional digits to spare, so real prices are exact; a price with more digits
# than that is rounded up (ROUND_CEILING), which can only over-report.
_COST_PRECISION = 64


def _check_price(value: Any, field: str) -> Decimal:
    price = to_decimal(value, field)
    if price < 0:
        raise InvalidInputError(field, value, "must not be negative")
    if price > MAX_AMOUNT:
        # One token would already cost more than the largest amount.
        raise InvalidInputError(field, value, f"exceeds the largest amount ({MAX_AMOUNT})")
    return price


def _check_model(model: Any, field: str = "model") -> str:
    if not isinstance(model, str) or not model.strip():
        raise InvalidInputError(field, model, "expected a non-empty model name")
    return model


def _check_prices(obj: ModelPrice | PriceTier) -> None:
    for name in _REQUIRED + _OPTIONAL:
        value = getattr(obj, name)
        if value is None and name in _OPTIONAL:
            continue
        # Frozen dataclass: normalise in place once, at construction.
        object.__setattr__(obj, name, _check_price(value, name))


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
        _check_prices(self)


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
        _check_prices(self)
        object.__setattr__(self, "tiers", _check_tiers(self.tiers))

    def rates_for(self, prompt_tokens: int) -> ModelPrice | PriceTier:
        """The rates billed when the prompt (cache tokens included) has ``prompt_tokens`` tokens.

        That is the last tier whose ``start`` the prompt exceeds, else these base
        rates; the rates apply to every token of the call.
        """
        for tier in reversed(self.tiers):
            if prompt_tokens > tier.start:
                return tier
        return self


def _check_tiers(tiers: Any) -> tuple[PriceTier, ...]:
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
        self, prices: Mapping[str, ModelPrice] | None = None, *, version: str = "custom"
    ) -> None:
        """Build a table from ``{model: ModelPrice}``; ``version`` is recorded with each cost."""
        if not isinstance(version, str) or not version:
            raise InvalidInputError("version", version, "expected a non-empty string")
        table: dict[str, ModelPrice] = {}
        for model, price in (prices or {}).items():
            _check_model(model)
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
        the module docstring for how genai-prices data is simplified.
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
        return _builtin_data().as_of if self._builtin else None

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
        _check_model(model)
        price = ModelPrice(
            _check_price(input_per_mtok, "input_per_mtok"),
            _check_price(output_per_mtok, "output_per_mtok"),
            None
            if cache_read_per_mtok is None
            else _check_price(cache_read_per_mtok, "cache_read_per_mtok"),
            None
            if cache_write_per_mtok is None
            else _check_price(cache_write_per_mtok, "cache_write_per_mtok"),
            _check_tiers(tiers),
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
            for name in _builtin_candidates(model):
                if name in self._prices:
                    return name
                if (key := self._folded.get(name.lower())) is not None:
                    return key
        return None

    def price_of(self, model: str) -> ModelPrice:
        """The price of ``model``; raises :class:`UnknownModelError` when it has none."""
        _check_model(model)
        key = self._key_for(model)
        if key is None:
            raise UnknownModelError(model, known=len(self))
        return self._prices[key]

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


# --- genai-prices data -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _BuiltinData:
    prices: dict[str, ModelPrice]
    aliases: dict[str, str]  # lower-case alias -> canonical model id
    sources: dict[str, str]  # model id -> id of the provider whose listing priced it
    snapshot: DataSnapshot
    version: str
    as_of: str  # the UTC date whose prices were taken (see the module docstring)


@functools.cache
def _builtin_data() -> _BuiltinData:
    import genai_prices
    from genai_prices.data import providers
    from genai_prices.data_snapshot import DataSnapshot

    # Our own snapshot of the bundled data: genai-prices' global one may have
    # been replaced by its network updater, which would make prices drift.
    snapshot = DataSnapshot(providers=providers, from_auto_update=False)
    today = datetime.now(UTC).date()
    prices, aliases, sources = _parse(providers, snapshot, today)
    version = f"genai-prices {genai_prices.__version__}"
    return _BuiltinData(prices, aliases, sources, snapshot, version, today.isoformat())


def __getattr__(name: str) -> Any:
    # BUILTIN_AS_OF: the date PriceTable.builtin() takes its prices for (in force
    # that day, plus rises already scheduled), e.g. "2026-12-01". Computed with the
    # table on first use, so importing this module still loads no genai-prices.
    if name == "BUILTIN_AS_OF":
        return _builtin_data().as_of
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _builtin_table() -> PriceTable:
    data = _builtin_data()
    return PriceTable._make(dict(data.prices), data.version, builtin=True)


def _parse(
    providers: list[gp.Provider], snapshot: DataSnapshot, today: date
) -> tuple[dict[str, ModelPrice], dict[str, str], dict[str, str]]:
    """Read genai-prices providers into prices, aliases and sources.

    That is ``{model id: price}``, ``{alias: model id}`` and ``{model id: id of
    the provider whose listing gave the price}``.
    """

    def vendor(name: str) -> str | None:
        try:
            return snapshot.find_provider(name.lower(), None, None).id
        except LookupError:
            return None

    listings: dict[str, list[tuple[str, gp.ModelInfo]]] = {}
    for provider in providers:
        for info in provider.models:
            listings.setdefault(info.id, []).append((provider.id, info))

    prices: dict[str, ModelPrice] = {}
    sources: dict[str, str] = {}
    for model_id, listed in listings.items():
        owner = vendor(model_id)
        own = [(provider_id, info) for provider_id, info in listed if provider_id == owner]
        # The vendor is authoritative: if its price cannot be expressed, a
        # reseller's differently shaped price is no better.
        for provider_id, info in own[:1] or listed:
            if (price := _convert(info, today)) is not None:
                prices[model_id] = price
                sources[model_id] = provider_id
                break

    aliases: dict[str, str] = {}
    declared = [
        (alias.lower(), provider.id, info.id)
        for provider in providers
        for info in provider.models
        if info.id in prices
        for alias in _equals_clauses(info.match)
    ]
    # Vendor declarations first, then the rest in data order; first wins.
    for prefer_vendor in (True, False):
        for alias, provider_id, model_id in declared:
            if (provider_id == vendor(alias)) is prefer_vendor and alias != model_id.lower():
                aliases.setdefault(alias, model_id)
    return prices, aliases, sources


def _equals_clauses(clause: Any) -> Iterator[str]:
    """The exact names a match clause accepts (``equals``, possibly inside ``or``)."""
    from genai_prices import types as gp

    if isinstance(clause, gp.ClauseEquals):
        yield clause.equals
    elif isinstance(clause, gp.ClauseOr):
        for inner in clause.or_:
            yield from _equals_clauses(inner)


def _convert(info: gp.ModelInfo, today: date) -> ModelPrice | None:
    """The highest price ``info`` can charge from ``today`` on, or None if inexpressible.

    Each genai-prices rate is a step function of the prompt size (its tiers).
    At every prompt size the highest live rate is taken, and the result is cut
    into tiers wherever any of the four rates changes.
    """
    from genai_prices import types as gp

    candidates = _live_prices(info, today)
    if any(p.requests_kcount is not None for p in candidates):
        return None  # a per-request fee has no place in a per-token price
    inputs = [p.input_mtok for p in candidates if p.input_mtok is not None]
    outputs = [p.output_mtok for p in candidates if p.output_mtok is not None]
    if not candidates or len(inputs) < len(candidates) or len(outputs) < len(candidates):
        return None
    reads = [None if p.cache_read_mtok is None else [p.cache_read_mtok] for p in candidates]
    writes = [_cache_writes(p) for p in candidates]

    def rates(prompt: int) -> tuple[Decimal, Decimal, Decimal | None, Decimal | None]:
        return (
            _top(inputs, prompt),
            _top(outputs, prompt),
            _top_cache(reads, prompt),
            _top_cache(writes, prompt),
        )

    values = [*inputs, *outputs, *(v for c in (*reads, *writes) if c is not None for v in c)]
    starts = sorted({t.start for v in values if isinstance(v, gp.TieredPrices) for t in v.tiers})
    base = previous = rates(0)
    tiers: list[PriceTier] = []
    for start in starts:
        # A tier applies to prompts exceeding its start: start + 1 is the first.
        current = rates(start + 1)
        if current != previous:
            tiers.append(PriceTier(start, *current))
            previous = current
    return ModelPrice(*base, tiers=tuple(tiers))


def _live_prices(info: gp.ModelInfo, today: date) -> list[gp.ModelPrice]:
    """Every price ``info`` may use from ``today`` on.

    genai-prices picks the *last* conditional price whose constraint holds, so
    the last entry that always holds from today (no constraint, or a start
    date already reached) hides every earlier one; each later entry (a future
    start date, a time-of-day window) can still apply.
    """
    from genai_prices import types as gp

    if isinstance(info.prices, gp.ModelPrice):
        return [info.prices]
    conditional = info.prices
    start = 0
    for index, entry in enumerate(conditional):
        constraint = entry.constraint
        if constraint is None or (
            isinstance(constraint, gp.StartDateConstraint) and constraint.start_date <= today
        ):
            start = index
    return [entry.prices for entry in conditional[start:]]


def _cache_writes(price: gp.ModelPrice) -> list[Decimal | gp.TieredPrices] | None:
    """The cache-write rates of ``price``; None if cache writes are billed as input.

    Callers do not tell 5-minute from 1-hour writes, so both count (the dearer
    one is billed). Without a 5-minute price genai-prices bills those writes at
    the input price, which then counts instead.
    """
    if price.cache_write_1h_mtok is None:
        return None if price.cache_write_mtok is None else [price.cache_write_mtok]
    five_minutes = price.input_mtok if price.cache_write_mtok is None else price.cache_write_mtok
    return [v for v in (five_minutes, price.cache_write_1h_mtok) if v is not None]


def _rate(value: Decimal | gp.TieredPrices, prompt: int) -> Decimal:
    """The rate genai-prices bills for ``value`` when the prompt has ``prompt`` tokens.

    As ``genai_prices.types.calc_unit_price``: the last tier (by start) whose
    start the total input tokens exceed, else the base price; it applies to all
    the tokens it prices.
    """
    if isinstance(value, Decimal):
        return value
    # Sorted stably, as genai-prices does: of equal starts the last listed wins.
    passed = [tier for tier in sorted(value.tiers, key=lambda t: t.start) if prompt > tier.start]
    return passed[-1].price if passed else value.base


def _top(values: Iterable[Decimal | gp.TieredPrices], prompt: int) -> Decimal:
    """The highest of ``values`` (not empty) at a prompt of ``prompt`` tokens."""
    return max(_rate(value, prompt) for value in values)


def _top_cache(
    values: Iterable[list[Decimal | gp.TieredPrices] | None], prompt: int
) -> Decimal | None:
    """The highest cache rate of the live prices at ``prompt`` tokens; None if any lacks one.

    A missing cache price means "billed at the input price", and the highest
    input rate is then the safe bound, which None stands for.
    """
    rates: list[Decimal] = []
    for value in values:
        if value is None:
            return None
        rates.extend(_rate(v, prompt) for v in value)
    return max(rates) if rates else None


def _split_provider(model: str, data: _BuiltinData) -> tuple[str, str] | None:
    """``("openai", "gpt-4o")`` for ``"openai:gpt-4o"`` or ``"openai/gpt-4o"``."""
    from genai_prices.data_snapshot import find_provider_by_id

    cuts = [i for i in (model.find(":"), model.find("/")) if i > 0]
    if not cuts:
        return None
    cut = min(cuts)
    prefix, rest = model[:cut], model[cut + 1 :]
    if not rest.strip() or find_provider_by_id(data.snapshot.providers, prefix) is None:
        return None
    return prefix, rest


def _match(data: _BuiltinData, model: str, provider: str | None) -> str | None:
    """The model id genai-prices' own matcher resolves ``model`` to, if any."""
    try:
        _, info = data.snapshot.find_provider_model(model, None, provider, None)
    except LookupError:
        return None
    return info.id


@functools.lru_cache(maxsize=4096)
def _builtin_candidates(model: str) -> tuple[str, ...]:
    """Model ids to try, best first, for a name not found as given.

    Depends only on the bundled data, so it is memoised (bounded: names come
    from callers) and shared by every table derived from the builtin one.
    """
    data = _builtin_data()
    names: list[str | None] = []
    split = _split_provider(model, data)
    if split is not None:
        provider, rest = split
        names += [rest, data.aliases.get(rest.lower()), data.aliases.get(model.lower())]
        names += [_match(data, rest, provider), _match(data, rest, None)]
    else:
        names.append(data.aliases.get(model.lower()))
    names.append(_match(data, model, None))
    return tuple(dict.fromkeys(n for n in names if n is not None))
