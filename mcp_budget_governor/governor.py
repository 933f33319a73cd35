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
import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import admin, admission, changing, planning, reading, recording
from .admission import MAX_WAIT as MAX_WAIT  # importable from here, as before
from .admission import Price
from .backends.base import adapted, epoch_clock
from .caps import Change
from .context import EMPTY, Context
from .counters import Backend
from .decision import NOTHING_METERED, Decision, MeterResult
from .errors import (
    BackendUnavailableError,
    InvalidInputError,
    LimitExceeded,
)
from .holds import Admission, Reservation
from .ledger import EntryType, Ledger, LedgerCharge, LedgerEntry, TokenUsage, new_id
from .limits import Limit
from .memory_backend import MemoryBackend
from .metering import Metering
from .money import check_amount
from .observe import Observer
from .outage import Outage
from .planning import Slot
from .policy import Policy
from .prices import PriceTable
from .shielding import to_the_end

log = logging.getLogger("mcp_budget_governor")


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
        self._prices_seen: dict[Any, Price] = {}  # see admission.price_of

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
        decision, cancelled = await admission.checked(self, ctx, amount, approved, wait)
        if cancelled is not None:  # the caller never gets the decision: its slot back now
            await to_the_end(self.release(decision))
            raise cancelled
        return decision

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
                priced = admission.price_of(self, price)
            elif hold:
                priced = admission.price_of(self, hold, hold=True)
        return Admission(self, ctx, amount, approved, admission.wait_seconds(wait), priced)

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

    def _plan(
        self, ctx: Context, now: float, calls: int = 1, price: Price | None = None
    ) -> planning.Plan:
        """:func:`admission.plan_of`: the check's plan, cached per context and minute."""
        return admission.plan_of(self, ctx, now, calls, price)

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
        return await to_the_end(
            recording.record(
                self.ledger, self.backend, self._outage, functools.partial(admission.charge, self),
                self._detached,
                slots, ctx, kind, usage, now,
                reservation=reservation, want_used=want_used, detach=detach,
            )
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
