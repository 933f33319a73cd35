"""Numbers people write as text (the admin API, the CLI): ASCII digits, nothing else.

``int()`` and ``Decimal()`` take more than a person means by a number: digits of
other scripts (``"١٢"``), signs and blanks around it (``" 5"``), ``"1_000"``, and
exponents whose arithmetic overflows (``"1E+999999999999999999"``); ``isdigit()``
passes ``"²"``, which ``int()`` then refuses with a ``ValueError``. Here a whole
number is ASCII digits and dollars are ASCII digits with at most six decimals
(whole micros): anything else is one :class:`InvalidInputError` naming the field.
The range is the caller's (``most``), the largest amount by default.

>>> whole("1200", "cap"), dollars("5.25", "cap_usd")
(1200, 5250000)
>>> whole("²", "cap")
Traceback (most recent call last):
mcp_budget_governor.errors.InvalidInputError: cap: expected a whole number of ASCII digits (got '²')
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from .errors import InvalidInputError
from .money import MAX_AMOUNT, MICROS_PER_USD

__all__ = ["dollars", "whole", "whole_argument"]

# [0-9], not \d: \d matches every script's digits. The lengths bound the work
# before the range is checked.
_WHOLE = re.compile(r"[0-9]{1,30}")
_DOLLARS = re.compile(r"([0-9]{1,30})(?:\.([0-9]{1,6}))?")


def whole(text: str, field: str, *, least: int = 0, most: int = MAX_AMOUNT) -> int:
    """``text`` as a whole number from ``least`` to ``most``."""
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        raise InvalidInputError(field, text, "expected a whole number of ASCII digits")
    value = int(text)
    if not least <= value <= most:
        raise InvalidInputError(field, text, f"expected a whole number from {least} to {most}")
    return value


def dollars(text: str, field: str, *, most: int = MAX_AMOUNT) -> int:
    """``text`` (dollars, such as ``"5"`` or ``"5.25"``) as USD micros, at most ``most``."""
    got = _DOLLARS.fullmatch(text) if isinstance(text, str) else None
    if got is None:
        raise InvalidInputError(
            field, text, 'expected dollars in ASCII digits, at most six decimals, e.g. "5.25"'
        )
    units, fraction = got.groups()
    micros = int(units) * MICROS_PER_USD + int((fraction or "").ljust(6, "0"))
    if micros > most:
        raise InvalidInputError(field, text, f"exceeds the largest amount ({most} micros)")
    return micros


def whole_argument(*, least: int = 0, most: int = MAX_AMOUNT) -> Callable[[str], int]:
    """:func:`whole` as an argparse ``type=``: argparse then prints the option and
    the problem on one line, and exits 2 (``int`` takes ``"١٢"`` for 12)."""

    def parse(text: str) -> int:
        try:
            return whole(text, "", least=least, most=most)
        except InvalidInputError as exc:
            raise argparse.ArgumentTypeError(f"{exc.problem} (got {text!r})") from None

    return parse
