"""The genai-prices data adapter: the prices bundled with ``genai-prices`` as ``ModelPrice`` rows.

:meth:`PriceTable.builtin() <mcp_budget_governor.prices.PriceTable.builtin>`
is the public way in; this module reads the bundled data (never the network
updater). The data is more detailed than ``ModelPrice``; where it must be
simplified, it errs on the expensive side:

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

genai-prices is imported inside the functions, on the first call, not with
this module:

>>> builtin_data().version.startswith("genai-prices ")
True
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from .model_price import ModelPrice, PriceTier

if TYPE_CHECKING:
    from genai_prices import types as gp
    from genai_prices.data_snapshot import DataSnapshot

__all__ = ["BuiltinData", "builtin_candidates", "builtin_data"]


@dataclass(frozen=True, slots=True)
class BuiltinData:
    prices: dict[str, ModelPrice]
    aliases: dict[str, str]  # lower-case alias -> canonical model id
    sources: dict[str, str]  # model id -> id of the provider whose listing priced it
    snapshot: DataSnapshot
    version: str
    as_of: str  # the UTC date whose prices were taken (see the module docstring)


@functools.cache
def builtin_data() -> BuiltinData:
    import genai_prices
    from genai_prices.data import providers
    from genai_prices.data_snapshot import DataSnapshot

    # Our own snapshot of the bundled data: genai-prices' global one may have
    # been replaced by its network updater, which would make prices drift.
    snapshot = DataSnapshot(providers=providers, from_auto_update=False)
    today = datetime.now(UTC).date()
    prices, aliases, sources = _parse(providers, snapshot, today)
    version = f"genai-prices {genai_prices.__version__}"
    return BuiltinData(prices, aliases, sources, snapshot, version, today.isoformat())


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


def _split_provider(model: str, data: BuiltinData) -> tuple[str, str] | None:
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


def _match(data: BuiltinData, model: str, provider: str | None) -> str | None:
    """The model id genai-prices' own matcher resolves ``model`` to, if any."""
    try:
        _, info = data.snapshot.find_provider_model(model, None, provider, None)
    except LookupError:
        return None
    return info.id


@functools.lru_cache(maxsize=4096)
def builtin_candidates(model: str) -> tuple[str, ...]:
    """Model ids to try, best first, for a name not found as given.

    Depends only on the bundled data, so it is memoised (bounded: names come
    from callers) and shared by every table derived from the builtin one.
    """
    data = builtin_data()
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
