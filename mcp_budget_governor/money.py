"""Money and amounts: integer USD micros, never floats.

Amounts are bounded by ``MAX_AMOUNT`` = 2**53 - 1, the largest integer that
Redis's Lua (double-precision numbers) compares and adds exactly. In USD micros
that is about nine billion dollars, in calls or tokens nine quadrillion.

>>> usd("12.34"), format_usd(usd("12.34")), format_dollars(-usd("0.05"))
(12340000, '12.340000', '-$0.050000')
>>> usd(0.1) + usd(0.2) == usd("0.3")  # decimal text in, exact integers out
True
"""

from __future__ import annotations

from decimal import (
    ROUND_CEILING,
    Context,
    Decimal,
    DivisionByZero,
    InvalidOperation,
    Overflow,
    localcontext,
)
from enum import StrEnum
from typing import Any

from .errors import InvalidInputError

MAX_AMOUNT = 2**53 - 1
MICROS_PER_USD = 1_000_000

#: The arithmetic of a dollar figure: exact enough for any amount in range, rounding
#: up (as a fraction of a micro is), and a signal that would otherwise be a bare
#: ``decimal`` exception trapped, to be reported as bad input.
_DOLLAR_MATH = Context(
    prec=64, rounding=ROUND_CEILING, traps=[InvalidOperation, Overflow, DivisionByZero]
)


class Unit(StrEnum):
    """What a limit counts."""

    CALLS = "calls"
    TOKENS = "tokens"
    USD_MICROS = "usd_micros"
    #: Calls in progress (a concurrency cap: leases, not spend; no window).
    CONCURRENT = "concurrent"


def to_decimal(value: Any, field: str) -> Decimal:
    """Read a price or dollar figure exactly; floats go through their shortest repr."""
    if isinstance(value, bool):
        raise InvalidInputError(field, value, "expected a number, not a bool")
    if isinstance(value, Decimal):
        result = value
    elif isinstance(value, int | float | str):
        if isinstance(value, str) and (not value.isascii() or "_" in value):
            # Decimal() reads other scripts' digits and "1_000": a person means neither.
            raise InvalidInputError(field, value, "not a number")
        try:
            result = Decimal(str(value).strip()) if not isinstance(value, int) else Decimal(value)
        except InvalidOperation:
            raise InvalidInputError(field, value, "not a number") from None
    else:
        raise InvalidInputError(field, value, "expected a number")
    if not result.is_finite():
        raise InvalidInputError(field, value, "must be finite")
    return result


def usd(dollars: int | float | str | Decimal) -> int:
    """Convert dollars to integer USD micros, rounding a fraction of a micro up.

    >>> usd(25)
    25000000
    >>> usd("0.05")
    50000
    >>> usd(0.1) + usd(0.2) == usd(0.3)
    True
    """
    value = to_decimal(dollars, "usd")
    if value < 0:
        raise InvalidInputError("usd", dollars, "must not be negative")
    if value.adjusted() > 16:  # past 10**16 dollars: out of range, and no arithmetic on it
        raise InvalidInputError("usd", dollars, f"exceeds the largest amount ({MAX_AMOUNT} micros)")
    with localcontext(_DOLLAR_MATH):
        micros = int((value * MICROS_PER_USD).to_integral_value(rounding=ROUND_CEILING))
    if micros > MAX_AMOUNT:
        raise InvalidInputError("usd", dollars, f"exceeds the largest amount ({MAX_AMOUNT} micros)")
    return micros


def format_usd(micros: int) -> str:
    """Render micros as an exact dollar string: ``format_usd(1_500_000) == '1.500000'``."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_USD)
    return f"{sign}{whole}.{frac:06d}"


def format_dollars(micros: int) -> str:
    """Micros as dollars for people: ``format_dollars(-1_500_000) == '-$1.500000'``."""
    text = format_usd(micros)
    return f"-${text[1:]}" if text.startswith("-") else f"${text}"


def check_amount(value: Any, field: str, *, allow_negative: bool = False) -> int:
    """Validate an integer amount (calls, tokens or micros) and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(field, value, "expected an integer")
    if value < 0 and not allow_negative:
        raise InvalidInputError(field, value, "must not be negative")
    if abs(value) > MAX_AMOUNT:
        raise InvalidInputError(field, value, f"exceeds the largest amount ({MAX_AMOUNT})")
    return value
