"""The answer to a check."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

# At home in errors.py, beside the refusals that carry a Decision and that it names
# (Decision.refusal_type), so that neither module imports the other back.
from .errors import EXCEEDED as EXCEEDED
from .errors import LEDGER_UNAVAILABLE as LEDGER_UNAVAILABLE
from .errors import UNAVAILABLE as UNAVAILABLE
from .errors import Decision as Decision
from .errors import Lease as Lease


class LimitName(str):
    """A refusing limit's name (a plain ``str`` in every way), whose ``name`` is
    itself: mcp-budget-governor 0.1.0's decisions held the ``Limit``, and code
    written for it reads ``decision.limit.name``."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return str(self)


ADMITTED = Decision(admitted=True)


@dataclass(frozen=True, slots=True)
class MeterResult:
    """What a ``meter()`` (or an explicit ``settle()``) did to the first named limit
    that applies to the context.

    - ``total``: that limit's total after the charge (0 when no counter
      answered: unreachable, and no local fallback).
    - ``within``: whether it still has room, i.e. ``total`` is below the cap;
      False once the cap is reached, when the next check is refused.
    - ``crossed``: True only for the charge that took it from room to none,
      so an alert fires once per window.
    - ``charged``: the amount charged on it (a settle: the difference from
      the estimate); ``limit`` its name (None, and nothing charged, when the
      context lacks the scope of every named limit).
    - ``degraded``: the shared counters were unreachable.
    """

    within: bool
    total: int
    crossed: bool
    charged: int = 0
    limit: str | None = None
    degraded: bool = False


NOTHING_METERED = MeterResult(within=True, total=0, crossed=False)


def at(epoch: float | None) -> datetime | None:
    """An epoch instant as an aware UTC datetime."""
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)
