"""What a call holds while it runs: concurrency-cap leases and reserved estimates.

:class:`Admission` (``Governor.admitted``) holds a checked call's leases,
renewing them while the block runs and giving them back however it ends;
:class:`Reservation` (``Governor.reserved``) holds an estimate on one limit
and settles it to the actual cost; :class:`Reservations` holds estimates on
several limits at once, all or nothing in one round trip (the integrations'
hard caps).

>>> import asyncio
>>> from mcp_budget_governor import (
...     Context, Governor, Limit, MemoryBackend, Policy, Scope, Unit, Window, usd)
>>> gov = Governor(Policy.of(Limit("spend", cap=usd(1), window=Window.DAY,
...     scope=Scope.USER, unit=Unit.USD_MICROS)), MemoryBackend())
>>> async def reserve_then_settle():
...     async with gov.reserved("spend", usd(0.5), Context(user="u_42")) as held:
...         held.actual = usd(0.2)
...     return await gov.usage("spend", Context(user="u_42"))
>>> asyncio.run(reserve_then_settle())
200000
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import NoReturn, Protocol

from . import admission, planning
from .admission import Admitting, Price
from .context import Context
from .decision import ADMITTED, NOTHING_METERED, Decision, MeterResult
from .errors import LimitExceeded
from .ledger import EntryType, TokenUsage
from .limits import Limit
from .money import check_amount
from .planning import Slot
from .shielding import finished, not_cancelled, to_the_end


class Holding(Admitting, Protocol):
    """What a hold uses of the Governor: its admission, the leases' release and the
    recording of a settlement (``Governor._record``)."""

    async def release(self, decision: Decision) -> None: ...

    async def renew(self, decision: Decision) -> bool: ...

    async def _record(
        self,
        slots: Sequence[Slot],
        ctx: Context,
        kind: EntryType,
        usage: TokenUsage | None,
        now: float,
        *,
        reservation: str | None = None,
        want_used: bool = False,
        detach: bool = False,
    ) -> tuple[int | None, bool, int | None]: ...


log = logging.getLogger("mcp_budget_governor")


class Admission:
    """A call admitted for the duration of a block; see :meth:`Governor.admitted`.

    Entering checks (the decision is what ``check()`` returns: refused or
    admitted, never raising for a refusal); while the block runs a task renews
    the call's concurrency-cap leases every third of ``lease_ttl``; exiting gives
    them back, on success, exception and cancellation alike.

    A cancellation that arrives while entering lets the check end (recorded in
    the ledger), gives the leases back at once and is raised; ``decision`` then
    still tells whether the call had been admitted (it has used its admission).
    """

    def __init__(
        self,
        gov: Holding,
        ctx: Context | None,
        amount: int,
        approved: Sequence[str] = (),
        wait: float = 0.0,
        price: Price | None = None,
    ) -> None:
        self._gov = gov
        self._price = price
        #: Whether the admission charged the call's fixed price (Governor.admitted).
        self.price_charged = False
        self._ctx = ctx
        self._amount = amount
        self._approved = tuple(approved)
        self._wait = wait
        self.decision: Decision | None = None
        self._held: Decision | None = None  # its leases not given back yet
        self._renewer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Decision:
        gov = self._gov
        decision, cancelled = await admission.checked(
            gov, self._ctx, self._amount, self._approved, self._wait, self._price
        )
        self.decision = decision
        price = self._price
        self.price_charged = price is not None and not price.hold and decision.admitted
        if cancelled is not None:  # the block never runs: its slot back now
            await to_the_end(gov.release(decision))
            raise cancelled
        self._held = decision
        if decision.lease is not None:
            self._renewer = asyncio.ensure_future(self._renew(decision))
        return decision

    async def _renew(self, decision: Decision) -> None:
        gov = self._gov
        while True:
            await asyncio.sleep(gov.lease_ttl / 3)
            try:
                if not await gov.renew(decision):
                    log.warning("lease %s expired before its call ended", decision.lease)
            except Exception:  # a failed renewal must not end the call
                log.exception("renewing lease %s failed", decision.lease)

    @property
    def holding(self) -> bool:
        """Whether exiting has anything to give back (a lease, its renewal): a call
        without one may skip the exit's shielded step."""
        held = self._held
        return self._renewer is not None or (held is not None and held.lease is not None)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
        if self._held is not None:
            decision, self._held = self._held, None
            if decision.lease is not None:
                # To its end: a cancelled call still gives its slot back at once.
                await to_the_end(self._gov.release(decision))


class Reservation:
    """An estimate held on a limit while work runs; see :meth:`Governor.reserved`.

    Set ``actual`` to the real cost before the block ends; left unset, the
    estimate stands (the safe direction: an unknown cost is not assumed zero).
    ``release()`` returns the whole estimate, for work that never started.
    With a ledger, every reservation ends with exactly one closing event naming
    it: ``released``, or ``settled`` with the delta (no charges when it is zero).
    Outside a block, :meth:`Governor.reserve` enters and :meth:`settle` exits;
    a reservation settles once, so an explicit settle inside a block wins.
    """

    def __init__(self, gov: Holding, limit: Limit, estimate: int, ctx: Context) -> None:
        self._gov = gov
        self.limit = limit
        self.estimate = estimate
        self.ctx = ctx
        self.actual: int | None = None
        self.decision: Decision | None = None
        self.id: str | None = None
        self._slot: Slot | None = None
        self._released = False
        self._settled = False

    @property
    def settled(self) -> bool:
        """Whether the reservation has been settled (or released)."""
        return self._settled

    @property
    def limit_name(self) -> str:
        return self.limit.name

    @property
    def amount(self) -> int:
        """The estimate held."""
        return self.estimate

    @property
    def context(self) -> Context:
        return self.ctx

    def release(self) -> None:
        """Return the whole reservation on exit (the work did not happen)."""
        self._released = True

    async def __aenter__(self) -> Reservation:
        await not_cancelled()  # cancelled before it: nothing held
        (self.decision, event_id, slots), cancelled = await finished(
            _hold(self._gov, self.ctx, ((self.limit, self.estimate),))
        )
        if slots:
            (self._slot,) = slots
            self.id = event_id
        if cancelled is not None:  # the caller never holds it: released at once
            await _given_back(self, cancelled)
        if not self.decision.admitted:
            raise LimitExceeded(self.decision)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._finish(report=False)

    async def settle(self, actual: int) -> MeterResult:
        """Settle to ``actual`` now (see :meth:`Governor.settle`); reports the limit's total."""
        if not self._settled:
            self.actual = check_amount(actual, "actual")
        return await self._finish(report=True)

    async def _finish(self, *, report: bool) -> MeterResult:
        """Settle or release once; ``report``: read the total even when nothing changes."""
        if self._slot is None or self._settled:
            return NOTHING_METERED
        if self._released:
            final, kind = 0, EntryType.RELEASED
        elif self.actual is None:  # the estimate stands as the charge: a zero delta
            final, kind = self.estimate, EntryType.SETTLED
        else:
            final, kind = check_amount(self.actual, "actual"), EntryType.SETTLED
        self._settled = True
        s = self._slot.with_amount(final - self.estimate)
        # Every reservation ends with one closing event, so the ledger can tell a
        # closed one from an open one; a zero delta with no ledger has nothing to do.
        if s.amount == 0 and self._gov.ledger is None and not report:
            return NOTHING_METERED
        before, degraded, cap = await self._gov._record(
            (s,), self.ctx, kind, None, self._gov._clock(), reservation=self.id, want_used=report
        )
        return planning.metered(s, before, degraded=degraded, cap=cap)


class Reservations:
    """Estimates held on several limits at once, for one call's hard caps.

    Entering reserves every estimate in one charge, all or nothing, as one
    ``reserved`` event (raising :class:`LimitExceeded` when one does not fit:
    nothing is held then, so two calls near their caps cannot each hold part
    and refuse the other). ``actual[limit]`` is what the call cost on that
    limit (a limit left out keeps its estimate); exiting settles every limit
    in one charge and one closing event naming the reservation, ``settled``
    with the non-zero deltas (none: no charges), or ``released`` after
    :meth:`release`.
    """

    def __init__(self, gov: Holding, estimates: Mapping[str, int], ctx: Context) -> None:
        self._gov = gov
        self.estimates = {
            name: check_amount(amount, f"estimate for {name!r}")
            for name, amount in estimates.items()
        }
        self.ctx = ctx
        self.actual: dict[str, int] = {}
        self.decision: Decision | None = None
        self.id: str | None = None
        self._slots: tuple[Slot, ...] = ()
        self._released = False
        self._settled = False

    @classmethod
    def taken(
        cls, gov: Holding, estimates: Mapping[str, int], ctx: Context, decision: Decision
    ) -> Reservations:
        """The reservation an admission made with ``hold=`` (``decision.held``): held
        already, settled on exit like one entered here."""
        held = cls(gov, estimates, ctx)
        held.decision = decision
        held.id, held._slots = decision.held
        return held

    @property
    def limit_names(self) -> frozenset[str]:
        return frozenset(self.estimates)

    def release(self) -> None:
        """Return every estimate on exit (the work did not happen)."""
        self._released = True

    async def __aenter__(self) -> Reservations:
        await not_cancelled()  # cancelled before it: nothing held
        policy = self._gov.policy
        wanted = tuple(
            (planning.metered_limit(policy, name), estimate)
            for name, estimate in self.estimates.items()
        )
        (self.decision, event_id, slots), cancelled = await finished(
            _hold(self._gov, self.ctx, wanted)
        )
        self._slots = slots
        self.id = event_id
        if cancelled is not None:  # the caller never holds them: released at once
            await _given_back(self, cancelled)
        if not self.decision.admitted:
            raise LimitExceeded(self.decision)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._slots or self._settled:
            return
        self._settled = True
        kind = EntryType.RELEASED if self._released else EntryType.SETTLED
        deltas = []
        for s in self._slots:
            final = 0 if self._released else self.actual.get(s.limit.name, s.amount)
            delta = check_amount(final, f"actual for {s.limit.name!r}") - s.amount
            if delta:
                deltas.append(s.with_amount(delta))
        gov = self._gov
        if not deltas and gov.ledger is None:
            return  # every estimate stands and nothing records the close
        # After the call, off its response's path: the charge is written at once on the
        # shared connection (this process's next command reaches the store after it)
        # and its reply is awaited in the background; the ledger event is appended
        # before this returns (the durable point), as meter_behind does.
        await gov._record(
            tuple(deltas), self.ctx, kind, None, gov._clock(), reservation=self.id, detach=True
        )


async def _given_back(held: Reservation | Reservations, cancelled: BaseException) -> NoReturn:
    """A reservation whose caller was cancelled while it was made: every estimate
    it holds is released (one ``released`` event), then the cancellation raised."""
    held.release()
    await to_the_end(held.__aexit__(None, None, None))
    raise cancelled


async def _hold(
    gov: Holding, ctx: Context, wanted: Sequence[tuple[Limit, int]]
) -> tuple[Decision, str | None, tuple[Slot, ...]]:
    """Reserve each (limit, estimate) of ``wanted`` that applies to ``ctx`` in one charge,
    all or nothing, as one ``reserved`` event: the decision, the event's id and the
    slots held (none when refused, or when no limit applies)."""
    now = gov._clock()
    found = []
    for limit, estimate in wanted:
        enforce = planning.enforces(limit)
        s = planning.slot(
            limit, ctx, now, gov.policy.tz, estimate, enforce=enforce, policy=gov.policy
        )
        if s is not None:
            found.append(s)
    slots = tuple(found)
    if not slots:
        return ADMITTED, None, ()
    decision, event_id = await admission.admit(
        gov, planning.Plan.of(slots), ctx, now, EntryType.RESERVED
    )
    return decision, event_id, slots if decision.admitted else ()
