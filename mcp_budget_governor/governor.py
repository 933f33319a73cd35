"""The Governor: check before the work, meter after it.

>>> import asyncio
>>> from mcp_budget_governor import (
...     Context, Governor, Limit, MemoryBackend, Policy, Scope, Window)
>>> gov = Governor(
...     Policy.of(Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER)),
...     MemoryBackend(),
... )
>>> async def three_calls():
...     return [(await gov.check(Context(user="u_42"))).status for _ in range(3)]
>>> asyncio.run(three_calls())
[200, 200, 429]
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from . import admin, changing, planning, reading, recording
from .approval import Approval, spend_op
from .backends.base import adapted, epoch_clock
from .caps import Change
from .context import EMPTY, Context, cacheable
from .counters import Backend, ChargeResult, CounterOp, with_cost
from .decision import ADMITTED, NOTHING_METERED, Decision, Lease, MeterResult
from .errors import (
    BackendBusyError,
    BackendUnavailableError,
    InvalidInputError,
    LimitExceeded,
)
from .holds import Admission, Reservation
from .ledger import EntryType, Ledger, LedgerCharge, LedgerEntry, TokenUsage, new_id
from .limits import Limit, OnExceed
from .memory_backend import MemoryBackend
from .metering import Metering
from .money import check_amount
from .observe import Observer
from .outage import Outage
from .planning import Slot
from .policy import Policy
from .prices import PriceTable
from .shielding import finished, not_cancelled, to_the_end

log = logging.getLogger("mcp_budget_governor")


@dataclasses.dataclass(frozen=True, slots=True)
class Price:
    """What an admission charges beyond the check, as the plan cache keys it: a fixed
    price, or (``hold``) a hard cap's estimates; (limit name, amount) pairs, validated."""

    pairs: tuple[tuple[str, int], ...]
    hold: bool = False


class Governor(Metering[MeterResult]):
    """Enforces a :class:`Policy` on shared counters.

    - ``backend``: :class:`RedisBackend` (shared by every replica) or
      :class:`MemoryBackend` (one process, the default).
    - ``ledger``: None commits every charge inline, in the same script that
      checks it. With a ledger, the hot path writes in-flight amounts and
      appends one entry per operation; the stream projection commits them.
    - ``prices``: needed by :meth:`meter_tokens` on USD limits.
    - ``retry_interval``: after the backend fails, how long (seconds) to use
      the fail modes before trying it again.
    - ``lease_ttl``: how long (seconds) a concurrency-cap lease outlives a
      process that died holding it; :meth:`admitted` renews a running call's
      lease every third of it.
    - ``observer``: told every decision (:mod:`.observe`: refusal logs;
      ``integrations.otel.Telemetry``: OpenTelemetry metrics and spans). None
      (the default) costs one ``is not None`` test per check.
    - ``clock``: epoch seconds, or an aware ``datetime`` (mcp-budget-governor
      0.1.0's clocks); a :class:`MemoryBackend` made without a clock follows it.
    - ``local_fallback=False``: no limit keeps a process-local counter while the
      backend is down (as if every ``Limit`` said so): fail-open limits admit.
    - ``backend`` may also be one written to mcp-budget-governor 0.1.0's protocol
      (``consume``/``accumulate``/``release``/``peek``/``close``): it is driven
      through ``backends.base.KeyValueAdapter``, without a ledger.
    """

    _keyed_only = True

    def __init__(
        self,
        policy: Policy,
        backend: Backend | None = None,
        *,
        ledger: Ledger | None = None,
        prices: PriceTable | None = None,
        clock: Callable[[], Any] | None = time.time,
        retry_interval: float = 1.0,
        max_pending: int = 100_000,
        lease_ttl: float = 30.0,
        observer: Observer | None = None,
        local_fallback: bool = True,
    ) -> None:
        if not isinstance(policy, Policy):
            raise InvalidInputError("policy", policy, "expected a Policy (use Policy.of(...))")
        if clock is not time.time:
            clock = epoch_clock(clock)  # None, or a datetime clock: epoch seconds
            adopt = getattr(backend, "adopt_clock", None)
            if adopt is not None:
                adopt(clock)
        backend = adapted(backend, clock)
        self._local_fallback = local_fallback
        policy = self._fallback_policy(policy)
        if (
            isinstance(lease_ttl, bool)
            or not isinstance(lease_ttl, int | float)
            or not 0.01 <= lease_ttl <= 86_400
        ):
            raise InvalidInputError("lease_ttl", lease_ttl, "expected seconds from 0.01 to 86400")
        self.lease_ttl = float(lease_ttl)
        self.policy = policy
        self.backend: Backend = MemoryBackend(clock=clock) if backend is None else backend
        self.ledger = ledger
        self.prices = prices
        self._clock = clock
        self._retry_interval = retry_interval
        # The degraded mode: fail modes, the local fallback, outage charges kept.
        self._outage = Outage(
            clock=clock,
            retry_interval=retry_interval,
            max_pending=max_pending,
            local_fallback=local_fallback,
        )
        self._plans: dict[tuple[Context, int, int], planning.Plan] = {}
        # Plans (by id; the value keeps the id theirs) whose last check was refused:
        # their next check encodes no admitted event ahead, likely to be thrown away.
        self._refused: dict[int, planning.Plan] = {}
        self._obs = observer
        if observer is not None:
            observer.attach(self)
        self._detached: set[asyncio.Future[None]] = set()  # meter_behind's replies
        self._prices_seen: dict[Any, Price] = {}  # see _price

    def replace_policy(self, policy: Policy) -> Policy:
        """Govern every call from now on by ``policy`` (a reload); returns the old one.

        Calls already past their check keep what they were admitted under: a
        reservation settles or releases on the counter it was admitted against,
        even when the new policy changes or drops its limit, so held spend is
        never lost. A limit kept by name keeps its counters (a lower cap refuses
        the next call, nothing is taken back); a changed window, scope, time
        zone or billing day counts in other keys from the next call on. Meters
        naming a dropped limit raise :class:`PolicyError` like any unknown limit.
        """
        if not isinstance(policy, Policy):
            raise InvalidInputError("policy", policy, "expected a Policy (use Policy.of(...))")
        old, self.policy = self.policy, self._fallback_policy(policy)
        self._plans.clear()  # plans hold limits and caps of the old policy
        self._prices_seen.clear()  # validated against the old policy's limits
        return old

    def _fallback_policy(self, policy: Policy) -> Policy:
        """``policy`` with ``local_fallback=False`` on every limit when the governor says so."""
        if self._local_fallback or not any(lim.local_fallback for lim in policy.limits):
            return policy
        limits = []
        for lim in policy.limits:  # validated already: copied, not built again
            lim = copy.copy(lim)
            object.__setattr__(lim, "local_fallback", False)
            limits.append(lim)
        return dataclasses.replace(policy, limits=tuple(limits))

    @property
    def degraded(self) -> bool:
        """Whether the shared counters are marked unreachable (fail modes decide)."""
        return self._outage.degraded

    @property
    def pending_charges(self) -> int:
        """Outage charges (inline mode) kept for the counters, replayed when they answer."""
        return len(self._outage.pending)

    # -- the hot path -------------------------------------------------------

    async def check(
        self,
        ctx: Context | None = None,
        *,
        amount: int = 1,
        approved: Sequence[str] = (),
        wait: float = 0,
    ) -> Decision:
        """Admit or refuse a call, charging every gated limit all or nothing.

        A refusal charges nothing anywhere. One backend round trip, however
        many limits apply. ``amount`` is how many calls this one counts as on
        gated CALLS limits (spend and token limits are read, whatever it is).
        ``approved`` names ``OnExceed.ASK`` limits the user let this call go
        over: they count it without refusing, and the ledger records the approval.
        A name given as an :class:`~mcp_budget_governor.approval.Approval` is
        spent with the admission, in the same atomic charge: spent already, lapsed,
        or with the counters unreachable, the call is checked as if unapproved.
        ``wait``: seconds a call refused by a full concurrency cap may wait for a
        slot, first come, first served across replicas (lua/lib.lua
        ``waiters_ahead``); past it, the refusal (429, retry hint). Use it through
        :meth:`admitted`, which gives the slot back.

        Cancelled once its charge has been sent, the check still runs to its end
        (ledger event appended), its leases are given back at once, and the
        cancellation is raised; cancelled before (an anyio scope cancelled already),
        nothing is sent.
        """
        decision, cancelled = await self._checked(ctx, amount, approved, wait)
        if cancelled is not None:  # the caller never gets the decision: its slot back now
            await to_the_end(self.release(decision))
            raise cancelled
        return decision

    async def _checked(
        self,
        ctx: Context | None,
        amount: int,
        approved: Sequence[str],
        wait: float,
        price: Price | None = None,
    ) -> tuple[Decision, asyncio.CancelledError | None]:
        """:meth:`check` run to its end whatever instant a cancellation arrives: the
        decision (the admission recorded in the ledger, its lease still held) and the
        cancellation, for the caller to settle the decision and raise it. A waiting
        call gives up its place in the queues as the cancellation arrives."""
        await not_cancelled()  # a caller cancelled before its check: nothing to settle
        gave_up: asyncio.Event | None = asyncio.Event() if wait else None
        if self._obs is not None:
            check: Any = (
                functools.partial(self._check, wait=wait, gave_up=gave_up, price=price)
                if wait or price
                else self._check
            )
            step = self._obs.observe_check(check, ctx, amount, approved)
        else:
            step = self._check(ctx, amount, approved, wait, gave_up, price)
        return await finished(step, None if gave_up is None else gave_up.set)

    async def _check(
        self,
        ctx: Context | None,
        amount: int,
        approved: Sequence[str],
        wait: float = 0,
        gave_up: asyncio.Event | None = None,
        price: Price | None = None,
    ) -> Decision:
        """:meth:`check` without its observer."""
        if amount.__class__ is not int or amount != 1:
            check_amount(amount, "amount")
        ctx = ctx or EMPTY
        if wait:
            return await self._check_waiting(
                ctx, amount, approved, _wait_seconds(wait), gave_up or asyncio.Event(), price
            )
        now = self._clock()
        if approved:
            allowed = self._approvable(approved)
            plan = _spending(self._fresh_plan(ctx, now, amount, allowed, price), approved, now)
            decision, _ = (
                (_SPENT, None)
                if plan is None
                else await self._admit(plan, ctx, now, EntryType.ADMITTED, approved=_names(allowed))
            )
            if decision is _SPENT:  # used already, or lapsed: the call as if unapproved
                return await self._check(ctx, amount, (), price=price)
            return decision
        plan = self._plan(ctx, now, amount, price)
        if self.ledger is None and not plan.slots:
            return ADMITTED
        decision, _ = await self._admit(plan, ctx, now, EntryType.ADMITTED)
        return decision

    async def _check_waiting(
        self,
        ctx: Context,
        amount: int,
        approved: Sequence[str],
        wait: float,
        gave_up: asyncio.Event,
        price: Price | None = None,
    ) -> Decision:
        """:meth:`check` retried while a concurrency cap refuses, holding a place in
        the caps' queues: a slot that frees goes to the oldest waiter, on every
        replica (the scripts admit nobody else while it waits ahead). The retries
        back off from 5 ms to 100 ms; only the outcome reaches the ledger. ``gave_up``
        set (the caller was cancelled) ends the wait at once: the attempt under way
        ends, and a refused waiter leaves the queues."""
        allowed = self._approvable(approved) if approved else frozenset()
        ticket = f"{new_id()}/{math.ceil(wait * 1000)}"
        deadline = time.monotonic() + wait
        delay = 0.005
        while True:
            now = self._clock()
            if allowed:
                spending = _spending(
                    self._fresh_plan(ctx, now, amount, allowed, price), approved, now
                )
                if spending is None:  # lapsed: wait as if unapproved
                    return await self._check_waiting(
                        ctx, amount, (), _left(deadline), gave_up, price
                    )
                plan = spending
            else:
                plan = self._plan(ctx, now, amount, price)
            decision, event_id = await self._admit(
                plan, ctx, now, EntryType.ADMITTED, approved=_names(allowed),
                ticket=ticket if plan.leases else None, record_refusal=False,
            )  # fmt: skip
            if decision is _SPENT:  # used already: wait as if unapproved
                await self._leave(plan.leases, ticket)
                return await self._check_waiting(ctx, amount, (), _left(deadline), gave_up, price)
            if decision.admitted:
                return decision
            left = deadline - time.monotonic()
            full = decision.limit is not None and self.policy[decision.limit].concurrent
            ended = left <= 0 or gave_up.is_set() or decision.status == 503
            if ended or not plan.leases or not full:
                await self._leave(plan.leases, ticket)
                if event_id is not None:  # the one refusal the ledger records
                    await self._log(event_id, EntryType.ADMITTED, now, ctx, plan, decision, ())
                return decision
            with contextlib.suppress(TimeoutError):  # slept, unless the caller gave up
                await asyncio.wait_for(gave_up.wait(), min(delay, left))
            delay = min(delay * 2, 0.1)

    async def _leave(self, leases: Sequence[str], ticket: str) -> None:
        """Take a waiting call that gives up out of the queues (else its place
        holds until its wait ends)."""
        if not leases:
            return
        await self._outage.fallback.leave(leases, ticket)
        try:
            await self.backend.leave(leases, ticket)  # type: ignore[attr-defined]
        except BackendUnavailableError:
            log.warning("waiting ticket %s left queued (counters unreachable)", ticket)

    def _approvable(self, approved: Sequence[str]) -> frozenset[str]:
        for name in approved:
            if self.policy[name].on_exceed is not OnExceed.ASK:
                raise InvalidInputError(
                    "approved", name, "only an on_exceed=ASK limit can be approved"
                )
        return frozenset(approved)

    def admitted(
        self,
        ctx: Context | None = None,
        *,
        amount: int = 1,
        approved: Sequence[str] = (),
        wait: float = 0,
        price: Mapping[str, int] | None = None,
        hold: Mapping[str, int] | None = None,
    ) -> Admission:
        """:meth:`check` for the duration of a block: concurrency-cap leases the call
        takes are renewed while it runs and given back on exit, however it ends.
        ``wait``: seconds to wait for a concurrency slot (see :meth:`check`).

        ``price`` (``{limit: amount}``, validated): the call's fixed price, charged
        by the admission itself, in the same round trip and all or nothing, when the
        backend can (:attr:`prices_at_admission`; then ``Admission.price_charged``).
        The ledger still gets two events, the admission and a ``metered`` cost event
        with the price. A limit the check consults refuses a price that does not fit
        (so concurrent calls never take it past its cap); a metered-only limit is
        charged as a meter would. Once admitted, the price is paid, whatever the
        call does next: nothing is left to meter for it.

        ``hold`` (``{limit: amount}``, instead of ``price``): a hard cap's estimates,
        reserved by the admission in the same round trip (a ``reserved`` event after
        the admission's), refused when one does not fit; ``Admission.held`` is then
        the reservation's (event id, slots), which the caller settles.

        ``async with gov.admitted(ctx) as decision: decision.raise_for_status(); ...``
        (a refused decision holds no lease).
        """
        priced = None
        if self.prices_at_admission:
            if price:
                priced = self._price(price)
            elif hold:
                priced = self._price(hold, hold=True)
        return Admission(self, ctx, amount, approved, _wait_seconds(wait), priced)

    def _price(self, price: Mapping[str, int], *, hold: bool = False) -> Price | None:
        """``price`` validated whole before anything is charged (an unknown limit raises
        PolicyError), its zero amounts left out, hashable (the plan cache keys on it);
        a tool's price is validated once per policy, not once per call."""
        given: Any = None
        known = None
        if isinstance(price, Mapping):
            # Keyed by type too: True == 1, and a bool is no amount.
            given = (hold, *((k, v.__class__, v) for k, v in price.items()))
            try:
                known = self._prices_seen.get(given)
            except TypeError:  # an unhashable amount: invalid, said below
                given = None
        if known is None:
            valid = planning.charge_pairs(self.policy, price)
            known = Price(tuple((lim.name, n) for lim, n in valid if n), hold)
            if given is not None:
                if len(self._prices_seen) >= 1024:
                    self._prices_seen.clear()
                self._prices_seen[given] = known
        return known if known.pairs else None

    @property
    def prices_at_admission(self) -> bool:
        """Whether :meth:`admitted` charges a fixed price in its admission's round trip
        (the backend writes one charge under two event ids, lua/charge.lua); else
        the integrations meter it after the call."""
        return bool(getattr(self.backend, "prices_at_admission", False))

    async def release(self, decision: Decision) -> None:
        """Give back the concurrency-cap leases of an admitted ``decision`` (from
        :meth:`check`); a no-op without leases or when given back already. Never
        raises for unreachable counters: the lease then expires after ``lease_ttl``."""
        lease = decision.lease
        if lease is None:
            return
        await self._outage.fallback.release(lease.keys, lease.id)
        try:
            await self.backend.release(lease.keys, lease.id)  # type: ignore[attr-defined]
        except BackendUnavailableError:
            log.warning("leases %s not given back (counters unreachable): expire in %.0fs",
                        lease.id, self.lease_ttl)  # fmt: skip

    async def renew(self, decision: Decision) -> bool:
        """Extend the leases of ``decision`` by ``lease_ttl`` from now; False when one
        had already expired (its slot may belong to another call now)."""
        lease = decision.lease
        if lease is None:
            return True
        await self._outage.fallback.renew(lease.keys, lease.id, self.lease_ttl)
        try:
            n = await self.backend.renew(lease.keys, lease.id, self.lease_ttl)  # type: ignore[attr-defined]
        except BackendUnavailableError:
            return False
        return int(n) == len(lease.keys)

    async def identified(self, ctx: Context) -> Context:
        """:meth:`Policy.identified` for a caller, with a refusal recorded in the ledger.

        Integrations call this with what their ``identify`` produced: an
        unnamed caller is shared in the anonymous bucket or refused (status
        403), as the policy says, and a refusal is a ``rejected`` event like
        any other, so the ledger shows who was turned away and why.
        """
        try:
            return self.policy.identified(ctx)
        except LimitExceeded as exc:
            if self.ledger is not None:
                d = exc.decision
                await self._append(
                    new_id(), EntryType.REJECTED, self._clock(), ctx, (),
                    limit=d.limit, status=d.status, over=d.over, degraded=False,
                )  # fmt: skip
            raise

    def reserved(self, limit: str, estimate: int, ctx: Context | None = None) -> Reservation:
        """Reserve ``estimate`` on ``limit`` for the duration of a block; settle on exit.

        ``async with gov.reserved("spend", usd(0.05), ctx) as r: ... r.actual = cost``.
        Entering raises :class:`LimitExceeded` when the estimate does not fit.
        """
        lim = planning.metered_limit(self.policy, limit)
        planning.require_keyed((lim,), ctx or EMPTY)  # a hold on no counter holds nothing
        return Reservation(
            self,
            lim,
            check_amount(estimate, "estimate"),
            ctx or EMPTY,
        )

    async def reserve(self, limit: str, estimate: int, ctx: Context | None = None) -> Reservation:
        """Hold ``estimate`` on ``limit`` until :meth:`settle`: :meth:`reserved` without
        the block. Raises :class:`LimitExceeded` when the estimate does not fit."""
        reservation = self.reserved(limit, estimate, ctx)
        await reservation.__aenter__()
        return reservation

    async def settle(self, reservation: Reservation, actual: int) -> MeterResult:
        """Settle ``reservation`` to the real cost ``actual`` (never refused: the money is
        spent). A reservation settles once; settling it again changes nothing."""
        return await reservation.settle(actual)

    async def usage(self, limit: str, ctx: Context | None = None) -> int:
        """What ``limit`` has counted in the current window for ``ctx`` (committed + in-flight)."""
        return await reading.usage(self.backend, self._outage, self._read_slot(limit, ctx or EMPTY))

    async def is_tripped(self, limit: str, ctx: Context | None = None) -> bool:
        """Whether ``limit`` is exhausted for ``ctx`` (its total has reached the cap), so
        ``check()`` refuses; read only, one round trip.

        With the counters unreachable, a fail-closed limit raises
        :class:`BackendUnavailableError`; a fail-open one reads its local
        fallback (not tripped without one).
        """
        s = self._read_slot(limit, ctx or EMPTY)
        return await reading.is_tripped(self.backend, self._outage, s)

    async def status(self, ctx: Context | None = None) -> dict[str, dict[str, int | bool | None]]:
        """Usage of every limit whose scope ``ctx`` supplies, in one read-only round trip.

        Per limit name: ``total``, ``cap`` (the effective cap: value cap, plan or
        run-time cap, plus this period's grants), ``remaining`` (before exhausted),
        ``exceeded`` (the cap is reached) and ``resets_in`` (seconds; None for
        a session window). Writes nothing and appends no ledger event. With the
        counters unreachable, fail modes apply as in :meth:`is_tripped`; a
        limit without an answer is left out.
        """
        now = self._clock()
        return await reading.status(self.policy, self.backend, self._outage, ctx or EMPTY, now)

    def _read_slot(self, limit: str, ctx: Context) -> Slot:
        return reading.slot_of(self.policy, limit, ctx, self._clock())

    async def _read(self, slots: Sequence[Slot]) -> list[tuple[int | None, int]]:
        return await reading.read(self.backend, self._outage, slots)

    async def aclose(self) -> None:
        """Flush what can be flushed and close the backend and ledger."""
        if self._detached:  # replies of charges metered without waiting
            await asyncio.gather(*list(self._detached), return_exceptions=True)
        try:
            await self._outage.flush(self.backend)
        except BackendUnavailableError:
            unsent = len(self._outage.pending)
            log.error("closing with %d unsent charges: the backend is unreachable", unsent)
        if self.ledger is not None:
            await self.ledger.aclose()
        await self.backend.aclose()

    async def close(self) -> None:
        """:meth:`aclose`, under the name mcp-budget-governor 0.1.0 used."""
        await self.aclose()

    async def __aenter__(self) -> Governor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- run-time changes (caps per customer) ------------------------------

    async def set_cap(
        self,
        limit: str,
        cap: int,
        *,
        until: Any = None,
        reason: str = "",
        actor: str = "",
        **scope: str,
    ) -> Change:
        """Give one scope value of ``limit`` its own cap at run time (micros for USD
        limits), until ``until`` (a datetime or epoch seconds; None: for good).

        Beats the policy's caps and plans (``caps.py``). With a ledger it is an
        event, enforced by every replica once projected; without one it is
        written to the counters store now. ``scope``: ``tenant="acme"`` etc.
        """
        change, ctx = admin.cap_change(
            self.policy,
            limit,
            scope,
            cap,
            until=until,
            now=self._clock(),
            reason=reason,
            actor=actor,
        )
        return await self._apply_change(change, ctx)

    async def unset_cap(
        self, limit: str, *, reason: str = "", actor: str = "", **scope: str
    ) -> Change:
        """Remove a run-time cap: the policy's value cap, plan or default applies again."""
        change, ctx = admin.uncap_change(self.policy, limit, scope, reason=reason, actor=actor)
        return await self._apply_change(change, ctx)

    async def assign_plan(
        self,
        plan: str | None,
        *,
        tenant: str | None = None,
        user: str | None = None,
        reason: str = "",
        actor: str = "",
    ) -> Change:
        """Move a tenant or a user to ``plan`` at run time (None: back to the policy's)."""
        change, ctx = admin.plan_change(
            self.policy, plan, tenant=tenant, user=user, reason=reason, actor=actor
        )
        return await self._apply_change(change, ctx)

    async def grant(
        self, limit: str, amount: int, *, reason: str = "", actor: str = "", **scope: str
    ) -> Change:
        """Extra room of ``amount`` on the current period's counter; spend unchanged."""
        change, ctx = await changing.grant(
            self.policy, self.backend, self._outage, limit, scope, amount,
            now=self._clock(), reason=reason, actor=actor,
        )  # fmt: skip
        return await self._apply_change(change, ctx)

    async def reset(self, limit: str, *, reason: str = "", actor: str = "", **scope: str) -> Change:
        """Restore the current period's room to the cap, keeping the recorded spend: the
        counter's grant becomes what it has spent now (replayed as that same value)."""
        change, ctx = await changing.reset(
            self.policy, self.backend, limit, scope,
            now=self._clock(), reason=reason, actor=actor,
        )  # fmt: skip
        return await self._apply_change(change, ctx)

    async def _apply_change(self, change: Change, ctx: Context) -> Change:
        if await changing.apply(change, ctx, self.ledger, self.backend, self._clock()):
            self._plans.clear()
        return change

    # -- internals ----------------------------------------------------------

    async def _admit(
        self,
        plan: planning.Plan,
        ctx: Context,
        now: float,
        kind: EntryType,
        approved: tuple[str, ...] = (),
        *,
        ticket: str | None = None,
        record_refusal: bool = True,
    ) -> tuple[Decision, str | None]:
        """The admission step of check() and reserved(), one round trip.

        New work the ledger cannot record is refused before anything is
        charged; otherwise the plan is charged all or nothing (each limit's fail
        mode when the backend is down), and the outcome goes to the ledger as
        ``kind`` or as a rejection (not ``record_refusal``: an admission only).
        ``ticket``: a waiting call's place in the concurrency caps' queues.
        Returns the decision and the event id.
        """
        if self.ledger is not None and not getattr(self.ledger, "accepting", True):
            return planning.ledger_full(self._retry_interval), None
        event_id = new_id() if self.ledger is not None else None
        op_id = None if event_id is not None else new_id()
        lease = new_id() if plan.leases else None
        # A fixed price charged with the admission: its in-flight amounts belong to
        # the cost event (its own id), so the projection moves each exactly once.
        cost_id = new_id() if event_id is not None and plan.cost else None
        charged = (
            event_id
            if cost_id is None or event_id is None
            else with_cost(event_id, cost_id, len(plan.slots) - plan.cost)
        )
        ahead: LedgerEntry | None = None
        refused = self._refused
        behind = refused.get(id(plan)) is plan if refused else False
        try:
            sent = None if lease or ticket or behind else self._sent_ahead(plan.ops, charged)
            if sent is not None:
                assert event_id is not None  # (_sent_ahead is None without one)
                # The reply is a round trip away: meanwhile the ledger encodes the
                # event of the common outcome (admitted, nothing over), which
                # _log appends if that is the outcome. Nothing is written yet.
                ahead = LedgerEntry(
                    event_id, kind, now, ctx, plan.charges, None, 200, (), None, False,
                    None, None, approved,
                )  # fmt: skip
                try:
                    self.ledger.prepare(ahead)  # type: ignore[union-attr]
                except Exception:  # an optimisation only: the append encodes as before
                    log.debug("ledger prepare() failed", exc_info=True)
                    ahead = None
                try:
                    result = await sent
                except BackendUnavailableError:
                    self._outage.mark_down()
                    raise
            else:
                # The totals come back in the same reply: they give Decision.remaining.
                result = await self._charge(
                    plan.ops, charged, want_used=True, op_id=op_id, lease=lease, ticket=ticket
                )
        except BackendUnavailableError:
            if len(plan.ops) > len(plan.slots):
                return _SPENT, None  # an approval is spent only where it is counted
            decision = await self._outage.check(
                plan.slots, now, op_id, lease, ticket,
                lease_ttl=self.lease_ttl, ledgered=self.ledger is not None,
            )  # fmt: skip
        except BackendBusyError as exc:  # overload, not an outage: refused, no fail mode
            decision = planning.busy(exc.store, self._retry_interval)
        else:
            ops = plan.ops
            if len(ops) > len(plan.slots):  # an approval's marker came last
                if result.refused >= len(plan.slots):
                    return _SPENT, None
                n = len(plan.slots)
                ops = ops[:n]
                result = ChargeResult(result.refused, result.used[:n], result.caps[:n])
            if result.caps:
                self._outage.saw_caps(ops, result.caps)
            if result.admitted:
                decision = planning.admitted_by(plan, result.used, result.caps)
            else:
                decision = self._decide(plan.slots, result, now)
        if plan.cost and decision.over:
            decision = _not_over_on_price(plan, decision)
        if lease is not None and decision.admitted:
            decision = dataclasses.replace(decision, lease=Lease(lease, plan.leases))
        if event_id is not None and (record_refusal or decision.admitted):
            if (
                ahead is not None
                and decision.admitted
                and decision.limit is None
                and decision.status == 200
                and not decision.over
                and not decision.degraded
            ):
                await self.ledger.append(ahead)  # type: ignore[union-attr]  # the very entry
            else:
                if not decision.admitted:  # encoded twice (ahead, then as refused): no more
                    if len(refused) >= 4096:
                        refused.clear()
                    refused[id(plan)] = plan
                elif behind:
                    refused.pop(id(plan), None)
                await self._log(event_id, kind, now, ctx, plan, decision, approved)
            if cost_id is not None and decision.admitted:  # the price's own event, after
                await self._append(
                    cost_id, EntryType.RESERVED if plan.holds else EntryType.METERED, now,
                    ctx, plan.cost_charges, degraded=decision.degraded,
                )  # fmt: skip
        if plan.holds and decision.admitted:
            held = (cost_id, plan.slots[len(plan.slots) - plan.cost :])
            decision = dataclasses.replace(decision, held=held)
        return decision, event_id

    def _sent_ahead(
        self, ops: Sequence[CounterOp], event_id: str | None
    ) -> Awaitable[ChargeResult] | None:
        """An admission's charge written at once, its reply to await (:func:`recording.sent`),
        when the ledger can prepare its event meanwhile (``prepare``); else None."""
        if event_id is None or getattr(self.ledger, "prepare", None) is None:
            return None
        return recording.sent(self.backend, self._outage, ops, event_id, None, want_used=True)

    async def _log(
        self,
        event_id: str,
        kind: EntryType,
        now: float,
        ctx: Context,
        plan: planning.Plan,
        decision: Decision,
        approved: tuple[str, ...],
    ) -> None:
        """The ledger entry of an admission step: ``kind``, or a rejection."""
        assert self.ledger is not None
        # Built here, positionally: once per call, and keyword passing through
        # _append cost more than the entry itself.
        admitted = decision.admitted
        await self.ledger.append(
            LedgerEntry(
                event_id,
                kind if admitted else EntryType.REJECTED,
                now,
                ctx,
                plan.charges if admitted else (),
                decision.limit,
                decision.status,
                decision.over,
                None,
                decision.degraded,
                None,
                None,
                approved if admitted else (),
            )
        )

    def _decide(self, slots: Sequence[Slot], result: ChargeResult, now: float) -> Decision:
        if result.admitted:
            return planning.admitted(slots, result.used, caps=result.caps)
        remaining = (
            planning.headroom(slots, result.used, charged=False, caps=result.caps)
            if result.used
            else None
        )
        return planning.refused(slots[result.refused], now, remaining=remaining)

    def _plan(
        self, ctx: Context, now: float, calls: int = 1, price: Price | None = None
    ) -> planning.Plan:
        # Planning (buckets, escaped keys, ops) is pure and the same for a whole
        # minute: cache it per context, so a hot caller pays for it once a minute.
        # A context of long ids is planned afresh: the cache stays small in bytes.
        cache_key: tuple[Any, ...] = (
            (ctx, int(now // 60), calls) if price is None else (ctx, int(now // 60), calls, price)
        )
        plan = self._plans.get(cache_key)
        if plan is None:
            plan = self._fresh_plan(ctx, now, calls, frozenset(), price)
            if cacheable(ctx):
                if len(self._plans) >= 4096:
                    self._plans.clear()
                self._plans[cache_key] = plan
        return plan

    def _fresh_plan(
        self,
        ctx: Context,
        now: float,
        calls: int,
        allowed: frozenset[str],
        price: Price | None,
    ) -> planning.Plan:
        """The check's plan, charging ``price`` too (:func:`planning.with_price`)."""
        plan = planning.check_plan(self.policy, ctx, now, calls, allowed)
        if price is None:
            return plan
        pairs = [(self.policy[name], amount) for name, amount in price.pairs]
        return planning.with_price(
            plan,
            planning.meter_slots(pairs, ctx, now, self.policy.tz, self.policy),
            hold=price.hold,
        )

    async def _charge(
        self,
        ops: Sequence[CounterOp],
        event_id: str | None,
        *,
        want_used: bool = True,
        op_id: str | None = None,
        lease: str | None = None,
        ticket: str | None = None,
    ) -> ChargeResult:
        outage = self._outage
        if outage.down_until or outage.pending:  # down, or charges a busy store could not take
            await outage.ready(self.backend)
        try:
            if ticket is not None:  # a call waiting for a concurrency slot
                return await self.backend.charge(  # type: ignore[call-arg]
                    ops, event_id=event_id, want_used=want_used, op_id=op_id,
                    lease=lease, lease_ttl=self.lease_ttl, ticket=ticket,
                )  # fmt: skip
            if lease is not None:  # only a policy with concurrency caps needs leases
                return await self.backend.charge(  # type: ignore[call-arg]
                    ops, event_id=event_id, want_used=want_used, op_id=op_id,
                    lease=lease, lease_ttl=self.lease_ttl,
                )  # fmt: skip
            if op_id is None:  # ledger mode: a Backend predating op_id works as before
                return await self.backend.charge(ops, event_id=event_id, want_used=want_used)
            return await self.backend.charge(
                ops, event_id=event_id, want_used=want_used, op_id=op_id
            )
        except BackendUnavailableError:
            self._outage.mark_down()
            raise

    async def _meter(
        self, charges: Sequence[tuple[Limit, int]], ctx: Context, usage: TokenUsage | None
    ) -> MeterResult:
        now = self._clock()
        slots = planning.meter_slots(charges, ctx, now, self.policy.tz, self.policy)
        if not slots:
            return NOTHING_METERED
        before, degraded, cap = await self._record(
            slots, ctx, EntryType.METERED, usage, now, want_used=True
        )
        result = planning.metered(slots[0], before, degraded=degraded, cap=cap)
        if result.crossed and slots[0].limit.breaker:
            log.warning(
                "breaker %r tripped: %d of %d", result.limit, result.total,
                slots[0].limit.cap, extra={"event": "governor.breaker_tripped"},
            )  # fmt: skip
        return result

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
    ) -> tuple[int | None, bool, int | None]:
        """:func:`recording.record`: the slots charged and appended as one event."""
        return await recording.record(
            self.ledger, self.backend, self._outage, self._charge, self._detached,
            slots, ctx, kind, usage, now,
            reservation=reservation, want_used=want_used, detach=detach,
        )  # fmt: skip

    async def meter_behind(self, charges: Mapping[str, int], ctx: Context | None = None) -> None:
        """:meth:`meter_charges`, without waiting for the counters' reply.

        The charge is written on the backend's shared connection before this
        returns (so the next check of this process reaches Redis after it and
        sees it), and the ledger event is appended as usual; only the round
        trip's reply is awaited in the background (its failure counts locally
        and is kept for later, as a waited one would be). A backend that cannot
        write at once (no coalescing, not connected, marked down) is awaited.
        """
        pairs = planning.charge_pairs(self.policy, charges)
        ctx = ctx or EMPTY
        now = self._clock()
        slots = planning.meter_slots(pairs, ctx, now, self.policy.tz, self.policy)
        if slots:
            await self._record(slots, ctx, EntryType.METERED, None, now, detach=True)

    async def _append(
        self,
        event_id: str,
        kind: EntryType,
        now: float,
        ctx: Context,
        charges: tuple[LedgerCharge, ...],
        **extra: Any,
    ) -> None:
        assert self.ledger is not None
        await self.ledger.append(LedgerEntry(event_id, kind, now, ctx, charges, **extra))


#: The longest a call may wait for a concurrency slot (seconds).
MAX_WAIT = 3600.0


def _wait_seconds(wait: Any) -> float:
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_WAIT:
        raise InvalidInputError("wait", wait, f"expected seconds from 0 to {MAX_WAIT:.0f}")
    return float(wait)


#: What :meth:`Governor._admit` answers when the approval it was to spend was spent
#: already (or cannot be spent: the counters unreachable): nothing was charged.
_SPENT = Decision(admitted=False, reason="approval_spent")


def _spending(plan: planning.Plan, approved: Sequence[str], now: float) -> planning.Plan | None:
    """``plan`` that also spends its one-time approvals (approval.spend_op), in the
    same atomic charge, their markers last; None when one has lapsed. ``now``: the
    governor's clock, which the store's expiries follow."""
    spends = [a for a in approved if isinstance(a, Approval)]
    if not spends:
        return plan
    wall = time.time()  # an approval lapses in real time, whatever the governor's clock
    if any(a.until <= wall for a in spends):
        return None
    lead = now - wall
    return dataclasses.replace(plan, ops=plan.ops + tuple(spend_op(a, lead) for a in spends))


def _not_over_on_price(plan: planning.Plan, decision: Decision) -> Decision:
    """``decision`` without the metered-only limits its price went over: ``over``
    names shadow limits of the check; a price past a metered-only cap is charged,
    as a meter charges it."""
    metered_only = {
        s.limit.name for s in plan.slots[-plan.cost :] if not (s.limit.gated or s.limit.breaker)
    }
    over = tuple(name for name in decision.over if name not in metered_only)
    return decision if over == decision.over else dataclasses.replace(decision, over=over)


def _names(approved: frozenset[str]) -> tuple[str, ...]:
    """The approved limits' names as the ledger records them, sorted; an
    :class:`Approval` kept as such, so its event records the one-time id it spent."""
    return tuple(sorted(approved, key=str))


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
