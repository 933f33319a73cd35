"""The answer to a check."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from .errors import BudgetExceeded, BudgetUnavailable, LimitExceeded

#: Reason prefixes: a limit's counter refused, or could not be read (fail-closed).
EXCEEDED = "budget_exceeded"
UNAVAILABLE = "budget_unavailable"
#: The reason when the ledger cannot record new work.
LEDGER_UNAVAILABLE = "ledger_unavailable"

_NO_HEADROOM: Mapping[str, int] = MappingProxyType({})


def _no_headroom() -> Mapping[str, int]:
    return _NO_HEADROOM


class LimitName(str):
    """A refusing limit's name (a plain ``str`` in every way), whose ``name`` is
    itself: mcp-budget-governor 0.1.0's decisions held the ``Limit``, and code
    written for it reads ``decision.limit.name``."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return str(self)


@dataclass(frozen=True, slots=True)
class Lease:
    """The slots an admitted call holds on concurrency caps: lease ``id`` in each
    lease set of ``keys`` (``keys.lease_key``), given back by
    :meth:`Governor.release` (``Governor.admitted`` does it on exit)."""

    id: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """Admit or refuse, and why.

    - ``limit``: the refusing limit's name (None when admitted).
    - ``status``: 200 when admitted, else 429 (quota), 402 (spend), 503
      (breaker or unreachable counters), 403 (an unnamed caller the policy
      refuses, reason ``caller_unidentified``), or the limit's override.
    - ``retry_after``: seconds until retrying can succeed; None on a 402,
      because waiting a few seconds never restores a spend cap and an SDK
      would retry in a loop (``resets_at`` still says when the window ends).
    - ``over``: shadow-mode (``OnExceed.ALERT``) limits this call went over.
    - ``degraded``: the shared counters were unreachable and process-local
      fallback counters decided.
    - ``remaining``: per limit the check read (gated limits and breakers),
      what can still be charged before it is exhausted, after this call's
      charge; empty when no counter answered. Not part of equality.
    - ``lease``: the concurrency-cap leases an admitted call holds (None when
      the policy has no concurrency cap for it). Not part of equality.
    """

    admitted: bool
    limit: str | None = None
    status: int = 200
    retry_after: int | None = None
    resets_at: datetime | None = None
    reason: str = "ok"
    over: tuple[str, ...] = field(default=())
    degraded: bool = False
    remaining: Mapping[str, int] = field(default_factory=_no_headroom, compare=False)
    lease: Lease | None = field(default=None, compare=False)
    #: What an admission reserved with it (Governor.admitted(hold=)): the reservation's
    #: event id and its slots, for the integrations' Reservations to settle.
    held: Any = field(default=None, compare=False, repr=False)

    @property
    def allowed(self) -> bool:
        """``admitted``, under the name mcp-budget-governor 0.1.0 used."""
        return self.admitted

    def refusal_type(self) -> type[LimitExceeded]:
        """The exception class a refusal with this decision raises.

        Every one is a :class:`LimitExceeded`. A refusal by a limit's counter
        with status 503 sheds everyone (a breaker): :class:`BudgetExceeded`;
        unreachable fail-closed counters or ledger: :class:`BudgetUnavailable`;
        anything else (a quota, a spend limit, an unnamed caller) plain
        :class:`LimitExceeded`.
        """
        reason = self.reason
        if reason.startswith(EXCEEDED):
            return BudgetExceeded if self.status == 503 else LimitExceeded
        if reason.startswith(UNAVAILABLE) or reason == LEDGER_UNAVAILABLE:
            return BudgetUnavailable
        return LimitExceeded

    def raise_for_status(self) -> Decision:
        """Raise :class:`LimitExceeded` (the class :meth:`refusal_type` names) if
        refused; return self otherwise."""
        if not self.admitted:
            raise LimitExceeded(self)
        return self

    def __bool__(self) -> bool:
        return self.admitted

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers a refusal should carry (``Retry-After`` where it helps)."""
        out: dict[str, str] = {}
        if self.retry_after is not None and not self.admitted:
            out["Retry-After"] = str(self.retry_after)
        return out


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
