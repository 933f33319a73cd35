"""The counter model every backend implements, and its one admission rule.

Per key a backend holds ``committed`` (written by the projection of ledger
events, or inline when there is no ledger) and ``in-flight`` amounts, kept per
event id so that projecting an event moves each amount exactly once.
``used = committed + in-flight`` is what limits are compared with.

The Lua scripts in ``lua/`` and :class:`MemoryBackend` implement this same
model; a property test drives both and requires identical answers.

Counters are counted exactly: every part (committed, in-flight) and every
total stays within ``MAX_COUNTER`` (2**53 - 1) in magnitude, the integers
Lua's doubles hold exactly, and a charge that would leave that range is
refused (:func:`stays_exact`, :class:`CounterOverflowError`). Caps and single
amounts have the same bound (``money.MAX_AMOUNT``), so inside the range every
sum the scripts compare is exact, and outside it the comparison with the
bound still is (doubles round monotonically and the bound is representable).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from .caps import CapRef, Change
from .errors import CounterOverflowError, EventRefusedError, InvalidInputError
from .keys import parse_key
from .money import MAX_AMOUNT

SECONDS_PER_DAY = 86_400

#: The largest magnitude of a counter's parts and total (lua/charge.lua: MAX_EXACT).
MAX_COUNTER = MAX_AMOUNT


def fits(used: int, amount: int, cap: int) -> bool:
    """Whether charging ``amount`` keeps a counter at or under ``cap``.

    A zero charge (a spend limit read at check time, a breaker) needs one unit
    of room: a limit whose total has reached its cap is exhausted.

    >>> fits(49, 1, 50), fits(50, 1, 50), fits(99, 0, 100), fits(100, 0, 100)
    (True, False, True, False)
    """
    return used + max(amount, 1) <= cap


def stays_exact(committed: int, in_flight: int, amount: int, *, inline: bool) -> bool:
    """Whether a counter's parts are in the exact range and stay there with ``amount`` added.

    ``inline`` adds to committed, else to in-flight. A charge first requires
    every counter's parts to be exact (``amount=0``: :func:`fits` needs an
    exact total), then refuses by :func:`fits`, then requires each admitted
    amount to keep its counter exact; any failure refuses the whole charge
    with :class:`CounterOverflowError`.

    >>> stays_exact(MAX_COUNTER - 1, 0, 1, inline=True), stays_exact(MAX_COUNTER, 0, 1, inline=True)
    (True, False)
    >>> stays_exact(MAX_COUNTER, 1, -1, inline=False)
    True
    >>> stays_exact(MAX_COUNTER + 1, -2, 0, inline=True)  # the total fits, a part does not
    False
    """
    if inline:
        committed += amount
    else:
        in_flight += amount
    return (
        -MAX_COUNTER <= committed <= MAX_COUNTER
        and -MAX_COUNTER <= in_flight <= MAX_COUNTER
        and -MAX_COUNTER <= committed + in_flight <= MAX_COUNTER
    )


def apply_problem(key: str, committed: int, in_flight: int, amount: int) -> str | None:
    """Why the projection must not commit ``amount`` to counter ``key`` (None: it may).

    ``in_flight`` is the counter's in-flight total without the event's own
    entry (the apply moves that one out). The committed part stays in the exact
    range, and a negative amount (a settlement's or a release's refund) never
    takes the spend below zero: a refund returns what was spent, never more.
    ``lua/apply.lua`` and ``mcpbg_apply`` (sql/) make the same tests before
    their first write; an event that fails one is refused whole.

    >>> apply_problem("k", MAX_COUNTER, 0, 1)
    'k: committed 9007199254740991 + 1 would leave the exact range (at most 9007199254740991)'
    >>> apply_problem("k", 5, 0, -6), apply_problem("k", 5, 0, -5)
    ('k: -6 would take its spend (5) below zero', None)
    """
    total = committed + amount
    if total > MAX_COUNTER or total < -MAX_COUNTER:
        return (
            f"{key}: committed {committed} + {amount} would leave the exact range "
            f"(at most {MAX_COUNTER})"
        )
    if amount < 0 and total + in_flight < 0:
        return f"{key}: {amount} would take its spend ({committed + in_flight}) below zero"
    return None


def grant_problem(key: str, grant: int, amount: int) -> str | None:
    """Why a grant of ``amount`` must not be added to counter ``key``'s ``grant`` (None: ok).

    >>> grant_problem("k", MAX_COUNTER, 1)
    'k: grant 9007199254740991 + 1 would leave the exact range (at most 9007199254740991)'
    """
    if grant + amount > MAX_COUNTER:
        bound = MAX_COUNTER
        return f"{key}: grant {grant} + {amount} would leave the exact range (at most {bound})"
    return None


class SumCheck:
    """The stores' sum rule (:func:`apply_problem`, :func:`grant_problem`) and reservation
    rule (:class:`Holds`) over a ledger
    read from its start, for the readers that total it without a store (the ledger
    view of ``mcpbg replay``, ``costs``, FOCUS): an event a store would refuse is
    refused here too, so their totals are the counters'.

    No in-flight part: the ledger alone is read.

    >>> check = SumCheck()
    >>> e = AppliedEvent(0, "a", 0.0, (AppliedCharge("k", MAX_COUNTER, 1),))
    >>> check.refusal(e) is None
    True
    >>> check.refusal(AppliedEvent(1, "b", 0.0, (AppliedCharge("k", 1, 1),)))[:35]
    'k: committed 9007199254740991 + 1 w'

    """

    def __init__(self) -> None:
        self.committed: dict[str, int] = {}
        self.grants: dict[str, int] = {}
        self.holds = Holds()
        self.spent: set[str] = set()

    def refusal(self, event: AppliedEvent) -> str | None:
        """Why a store would refuse ``event`` after the events seen so far (None: it
        applies, and is counted)."""
        why = self.holds.problem(event)
        if why is not None:
            return why
        for once, _ in event.spent:  # a one-time id is random: one admission spends it
            if once in self.spent:
                return f"approval {once}: spent already"
        after = dict.fromkeys((c.key for c in event.charges), 0)
        for charge in event.charges:
            now = self.committed.get(charge.key, 0) + after[charge.key]
            why = apply_problem(charge.key, now, 0, charge.amount)
            if why is not None:
                return why
            after[charge.key] += charge.amount
        grants: dict[str, int] = {}
        for change in event.changes:
            if change.kind.value not in ("granted", "reset"):
                continue
            was = grants.get(change.key, self.grants.get(change.key, 0))
            if change.kind.value == "reset":
                grants[change.key] = change.amount
                continue
            why = grant_problem(change.key, was, change.amount)
            if why is not None:
                return why
            grants[change.key] = was + change.amount
        for key, amount in after.items():
            self.committed[key] = self.committed.get(key, 0) + amount
        self.grants.update(grants)
        self.holds.apply(event)
        self.spent.update(once for once, _ in event.spent)
        return None


_RESERVATION_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: The kinds whose charges draw on a reservation (``EntryType`` values).
_CLOSING = frozenset({"settled", "released"})


def hold_roles(
    kind: str, reservation: str | None, charges: Sequence[AppliedCharge]
) -> tuple[bool, str | None]:
    """``(opens, closes)`` of :class:`AppliedEvent` for an event of ``kind`` (an
    ``EntryType`` value) naming ``reservation``: a reserved event opens one under
    its own id; a settlement or a release draws on the one it names, and so does
    a recovery that refunds (its lost event was a settlement or a release). A
    name that is no event id draws on none ("").

    >>> c = (AppliedCharge("k", -5, 1),)
    >>> hold_roles("reserved", None, ()), hold_roles("settled", "x y", c)
    ((True, None), (False, ''))
    >>> hold_roles("recovered", None, ()), hold_roles("recovered", None, c)
    ((False, None), (False, ''))
    """
    if kind == "reserved":
        return True, None
    if kind in _CLOSING or (
        kind == "recovered" and (reservation is not None or any(c.amount < 0 for c in charges))
    ):
        named = reservation if reservation and _RESERVATION_ID.fullmatch(reservation) else ""
        return False, named
    return False, None


def hold_problem(
    closes: str, held: Mapping[str, int] | None, charges: Sequence[AppliedCharge]
) -> str | None:
    """Why an event closing reservation ``closes`` must not be applied (None: it may).

    ``held`` is what the store holds of that reservation (counter key ->
    estimate; None: nothing, it was never made, is closed already or its
    counters have expired); ``charges`` the event's charges a store would write
    (those whose counter lives). Money moves only against a reservation the
    ledger holds, and a refund returns at most the estimate held on its
    counter: a settlement or release of another tenant's reservation, of none,
    of one closed already, or past its estimate is refused whole.
    ``lua/apply.lua``, ``mcpbg_apply_held`` (sql/) and :class:`MemoryBackend`
    make the same tests before their first write.

    >>> hold_problem("r", {"k": 5}, (AppliedCharge("k", -5, 1),)) is None
    True
    >>> hold_problem("r", {"k": 5}, (AppliedCharge("k", -6, 1),))
    "k: refund 6 is more than reservation r's estimate (5)"
    >>> hold_problem("r", None, (AppliedCharge("k", 1, 1),))
    'reservation r: not one the ledger holds (never made, closed already or expired)'
    """
    if not charges:
        return None
    if not closes:
        return "data.reservation: names no reservation (its money moves only against one)"
    if held is None:
        why = "never made, closed already or expired"
        return f"reservation {closes}: not one the ledger holds ({why})"
    for c in charges:
        if c.amount < 0:
            estimate = held.get(c.key)
            if estimate is None:
                return f"{c.key}: reservation {closes} holds no estimate on this counter"
            if -c.amount > estimate:
                return (
                    f"{c.key}: refund {-c.amount} is more than reservation {closes}'s "
                    f"estimate ({estimate})"
                )
    return None


class Holds:
    """The open reservations a reader of the ledger holds, for :func:`hold_problem`:
    reservation id -> counter key -> estimate. A reserved event opens one, the
    first event that closes it (applied) removes it whole.

    >>> h = Holds()
    >>> h.problem(AppliedEvent(1, "b", 0.0, (AppliedCharge("k", -1, 9),), closes="a"))[:14]
    'reservation a:'
    >>> h.apply(AppliedEvent(0, "a", 0.0, (AppliedCharge("k", 4, 9),), opens=True))
    >>> h.problem(AppliedEvent(1, "b", 0.0, (AppliedCharge("k", -4, 9),), closes="a"))
    """

    def __init__(self) -> None:
        self.open: dict[str, dict[str, int]] = {}

    def problem(
        self, event: AppliedEvent, charges: Sequence[AppliedCharge] | None = None
    ) -> str | None:
        """Why ``event`` draws on no reservation held (``charges``: its live ones)."""
        if event.closes is None:
            return None
        live = event.charges if charges is None else charges
        return hold_problem(event.closes, self.open.get(event.closes), live)

    def apply(self, event: AppliedEvent, charges: Sequence[AppliedCharge] | None = None) -> None:
        """Record what ``event`` (applied) opens or closes."""
        live = event.charges if charges is None else charges
        if event.opens and live:
            self.open[event.event_id] = {c.key: c.amount for c in live}
        elif event.closes:
            self.open.pop(event.closes, None)


_REFUSED = re.compile(r"mcpbg apply: refused event at offset (\d+): (.+)")


def refused_event(message: str) -> EventRefusedError | None:
    """The refusal a store's apply reported (lua/apply.lua, sql/ ``mcpbg_apply``), or None.

    >>> refused_event("mcpbg apply: refused event at offset 7: k: grant 1 + 2 ...").offset
    7
    """
    found = _REFUSED.search(message)
    if found is None:
        return None
    return EventRefusedError(int(found.group(1)), found.group(2).splitlines()[0])


def overflow(key: str, amount: int) -> CounterOverflowError:
    """The error refusing ``amount`` on counter ``key``, naming the key's limit."""
    parsed = parse_key(key)
    return CounterOverflowError(parsed.limit if parsed else key, amount, key, MAX_COUNTER)


@dataclass(frozen=True, slots=True)
class CounterOp:
    """One counter touched by an atomic charge.

    ``amount`` is added when the whole charge is admitted; ``enforce`` makes
    this counter able to refuse it (per :func:`fits`); ``expire_at`` is the
    absolute expiry (epoch seconds): one per bucket for a window's counter (set
    with its first write, in the same atomic step), moved by every write for a
    session's (:func:`keys.slides`). ``cap`` is the limit's
    default; ``ref`` (when given) lets the backend resolve the counter's
    effective cap (value cap, plan, run-time cap) and add its grant, in the
    same atomic step (``caps.resolve``).
    """

    key: str
    amount: int
    cap: int
    enforce: bool
    expire_at: int
    ref: CapRef | None = None


def with_cost(event_id: str, cost_id: str, first: int) -> str:
    """The event id argument of a charge that admits a call and charges its price in
    one round trip: ops from index ``first`` on hold in-flight amounts of the cost
    event ``cost_id``, those before of the admission ``event_id`` (lua/charge.lua:
    ``"<admission id> <cost id> <j>"``, j counted from 1; event ids hold no space).

    >>> split_cost(with_cost("a1", "c2", 1))
    ('a1', 'c2', 1)
    """
    return f"{event_id} {cost_id} {first + 1}"


def split_cost(argument: str) -> tuple[str, str, int]:
    """:func:`with_cost` read back: (admission id, cost id, index of the first cost op)."""
    event_id, cost_id, j = argument.split(" ")
    return event_id, cost_id, int(j) - 1


def owners(argument: str) -> tuple[str, str | None, int | None]:
    """The events a charge's event id argument names: :func:`split_cost` when it
    names two (a price charged with its admission), else (``argument``, None, None).

    >>> owners("a1"), owners(with_cost("a1", "c2", 1))
    (('a1', None, None), ('a1', 'c2', 1))
    """
    if " " not in argument:
        return argument, None, None
    return split_cost(argument)


class Charge(NamedTuple):
    """One charge, as every backend's ``charge`` receives it, declared once: the
    counters to move (``ops``) and how (:meth:`Backend.charge` says what each
    part means; ``lease``, ``lease_ttl`` and ``ticket`` are the concurrency
    caps' lease id, its time to live in seconds, and a waiting call's place).
    A backend builds it from its keyword arguments and keeps only what its
    technology needs to send it. A tuple, not a frozen dataclass: it is made
    on every check, and a frozen dataclass costs three times as much to make.

    >>> Charge((), op_id="o1").inline_op, Charge((), event_id="e1", op_id="o1").inline_op
    ('o1', None)
    """

    ops: Sequence[CounterOp]
    event_id: str | None = None
    want_used: bool = True
    op_id: str | None = None
    lease: str | None = None
    lease_ttl: float = 0.0
    ticket: str | None = None

    @property
    def inline_op(self) -> str | None:
        """The operation id the store remembers: only an inline charge has one (a
        ledger charge is made idempotent by its event id instead)."""
        return self.op_id if self.event_id is None else None

    def lease_id(self, leases: bool) -> str:
        """The lease id of a charge whose ops take ``leases``; one clear error when
        it has none ("" when it takes no lease).

        >>> Charge(()).lease_id(True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        mcp_budget_governor.errors.InvalidInputError: lease: a charge taking leases needs a ...
        """
        if not leases:
            return ""
        if self.lease is None:
            raise InvalidInputError("lease", None, "a charge taking leases needs a lease id")
        return self.lease

    @property
    def lease_ttl_ms(self) -> int:
        """The lease's time to live as the stores take it: whole milliseconds, at least 1."""
        return max(1, round(self.lease_ttl * 1000))


@dataclass(frozen=True, slots=True)
class ChargeResult:
    """``refused`` is the index of the first refusing op, or -1; ``used`` the totals read;
    ``caps`` (with ``used``) each op's effective cap plus its grant, what ``used``
    was compared with."""

    refused: int
    used: tuple[int, ...]
    caps: tuple[int, ...] = ()

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
    changes: tuple[Change, ...] = ()
    #: A ``reserved`` event: its charges open a reservation under its id (:class:`Holds`).
    opens: bool = False
    #: A closing event (settled, released, a refunding recovery): the reservation it
    #: draws on ("": it names none the ledger could hold); None: it draws on none.
    closes: str | None = None
    #: The one-time approvals an admission spent, ``(one-time id, lapses at)``: the
    #: projection marks each spent (``keys.SPENT_PREFIX``), refusing one spent already.
    spent: tuple[tuple[str, int], ...] = ()

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
    grant: int = 0

    @property
    def used(self) -> int:
        return self.committed + self.in_flight


@runtime_checkable
class Backend(Protocol):
    """Shared counter storage. Every method is one atomic step (one round trip)."""

    async def charge(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
    ) -> ChargeResult:
        """All or nothing: refuse (writing nothing) if any enforcing op does not fit,
        else add every non-zero amount, committed inline when ``event_id`` is None,
        in-flight under ``event_id`` otherwise. ``want_used=False`` lets a backend
        skip returning the totals (``used`` may then be empty).

        ``op_id`` (inline charges): a charge that wrote something remembers it
        for ``keys.OP_HORIZON_SECONDS``, and a charge whose ``op_id`` is
        remembered changes nothing and is admitted (a replay of a charge
        that landed although its reply came too late). Raises
        :class:`CounterOverflowError`, writing nothing, when an op fails
        :func:`stays_exact`."""
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


class ApplyOnly:
    """Base of a :class:`Backend` view that a rebuild replays events into: it only applies.

    A subclass supplies ``apply``, ``has_epoch``, ``mark_ready``, ``state``,
    ``counter_keys`` and ``aclose``; the hot path's ``charge`` and ``usage``
    raise here, as nothing but the rebuild may write through the view
    (``cluster.LostSlots``, the Kafka rebuild's filter).

    >>> import asyncio
    >>> asyncio.run(ApplyOnly().usage(["k"]))
    Traceback (most recent call last):
    NotImplementedError: a rebuild only applies
    """

    async def charge(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
    ) -> ChargeResult:
        raise NotImplementedError("a rebuild only applies")

    async def usage(self, keys: Sequence[str]) -> list[int]:
        raise NotImplementedError("a rebuild only applies")
