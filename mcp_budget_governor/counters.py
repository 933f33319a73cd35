"""The counter model every backend implements, and its one admission rule.

Per key a backend holds ``committed`` (written by the projection of ledger
events, or inline when there is no ledger) and ``in-flight`` amounts, kept per
event id so that projecting an event moves each amount exactly once.
``used = committed + in-flight`` is what limits are compared with.

The Lua scripts in ``lua/`` and :class:`MemoryBackend` implement this same
model; a property test drives both and requires identical answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

SECONDS_PER_DAY = 86_400


def fits(used: int, amount: int, cap: int) -> bool:
    """Whether charging ``amount`` keeps a counter at or under ``cap``.

    A zero charge (a spend limit read at check time, a breaker) needs one unit
    of room: a limit whose total has reached its cap is exhausted.

    >>> fits(49, 1, 50), fits(50, 1, 50), fits(99, 0, 100), fits(100, 0, 100)
    (True, False, True, False)
    """
    return used + max(amount, 1) <= cap


@dataclass(frozen=True, slots=True)
class CounterOp:
    """One counter touched by an atomic charge.

    ``amount`` is added when the whole charge is admitted; ``enforce`` makes
    this counter able to refuse it (per :func:`fits`); ``expire_at`` is the
    absolute expiry (epoch seconds) every write repairs.
    """

    key: str
    amount: int
    cap: int
    enforce: bool
    expire_at: int


@dataclass(frozen=True, slots=True)
class ChargeResult:
    """``refused`` is the index of the first refusing op, or -1; ``used`` the totals read."""

    refused: int
    used: tuple[int, ...]

    @property
    def admitted(self) -> bool:
        return self.refused < 0


@dataclass(frozen=True, slots=True)
class AppliedCharge:
    """One charge of a ledger event, as the projection applies it."""

    key: str
    amount: int
    expire_at: int


@dataclass(frozen=True, slots=True)
class AppliedEvent:
    """A ledger event at ``offset`` of a partition, with its time and charges."""

    offset: int
    event_id: str
    time: float
    charges: tuple[AppliedCharge, ...]

    @property
    def seen_day(self) -> str:
        """The UTC day whose seen-id set records this event (``20261129``)."""
        return time.strftime("%Y%m%d", time.gmtime(self.time))

    @property
    def seen_expire_at(self) -> int:
        """When that set may go: the day's end plus a day of grace for late retries."""
        return (int(self.time) // SECONDS_PER_DAY + 2) * SECONDS_PER_DAY


@dataclass(frozen=True, slots=True)
class CounterState:
    """A counter's parts: committed, in-flight total, and in-flight per event id."""

    committed: int
    in_flight: int
    pending: dict[str, int]

    @property
    def used(self) -> int:
        return self.committed + self.in_flight


@runtime_checkable
class Backend(Protocol):
    """Shared counter storage. Every method is one atomic step (one round trip)."""

    async def charge(
        self, ops: Sequence[CounterOp], *, event_id: str | None = None, want_used: bool = True
    ) -> ChargeResult:
        """All or nothing: refuse (writing nothing) if any enforcing op does not fit,
        else add every non-zero amount, committed inline when ``event_id`` is None,
        in-flight under ``event_id`` otherwise. ``want_used=False`` lets a backend
        skip returning the totals (``used`` may then be empty)."""
        ...

    async def usage(self, keys: Sequence[str]) -> list[int]:
        """``committed + in-flight`` of each key (0 for a missing key)."""
        ...

    async def apply(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool = False,
        through: int = -1,
    ) -> int:
        """Project events: move each one's amounts from in-flight to committed and
        advance the partition's applied-offset watermark, skipping offsets at or
        below it and event ids already applied (a producer retry delivered
        twice). The watermark also reaches ``through`` (the batch's last offset,
        when the records after its last event were dead-lettered), in the same
        step. Returns how many events were applied. With ``require_epoch``,
        raises :class:`EpochMissingError` (applying nothing) when the store has
        lost its state."""
        ...

    async def state(self, key: str) -> CounterState:
        """A counter's parts, for reconciliation and tests."""
        ...

    async def counter_keys(self, limit: int, *, match: str | None = None) -> list[str]:
        """Up to ``limit`` live counter keys, sorted (reports: ``mcpbg budgets``).

        ``match`` is a :func:`keys.key_pattern` (one limit's keys in one bucket);
        without it, every counter key. The projection's own keys
        (``mcpbg:v1:_*``) are never listed. Bounded, so a report over millions
        of counters returns ``limit`` keys, not all of them.
        """
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
