"""The range of every number that crosses a boundary, declared once.

Amounts, caps, grants, a change's ``until``, event times and expiries come in
through the ledger topic, the admin API, the CLI and the Python and TypeScript
APIs. Each door checks them against :data:`BOUNDS` and refuses with the same
one line, naming the field and the value. Sums are checked before they are
applied (:func:`sum_problem`: cap + grants, committed + amount), so every total
a backend compares stays below 2**53, where Lua's doubles, Postgres' bigints
and Python's ints agree exactly. Times stop short of year 9999, so a time
shown in any zone is a date every language can print.

>>> check("until", 10**30)
Traceback (most recent call last):
...
mcp_budget_governor.errors.InvalidInputError: until: must be at most 253370764800 \
(9999-01-01T00:00:00Z) (got 1000000000000000000000000000000)
>>> sum_problem("grant", MAX_AMOUNT, 1)
'grant: 9007199254740991 + 1 would leave the exact range (at most 9007199254740991)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvalidInputError
from .money import MAX_AMOUNT

__all__ = [
    "BOUNDS",
    "LATEST_TIME",
    "MAX_AMOUNT",
    "Bound",
    "check",
    "problem",
    "sum_problem",
]

#: The latest epoch second any time may name: 9999-01-01T00:00:00Z, so that the
#: same instant in any time zone is still a year-9999 date (Python's datetime,
#: JavaScript's Date, Postgres' timestamptz all print it).
LATEST_TIME = 253_370_764_800


@dataclass(frozen=True, slots=True)
class Bound:
    """The whole numbers from ``low`` to ``high``; ``note`` says what ``high`` is."""

    low: int
    high: int
    note: str = ""


_TIME_NOTE = "9999-01-01T00:00:00Z"

#: The one table: every door checks a number of these kinds against its row.
BOUNDS: dict[str, Bound] = {
    # a charge's signed amount (calls, tokens or USD micros)
    "amount": Bound(-MAX_AMOUNT, MAX_AMOUNT),
    # a cap (a limit's, a plan's, a run-time one)
    "cap": Bound(0, MAX_AMOUNT),
    # what one grant adds, and what a counter's grants add up to
    "grant": Bound(1, MAX_AMOUNT),
    # a reset's grant (what the counter had spent)
    "reset": Bound(0, MAX_AMOUNT),
    # a committed counter: never negative, never past the exact range
    "committed": Bound(0, MAX_AMOUNT),
    # a run-time cap's end, epoch seconds (0: for good, checked apart)
    "until": Bound(1, LATEST_TIME, _TIME_NOTE),
    # an event's time and a counter's expiry, epoch seconds
    "time": Bound(0, LATEST_TIME, _TIME_NOTE),
    "expire_at": Bound(1, LATEST_TIME, _TIME_NOTE),
}


def problem(kind: str, value: Any) -> str | None:
    """Why ``value`` is not a number of ``kind`` (a row of :data:`BOUNDS`); None if it is."""
    bound = BOUNDS[kind]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            return "expected a whole number"
    if value < bound.low:
        return f"must be at least {bound.low}"
    if value > bound.high:
        note = f" ({bound.note})" if bound.note else ""
        return f"must be at most {bound.high}{note}"
    return None


def check(kind: str, value: Any, field: str | None = None) -> int:
    """``value`` as an int of ``kind``, else :class:`InvalidInputError` naming ``field``."""
    why = problem(kind, value)
    if why is not None:
        raise InvalidInputError(field or kind, value, why)
    return int(value)


def sum_problem(kind: str, total: int, amount: int) -> str | None:
    """Why ``total + amount`` leaves the range of ``kind`` (None: it stays in).

    The check every store makes before it adds (a grant to a counter's grants,
    an amount to a committed counter): the change is refused whole, never
    reaches Lua or SQL, and the sum never needs more than 53 bits.
    """
    bound = BOUNDS[kind]
    result = total + amount
    if result > bound.high:
        return f"{kind}: {total} + {amount} would leave the exact range (at most {bound.high})"
    if result < min(bound.low, 0):
        return f"{kind}: {total} + {amount} would go below {min(bound.low, 0)}"
    return None
