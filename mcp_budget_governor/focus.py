"""FinOps FOCUS CostAndUsage rows from the ledger: the mapping rules, as pure functions.

The DuckDB adapter (``projections/focus_export.py``) aggregates the ledger's
costs per hour (or day), tenant, user, tool, model and meter; this module says
what each row holds (``focus_checks.py`` checks what the official
``focus-validator`` does not).

Meters. A model call is split into four token meters (uncached input, output,
cache read, cache write: ``input_tokens`` includes the cache tokens, as
``prices.py`` defines, so each token is counted once); USD charged without a
model (a tool's own cost, a reservation, its settlement or release) is the
``tool_calls`` meter.

Cost split (:func:`split_cost`). The ledger holds one USD amount per event
(the ``costs`` view's rule: the event's first ``usd_micros`` charge), the
price table knows each meter's rate. Each meter's weight is its list cost
rounded up to a micro (``ceil(tokens x rate)``); the charged micros are
shared in proportion to the weights, each share rounded down, and the micros
left over (fewer than the number of meters) go one each to the meters with the
largest remainders, ties to the earlier meter (input, output, cache read,
cache write). Shares are integers summing exactly to the charged micros. With
every weight zero (a free model), the token counts are the weights; with no
tokens either, the input meter takes it all.

Quantities and prices. Token meters are priced per million tokens:
``PricingQuantity`` = tokens / 1,000,000 (``PricingUnit`` ``1000000 Tokens``),
``ListUnitPrice`` = the rate, and ``ListCost`` = their exact product (so it may
have more than six decimals; ``BilledCost`` is what the ledger charged, rounded
up to the micro per call). Tool-call costs are dollar amounts with no price
list: ``PricingUnit`` ``USD``, ``PricingQuantity`` = the dollars,
``ListUnitPrice`` 1, and ``ConsumedQuantity`` counts the completed calls
(``metered`` and ``settled`` events, a settlement without charges too: its
estimate stood; a reservation still open or released is not a completed call).

Every number is exact: integers (micros, tokens) rendered as decimals with a
decimal point (:func:`decimal_text`), never through a float.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from fractions import Fraction

from .errors import InvalidInputError
from .prices import ModelPrice, PriceTier
from .windows import parse_bound
from .windows import parse_range as _parse_range

__all__ = [
    "ALLOWED_VALUES",
    "FOCUS_1_2",
    "METERS",
    "SUBCATEGORY_PARENT",
    "VERSIONS",
    "Column",
    "FocusVersion",
    "Granularity",
    "Kind",
    "Meter",
    "MeterSpec",
    "ascii_text",
    "decimal_text",
    "parse_range",
    "rate_text",
    "sku_id",
    "sku_price_id",
    "split_cost",
    "tier_rates",
]


class Kind(StrEnum):
    """A FOCUS column's data type (how it is rendered and checked)."""

    STRING = "string"
    DECIMAL = "decimal"
    DATETIME = "datetime"
    INTEGER = "integer"
    JSON = "json"


@dataclass(frozen=True, slots=True)
class Column:
    """One column of an export: its name, type and whether it may be null."""

    name: str
    kind: Kind
    nullable: bool = True


@dataclass(frozen=True, slots=True)
class FocusVersion:
    """The columns one FOCUS version's CostAndUsage export holds, in file order."""

    version: str
    columns: tuple[Column, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Column names in order."""
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        """The column called ``name``; raises ``KeyError``."""
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)


_S, _D, _T, _I, _J = Kind.STRING, Kind.DECIMAL, Kind.DATETIME, Kind.INTEGER, Kind.JSON

#: FOCUS 1.2 CostAndUsage, as this exporter fills it: the mandatory columns, the
#: conditional ones whose feature we have (usage measurement, unit pricing, sub
#: accounts, tags), ``CommitmentDiscountStatus`` (always null: focus-validator
#: 2.2.1 reads it in the ConsumedQuantity rules whatever the features claimed),
#: then our ``x_`` columns.
FOCUS_1_2 = FocusVersion(
    "1.2",
    (
        Column("BilledCost", _D, False),
        Column("BillingAccountId", _S, False),
        Column("BillingAccountName", _S, False),
        Column("BillingCurrency", _S, False),
        Column("BillingPeriodEnd", _T, False),
        Column("BillingPeriodStart", _T, False),
        Column("ChargeCategory", _S, False),
        Column("ChargeClass", _S),
        Column("ChargeDescription", _S, False),
        Column("ChargeFrequency", _S, False),
        Column("ChargePeriodEnd", _T, False),
        Column("ChargePeriodStart", _T, False),
        Column("CommitmentDiscountStatus", _S),
        Column("ConsumedQuantity", _D, False),
        Column("ConsumedUnit", _S, False),
        Column("ContractedCost", _D, False),
        Column("EffectiveCost", _D, False),
        Column("InvoiceId", _S),
        Column("InvoiceIssuerName", _S, False),
        Column("ListCost", _D, False),
        Column("ListUnitPrice", _D, False),
        Column("PricingCategory", _S, False),
        Column("PricingQuantity", _D, False),
        Column("PricingUnit", _S, False),
        Column("ProviderName", _S, False),
        Column("PublisherName", _S, False),
        Column("ServiceCategory", _S, False),
        Column("ServiceName", _S, False),
        Column("ServiceSubcategory", _S, False),
        Column("SkuId", _S, False),
        Column("SkuMeter", _S, False),
        Column("SkuPriceDetails", _J),
        Column("SkuPriceId", _S, False),
        Column("SubAccountId", _S),
        Column("SubAccountName", _S),
        Column("Tags", _J),
        Column("x_UserId", _S),
        Column("x_ToolName", _S),
        Column("x_ModelId", _S),
        Column("x_Meter", _S, False),
        Column("x_EventCount", _I, False),
    ),
)
#: Every version this exporter can write, by name.
VERSIONS: dict[str, FocusVersion] = {FOCUS_1_2.version: FOCUS_1_2}

#: FOCUS 1.2 ServiceSubcategory -> its one parent ServiceCategory.
SUBCATEGORY_PARENT: dict[str, str] = {
    sub: parent
    for parent, subs in {
        "AI and Machine Learning": (
            "AI Platforms",
            "Bots",
            "Generative AI",
            "Machine Learning",
            "Natural Language Processing",
            "Other (AI and Machine Learning)",
        ),
        "Analytics": (
            "Analytics Platforms",
            "Business Intelligence",
            "Data Processing",
            "Search",
            "Streaming Analytics",
            "Other (Analytics)",
        ),
        "Business Applications": (
            "Productivity and Collaboration",
            "Other (Business Applications)",
        ),
        "Compute": (
            "Containers",
            "End User Computing",
            "Quantum Compute",
            "Serverless Compute",
            "Virtual Machines",
            "Other (Compute)",
        ),
        "Databases": (
            "Caching",
            "Data Warehouses",
            "Ledger Databases",
            "NoSQL Databases",
            "Relational Databases",
            "Time Series Databases",
            "Other (Databases)",
        ),
        "Developer Tools": (
            "Developer Platforms",
            "Continuous Integration and Deployment",
            "Development Environments",
            "Source Code Management",
            "Quality Assurance",
            "Other (Developer Tools)",
        ),
        "Identity": ("Identity and Access Management", "Other (Identity)"),
        "Integration": (
            "API Management",
            "Messaging",
            "Workflow Orchestration",
            "Other (Integration)",
        ),
        "Internet of Things": ("IoT Analytics", "IoT Platforms", "Other (Internet of Things)"),
        "Management and Governance": (
            "Architecture",
            "Compliance",
            "Cost Management",
            "Data Governance",
            "Disaster Recovery",
            "Endpoint Management",
            "Observability",
            "Support",
            "Other (Management and Governance)",
        ),
        "Media": (
            "Content Creation",
            "Gaming",
            "Media Streaming",
            "Mixed Reality",
            "Other (Media)",
        ),
        "Migration": ("Data Migration", "Resource Migration", "Other (Migration)"),
        "Mobile": ("Other (Mobile)",),
        "Multicloud": ("Multicloud Integration", "Other (Multicloud)"),
        "Networking": (
            "Application Networking",
            "Content Delivery",
            "Network Connectivity",
            "Network Infrastructure",
            "Network Routing",
            "Network Security",
            "Other (Networking)",
        ),
        "Security": (
            "Secret Management",
            "Security Posture Management",
            "Threat Detection and Response",
            "Other (Security)",
        ),
        "Storage": (
            "Backup Storage",
            "Block Storage",
            "File Storage",
            "Object Storage",
            "Storage Platforms",
            "Other (Storage)",
        ),
        "Web": ("Application Platforms", "Other (Web)"),
        "Other": ("Other (Other)",),
    }.items()
    for sub in subs
}

#: FOCUS 1.2 allowed values of the enumerated columns we fill (null is allowed
#: where the column is nullable).
ALLOWED_VALUES: dict[str, frozenset[str]] = {
    "ChargeCategory": frozenset({"Usage", "Purchase", "Tax", "Credit", "Adjustment"}),
    "ChargeClass": frozenset({"Correction"}),
    "ChargeFrequency": frozenset({"One-Time", "Recurring", "Usage-Based"}),
    "PricingCategory": frozenset({"Standard", "Committed", "Dynamic", "Other"}),
    "ServiceCategory": frozenset(SUBCATEGORY_PARENT.values()),
    "ServiceSubcategory": frozenset(SUBCATEGORY_PARENT),
    "CommitmentDiscountStatus": frozenset({"Used", "Unused"}),
}


class Meter(StrEnum):
    """What a row measures; the order is the cost split's tie-break order."""

    INPUT = "input"
    OUTPUT = "output"
    CACHE_READ = "cache_read"
    CACHE_WRITE = "cache_write"
    TOOL_CALLS = "tool_calls"


@dataclass(frozen=True, slots=True)
class MeterSpec:
    """The constant columns of one meter's rows."""

    meter: Meter
    sku_meter: str
    consumed_unit: str
    pricing_unit: str
    service_name: str
    service_category: str
    service_subcategory: str
    description: str  # "<model or tool> <description>"


_AI = "AI and Machine Learning"
METERS: dict[Meter, MeterSpec] = {
    Meter.INPUT: MeterSpec(
        Meter.INPUT,
        "Input Tokens",
        "Tokens",
        "1000000 Tokens",
        "LLM Inference",
        _AI,
        "Generative AI",
        "input tokens (uncached)",
    ),
    Meter.OUTPUT: MeterSpec(
        Meter.OUTPUT,
        "Output Tokens",
        "Tokens",
        "1000000 Tokens",
        "LLM Inference",
        _AI,
        "Generative AI",
        "output tokens",
    ),
    Meter.CACHE_READ: MeterSpec(
        Meter.CACHE_READ,
        "Cache Read Tokens",
        "Tokens",
        "1000000 Tokens",
        "LLM Inference",
        _AI,
        "Generative AI",
        "cache read tokens",
    ),
    Meter.CACHE_WRITE: MeterSpec(
        Meter.CACHE_WRITE,
        "Cache Write Tokens",
        "Tokens",
        "1000000 Tokens",
        "LLM Inference",
        _AI,
        "Generative AI",
        "cache write tokens",
    ),
    Meter.TOOL_CALLS: MeterSpec(
        Meter.TOOL_CALLS,
        "Tool Calls",
        "Calls",
        "USD",
        "MCP Tool Calls",
        _AI,
        "Other (AI and Machine Learning)",
        "tool calls",
    ),
}
#: The token meters, in split order.
TOKEN_METERS: tuple[Meter, ...] = (Meter.INPUT, Meter.OUTPUT, Meter.CACHE_READ, Meter.CACHE_WRITE)
#: Tokens per PricingQuantity unit of a token meter.
TOKENS_PER_PRICING_UNIT = 1_000_000


class Granularity(StrEnum):
    """The length of one row's charge period."""

    HOUR = "hour"
    DAY = "day"


# --- text -----------------------------------------------------------------------

_PRINTABLE = frozenset(range(0x20, 0x7F)) - {ord("%")}


def ascii_text(value: str) -> str:
    """``value`` with every character outside printable ASCII, and ``%``, as ``%XX`` (UTF-8).

    FOCUS strings must be ASCII here; percent-encoding keeps the value readable
    when it mostly is, and reversible (``urllib.parse.unquote``).

    >>> ascii_text("müller@acme")
    'm%C3%BCller@acme'
    """
    if all(ord(ch) in _PRINTABLE for ch in value):
        return value
    return "".join(
        ch if ord(ch) in _PRINTABLE else "".join(f"%{b:02X}" for b in ch.encode("utf-8"))
        for ch in value
    )


def decimal_text(units: int, scale: int) -> str:
    """``units / 10**scale`` exactly, with a decimal point and no trailing zeros beyond one.

    >>> decimal_text(1_500_000, 6), decimal_text(-5, 3), decimal_text(7, 0)
    ('1.5', '-0.005', '7.0')
    """
    if scale < 0:
        raise ValueError(f"scale: must be >= 0 (got {scale})")
    sign = "-" if units < 0 else ""
    whole, frac = divmod(abs(units), 10**scale)
    digits = f"{frac:0{scale}d}".rstrip("0") if scale else ""
    return f"{sign}{whole}.{digits or '0'}"


def rate_text(rate: Decimal) -> str:
    """A price as an exact decimal with a decimal point: ``Decimal('3')`` -> ``'3.0'``."""
    exponent = rate.as_tuple().exponent
    if not isinstance(exponent, int):
        raise InvalidInputError("rate", rate, "must be finite")
    scale = max(0, -exponent)
    units = int(rate.scaleb(scale))
    return decimal_text(units, scale)


def sku_id(subject: str, meter: Meter) -> str:
    """``<model>:<meter>`` for a token meter, ``<tool>:tool_calls`` for tool calls.

    The meter suffix differs between meters, so two SKUs never share an id.
    """
    return f"{subject}:{meter.value}"


def sku_price_id(sku: str, unit_price: str) -> str:
    """``<SkuId>:<unit price>``: the unit price has no ``:``, so the parent SkuId is unique."""
    return f"{sku}:{unit_price}"


# --- the cost split -------------------------------------------------------------


def split_cost(charged: int, weights: Sequence[int], tokens: Sequence[int]) -> tuple[int, ...]:
    """Share ``charged`` micros over meters, exactly (the module docstring's rule).

    ``weights`` are the meters' list costs rounded up to micros, ``tokens``
    their token counts (the fallback weights), both in meter order. A
    negative ``charged`` is split as its absolute value, negated.

    >>> split_cost(10, [3, 3, 3, 0], [1, 1, 1, 0])
    (4, 3, 3, 0)
    >>> sum(split_cost(1_000_003, [500_000, 250_001, 250_001, 1], [9, 9, 9, 9]))
    1000003
    """
    if len(weights) != len(tokens) or not weights:
        raise ValueError("weights and tokens: one per meter, at least one")
    if any(w < 0 for w in weights) or any(t < 0 for t in tokens):
        raise ValueError("weights and tokens must not be negative")
    sign = -1 if charged < 0 else 1
    amount = abs(charged)
    use = list(weights) if sum(weights) > 0 else list(tokens)
    if sum(use) == 0:
        use = [1] + [0] * (len(use) - 1)
    total = sum(use)
    quotients = [amount * w // total for w in use]
    remainders = [amount * w % total for w in use]
    left = amount - sum(quotients)
    # Largest remainder first, ties to the earlier meter.
    order = sorted(range(len(use)), key=lambda i: (-remainders[i], i))
    shares = quotients[:]
    for i in order[:left]:
        shares[i] += 1
    return tuple(sign * s for s in shares)


def list_cost_micros(tokens: int, rate_per_mtok: Decimal) -> int:
    """A meter's list cost (``tokens x rate``, micro-USD) rounded up: its split weight."""
    exact = Fraction(tokens) * Fraction(rate_per_mtok)
    return -((-exact.numerator) // exact.denominator)


def tier_rates(price: ModelPrice) -> list[tuple[int, tuple[Decimal, Decimal, Decimal, Decimal]]]:
    """``(start, (input, output, cache read, cache write))`` per tier, base first at start -1.

    A call pays the rates of the last row whose ``start`` its prompt
    (``input_tokens``) exceeds (``prices.py``'s tier rule); a missing cache
    price is the input price of the same tier.
    """
    rows: list[tuple[int, tuple[Decimal, Decimal, Decimal, Decimal]]] = []
    levels: list[tuple[int, ModelPrice | PriceTier]] = [(-1, price)]
    levels += [(tier.start, tier) for tier in price.tiers]
    for start, rates in levels:
        inp = rates.input_per_mtok
        cache_read, cache_write = rates.cache_read_per_mtok, rates.cache_write_per_mtok
        rows.append(
            (
                start,
                (
                    inp,
                    rates.output_per_mtok,
                    inp if cache_read is None else cache_read,
                    inp if cache_write is None else cache_write,
                ),
            )
        )
    return rows


# --- periods --------------------------------------------------------------------


def parse_range(start: str, end: str, granularity: Granularity) -> tuple[datetime, datetime]:
    """``--from`` / ``--to`` (:func:`~mcp_budget_governor.windows.parse_range`: a day
    ``--to`` is included, a time is the instant), aligned to whole hours or days.

    A bound inside an hour (or day) would make its row's charge period claim
    time that was not exported, so it is refused.
    """
    step = timedelta(hours=1) if granularity is Granularity.HOUR else timedelta(days=1)
    for field, text, is_end in (("--from", start, False), ("--to", end, True)):
        value = parse_bound(text, field, end=is_end)
        if (value - datetime(1970, 1, 1, tzinfo=UTC)) % step:
            raise InvalidInputError(field, text, f"must fall on a whole {granularity.value} (UTC)")
    lo, hi = _parse_range(start, end)
    assert lo is not None and hi is not None
    return lo, hi
