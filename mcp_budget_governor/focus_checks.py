"""The checks of a FOCUS row that the official ``focus-validator`` does not make.

Pure functions over rendered rows (column name -> text); the export runs them
on every row it writes (``projections/focus_export.py``), and importing this
module checks that the constant parts of :data:`~mcp_budget_governor.focus.METERS`
obey the allowed values.

>>> check_row({"BilledCost": "1", "ChargeCategory": "Usage"})
["BilledCost: '1' is not a decimal with a decimal point"]
>>> check_columns(["UserId"], FOCUS_1_2)[-1]
"column 'UserId': a custom column must start with x_"
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from decimal import Decimal

from .focus import (
    ALLOWED_VALUES,
    FOCUS_1_2,
    METERS,
    SUBCATEGORY_PARENT,
    Column,
    FocusVersion,
    Kind,
)

__all__ = ["check_columns", "check_formats", "check_row"]

_DECIMAL = re.compile(r"^-?[0-9]+\.[0-9]+$")
_INTEGER = re.compile(r"^-?[0-9]+$")
_DATETIME = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z$")
_ASCII = re.compile(r"^[\x20-\x7e]*$")


def check_columns(names: Iterable[str], version: FocusVersion = FOCUS_1_2) -> list[str]:
    """Problems with an export's column list: missing columns, custom ones without ``x_``."""
    names = list(names)
    focus = {c.name for c in version.columns if not c.name.startswith("x_")}
    problems = [f"column {n!r}: missing" for n in version.names if n not in names]
    problems += [
        f"column {n!r}: a custom column must start with x_"
        for n in names
        if n not in focus and not n.startswith("x_")
    ]
    return problems


def _value(row: Mapping[str, str | None], name: str) -> str | None:
    value = row.get(name)
    return None if value is None or value == "" else value


def check_formats(row: Mapping[str, str | None], version: FocusVersion) -> list[str]:
    """Problems of each value's own format: null where not allowed, ASCII, decimal, time."""
    problems = []
    for name, raw in row.items():
        try:
            column = version.column(name)
        except KeyError:
            column = Column(name, Kind.STRING)
        value = None if raw is None or raw == "" else raw
        if value is None:
            if not column.nullable:
                problems.append(f"{name}: must not be null")
            continue
        if not _ASCII.match(value):
            problems.append(f"{name}: {value!r} is not printable ASCII")
        elif column.kind is Kind.DECIMAL and not _DECIMAL.match(value):
            problems.append(f"{name}: {value!r} is not a decimal with a decimal point")
        elif column.kind is Kind.INTEGER and not _INTEGER.match(value):
            problems.append(f"{name}: {value!r} is not an integer")
        elif column.kind is Kind.DATETIME and not _DATETIME.match(value):
            problems.append(f"{name}: {value!r} is not YYYY-MM-DDTHH:MM:SSZ")
    return problems


def _check_allowed(row: Mapping[str, str | None]) -> list[str]:
    problems = []
    for name, allowed in ALLOWED_VALUES.items():
        value = _value(row, name)
        if value is not None and value not in allowed:
            problems.append(f"{name}: {value!r} is not an allowed value")
    sub, parent = _value(row, "ServiceSubcategory"), _value(row, "ServiceCategory")
    if (
        "ServiceCategory" in row
        and sub is not None
        and sub in SUBCATEGORY_PARENT
        and SUBCATEGORY_PARENT[sub] != parent
    ):
        problems.append(
            f"ServiceSubcategory: {sub!r} belongs to {SUBCATEGORY_PARENT[sub]!r}, not {parent!r}"
        )
    return problems


def _dec(value: str | None) -> Decimal | None:
    return None if value is None or not _DECIMAL.match(value) else Decimal(value)


def _check_costs(row: Mapping[str, str | None]) -> list[str]:
    problems = []
    price, quantity = _dec(_value(row, "ListUnitPrice")), _dec(_value(row, "PricingQuantity"))
    cost = _dec(_value(row, "ListCost"))
    if price is not None and quantity is not None and cost is not None and price * quantity != cost:
        problems.append(
            f"ListCost: {cost} is not ListUnitPrice x PricingQuantity ({price} x {quantity})"
        )
    if "ContractedCost" in row and _value(row, "ContractedUnitPrice") is None:
        contracted, billed = _dec(_value(row, "ContractedCost")), _dec(_value(row, "BilledCost"))
        if contracted is not None and billed is not None and contracted != billed:
            problems.append(
                f"ContractedCost: {contracted} must equal BilledCost ({billed}) "
                "without a ContractedUnitPrice"
            )
    return problems


def _check_periods(row: Mapping[str, str | None]) -> list[str]:
    names = ("BillingPeriodStart", "ChargePeriodStart", "ChargePeriodEnd", "BillingPeriodEnd")
    values = [_value(row, n) for n in names]
    if any(v is None or not _DATETIME.match(v) for v in values):
        return []
    b0, c0, c1, b1 = values
    problems = []
    if not c0 < c1:  # type: ignore[operator]  # same fixed-width format: text order is time order
        problems.append(f"ChargePeriodStart {c0} must be before ChargePeriodEnd {c1}")
    if not (b0 <= c0 and c1 <= b1):  # type: ignore[operator]
        problems.append(f"charge period {c0}..{c1} must lie within the billing period {b0}..{b1}")
    return problems


def check_row(row: Mapping[str, str | None], version: FocusVersion = FOCUS_1_2) -> list[str]:
    """Every problem of one rendered row (column name -> text, None or "" for null).

    The rules focus-validator 2.2.1 does not enforce: allowed values row by
    row, the subcategory's parent, ``ListCost = ListUnitPrice x
    PricingQuantity`` exactly, ``ContractedCost = BilledCost`` without a
    contracted unit price, period ordering, printable-ASCII strings, and the
    decimal and date-time formats (decimal point; ``YYYY-MM-DDTHH:MM:SSZ``).
    """
    problems = check_formats(row, version)
    problems += _check_allowed(row)
    problems += _check_costs(row)
    problems += _check_periods(row)
    return problems


def _check_mapping() -> None:
    """The constant parts of the mapping obey the allowed values (checked at import)."""
    for spec in METERS.values():
        row = {
            "ServiceCategory": spec.service_category,
            "ServiceSubcategory": spec.service_subcategory,
        }
        if problems := _check_allowed(row):
            raise AssertionError(f"FOCUS mapping of {spec.meter}: {problems}")


_check_mapping()
