"""The Governor's admission (``check``, ``admitted``, the reservations' admission): a
call planned, charged all or nothing in one round trip (waiting for a concurrency slot
when asked), decided, and recorded in the ledger. The hot path: each step reads the
governor's state through :class:`Admitting`, so no module here imports the Governor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol

from . import planning, recording
from .approval import Approval, spend_op
from .context import EMPTY, Context, cacheable
from .counters import Backend, Charge, ChargeResult, CounterOp, with_cost
from .decision import ADMITTED, Decision, Lease
from .errors import BackendBusyError, BackendUnavailableError, InvalidInputError
from .ledger import EntryType, Ledger, LedgerEntry, new_id
from .limits import OnExceed
from .money import check_amount
from .observe import Observer
from .outage import Outage
from .planning import Slot
from .policy import Policy
from .shielding import Held, finished, not_cancelled, reply_of

log = logging.getLogger("mcp_budget_governor")


@dataclasses.dataclass(frozen=True, slots=True)
class Price:
    """What an admission charges beyond the check, as the plan cache keys it: a fixed
    price, or (``hold``) a hard cap's estimates; (limit name, amount) pairs, validated."""

    pairs: tuple[tuple[str, int], ...]
    hold: bool = False


class Admitting(Protocol):
    """What the admission reads of the Governor (its state, kept there)."""

    @property
    def policy(self) -> Policy: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def ledger(self) -> Ledger | None: ...
    @property
    def lease_ttl(self) -> float: ...
    @property
    def _outage(self) -> Outage: ...
    @property
    def _obs(self) -> Observer | None: ...
    @property
    def _retry_interval(self) -> float: ...
    @property
    def _plans(self) -> dict[tuple[Any, ...], planning.Plan]: ...
    @property
    def _refused(self) -> dict[int, planning.Plan]: ...
    @property
    def _prices_seen(self) -> dict[Any, Price]: ...

    def _clock(self) -> Any: ...


async def checked(
    gov: Admitting,
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
    if gov.ledger is None and gov._obs is None and not (wait or approved or price):
        written = _written(gov, ctx, amount)
        if written is not None:
            return await _inline(gov, *written)
    gave_up: asyncio.Event | None = asyncio.Event() if wait else None
    if gov._obs is not None:
        check: Any = (
            functools.partial(_check, gov, wait=wait, gave_up=gave_up, price=price)
            if wait or price
            else functools.partial(_check, gov)
        )
        step = gov._obs.observe_check(check, ctx, amount, approved)
    else:
        step = _check(gov, ctx, amount, approved, wait, gave_up, price)
    return await finished(step, None if gave_up is None else gave_up.set)


# The backend classes that write a charge at once and let its caller await the
# reply (charge_held), by whether their charge is the one charge_held writes.
_HOLDING: dict[type, bool] = {}
_HELD = ("charge_held", "charge")


def _holder(backend: Backend) -> Any:
    """``backend.charge_held``, unless ``charge`` is not the charge it writes (a
    subclass or an instance that overrides ``charge``: a wrapper's charge stays in
    the path); else None."""
    kind = backend.__class__
    ok = _HOLDING.get(kind)
    if ok is None:
        owners = [next((k for k in kind.__mro__ if n in k.__dict__), None) for n in _HELD]
        ok = _HOLDING[kind] = owners[0] is not None and owners[0] is owners[1]
    if not ok or "charge" in getattr(backend, "__dict__", ()):
        return None
    return backend.charge_held  # type: ignore[attr-defined]


def _written(
    gov: Admitting, ctx: Context | None, amount: int
) -> tuple[planning.Plan, Context, float, str, Charge, Held[Any]] | None:
    """A plain check without a ledger, its charge written at once (one round trip,
    as :func:`_check` would send it) when the backend can and nothing waits to be
    replayed: what :func:`_inline` needs; else None, and the check runs as a step
    of its own (:func:`finished`). A written charge needs no task to run to its
    end: it reaches the counters whatever its caller does next."""
    hold = _holder(gov.backend)
    outage = gov._outage
    if hold is None or outage.down_until or outage.pending:
        return None
    if amount.__class__ is not int or amount != 1:
        check_amount(amount, "amount")
    ctx = ctx or EMPTY
    now = gov._clock()
    plan = plan_of(gov, ctx, now, amount)
    if not plan.slots or plan.leases:  # nothing to charge, or leases to give back
        return None
    op_id = new_id()
    c = Charge(plan.ops, None, True, op_id)
    reply = hold(c)
    return None if reply is None else (plan, ctx, now, op_id, c, reply)


async def _inline(
    gov: Admitting,
    plan: planning.Plan,
    ctx: Context,
    now: float,
    op_id: str,
    c: Charge,
    reply: Held[Any],
) -> tuple[Decision, asyncio.CancelledError | None]:
    """The rest of a written check in its caller's own task: the reply awaited
    whatever instant a cancellation arrives, then decided. An error (lost scripts,
    an unreachable store) goes through :func:`admit`'s rules, as a step of its own."""
    cancelled = await reply_of(reply)
    try:
        got = gov.backend.held_result(reply, c)  # type: ignore[attr-defined]
    except Exception as exc:  # the reply read: the store lost its state
        got = _raising(exc)
    if isinstance(got, ChargeResult):
        return _decided(gov, plan, got, now), cancelled
    step = admit(gov, plan, ctx, now, EntryType.ADMITTED, written=(op_id, got))
    (decision, _), late = await finished(step)
    return decision, cancelled or late


async def _raising(exc: Exception) -> ChargeResult:
    raise exc


async def _check(
    gov: Admitting,
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
        return await _waiting(
            gov, ctx, amount, approved, wait_seconds(wait), gave_up or asyncio.Event(), price
        )
    now = gov._clock()
    if approved:
        allowed = _approvable(gov, approved)
        plan = _spending(fresh_plan(gov, ctx, now, amount, allowed, price), approved, now)
        decision, _ = (
            (_SPENT, None)
            if plan is None
            else await admit(gov, plan, ctx, now, EntryType.ADMITTED, approved=_names(allowed))
        )
        if decision is _SPENT:  # used already, or lapsed: the call as if unapproved
            return await _check(gov, ctx, amount, (), price=price)
        return decision
    plan = plan_of(gov, ctx, now, amount, price)
    if gov.ledger is None and not plan.slots:
        return ADMITTED
    decision, _ = await admit(gov, plan, ctx, now, EntryType.ADMITTED)
    return decision


async def _waiting(
    gov: Admitting,
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
    allowed = _approvable(gov, approved) if approved else frozenset()
    ticket = f"{new_id()}/{math.ceil(wait * 1000)}"
    deadline = time.monotonic() + wait
    delay = 0.005
    while True:
        now = gov._clock()
        if allowed:
            spending = _spending(fresh_plan(gov, ctx, now, amount, allowed, price), approved, now)
            if spending is None:  # lapsed: wait as if unapproved
                return await _waiting(gov, ctx, amount, (), _left(deadline), gave_up, price)
            plan = spending
        else:
            plan = plan_of(gov, ctx, now, amount, price)
        decision, event_id = await admit(gov,
            plan, ctx, now, EntryType.ADMITTED, approved=_names(allowed),
            ticket=ticket if plan.leases else None, record_refusal=False,
        )  # fmt: skip
        if decision is _SPENT:  # used already: wait as if unapproved
            await _leave(gov, plan.leases, ticket)
            return await _waiting(gov, ctx, amount, (), _left(deadline), gave_up, price)
        if decision.admitted:
            return decision
        left = deadline - time.monotonic()
        full = decision.limit is not None and gov.policy[decision.limit].concurrent
        ended = left <= 0 or gave_up.is_set() or decision.status == 503
        if ended or not plan.leases or not full:
            await _leave(gov, plan.leases, ticket)
            if event_id is not None:  # the one refusal the ledger records
                await logged(gov, event_id, EntryType.ADMITTED, now, ctx, plan, decision, ())
            return decision
        with contextlib.suppress(TimeoutError):  # slept, unless the caller gave up
            await asyncio.wait_for(gave_up.wait(), min(delay, left))
        delay = min(delay * 2, 0.1)


async def _leave(gov: Admitting, leases: Sequence[str], ticket: str) -> None:
    """Take a waiting call that gives up out of the queues (else its place
    holds until its wait ends)."""
    if not leases:
        return
    await gov._outage.fallback.leave(leases, ticket)
    try:
        await gov.backend.leave(leases, ticket)  # type: ignore[attr-defined]
    except BackendUnavailableError:
        log.warning("waiting ticket %s left queued (counters unreachable)", ticket)


def _approvable(gov: Admitting, approved: Sequence[str]) -> frozenset[str]:
    for name in approved:
        if gov.policy[name].on_exceed is not OnExceed.ASK:
            raise InvalidInputError("approved", name, "only an on_exceed=ASK limit can be approved")
    return frozenset(approved)


def price_of(gov: Admitting, price: Mapping[str, int], *, hold: bool = False) -> Price | None:
    """``price`` validated whole before anything is charged (an unknown limit raises
    PolicyError), its zero amounts left out, hashable (the plan cache keys on it);
    a tool's price is validated once per policy, not once per call."""
    given: Any = None
    known = None
    if isinstance(price, Mapping):
        # Keyed by type too: True == 1, and a bool is no amount.
        given = (hold, *((k, v.__class__, v) for k, v in price.items()))
        try:
            known = gov._prices_seen.get(given)
        except TypeError:  # an unhashable amount: invalid, said below
            given = None
    if known is None:
        valid = planning.charge_pairs(gov.policy, price)
        known = Price(tuple((lim.name, n) for lim, n in valid if n), hold)
        if given is not None:
            if len(gov._prices_seen) >= 1024:
                gov._prices_seen.clear()
            gov._prices_seen[given] = known
    return known if known.pairs else None


async def admit(
    gov: Admitting,
    plan: planning.Plan,
    ctx: Context,
    now: float,
    kind: EntryType,
    approved: tuple[str, ...] = (),
    *,
    ticket: str | None = None,
    record_refusal: bool = True,
    written: tuple[str, Awaitable[ChargeResult]] | None = None,
) -> tuple[Decision, str | None]:
    """The admission step of check() and reserved(), one round trip.

    New work the ledger cannot record is refused before anything is
    charged; otherwise the plan is charged all or nothing (each limit's fail
    mode when the backend is down), and the outcome goes to the ledger as
    ``kind`` or as a rejection (not ``record_refusal``: an admission only).
    ``ticket``: a waiting call's place in the concurrency caps' queues.
    ``written``: (operation id, reply) of a charge of the plan written already
    (:func:`_written`, no ledger). Returns the decision and the event id.
    """
    if gov.ledger is not None and not getattr(gov.ledger, "accepting", True):
        return planning.ledger_full(gov._retry_interval), None
    event_id = new_id() if gov.ledger is not None else None
    op_id = None if event_id is not None else new_id() if written is None else written[0]
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
    refused = gov._refused
    behind = refused.get(id(plan)) is plan if refused else False
    try:
        if written is not None:  # sent already (_written): only its reply is left
            sent: Awaitable[ChargeResult] | None = written[1]
        elif lease or ticket or behind:
            sent = None
        else:
            sent = _sent_ahead(gov, plan.ops, charged)
        if sent is not None:
            # The reply is a round trip away: meanwhile the ledger encodes the
            # event of the common outcome (admitted, nothing over), which
            # _log appends if that is the outcome. Nothing is written yet.
            if event_id is not None:
                ahead = LedgerEntry(
                    event_id, kind, now, ctx, plan.charges, None, 200, (), None, False,
                    None, None, approved,
                )  # fmt: skip
                try:
                    gov.ledger.prepare(ahead)  # type: ignore[union-attr]
                except Exception:  # an optimisation only: the append encodes as before
                    log.debug("ledger prepare() failed", exc_info=True)
                    ahead = None
            try:
                result = await sent
            except BackendUnavailableError:
                gov._outage.mark_down()
                raise
        else:
            # The totals come back in the same reply: they give Decision.remaining.
            result = await charge(
                gov, plan.ops, charged, want_used=True, op_id=op_id, lease=lease, ticket=ticket
            )
    except BackendUnavailableError:
        if len(plan.ops) > len(plan.slots):
            return _SPENT, None  # an approval is spent only where it is counted
        decision = await gov._outage.check(
            plan.slots, now, op_id, lease, ticket,
            lease_ttl=gov.lease_ttl, ledgered=gov.ledger is not None,
        )  # fmt: skip
    except BackendBusyError as exc:  # overload, not an outage: refused, no fail mode
        decision = planning.busy(exc.store, gov._retry_interval)
    else:
        decision = _decided(gov, plan, result, now)
        if decision is _SPENT:
            return _SPENT, None
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
            await gov.ledger.append(ahead)  # type: ignore[union-attr]  # the very entry
        else:
            if not decision.admitted:  # encoded twice (ahead, then as refused): no more
                if len(refused) >= 4096:
                    refused.clear()
                refused[id(plan)] = plan
            elif behind:
                refused.pop(id(plan), None)
            await logged(gov, event_id, kind, now, ctx, plan, decision, approved)
        if cost_id is not None and decision.admitted:  # the price's own event, after
            await gov.ledger.append(  # type: ignore[union-attr]
                LedgerEntry(
                    cost_id, EntryType.RESERVED if plan.holds else EntryType.METERED, now,
                    ctx, plan.cost_charges, degraded=decision.degraded,
                )
            )  # fmt: skip
    if plan.holds and decision.admitted:
        held = (cost_id, plan.slots[len(plan.slots) - plan.cost :])
        decision = dataclasses.replace(decision, held=held)
    return decision, event_id


def _decided(gov: Admitting, plan: planning.Plan, result: ChargeResult, now: float) -> Decision:
    """The decision of the plan's charge, from its reply (``_SPENT``: the approval
    it spends was spent already)."""
    ops = plan.ops
    if len(ops) > len(plan.slots):  # an approval's marker came last
        if result.refused >= len(plan.slots):
            return _SPENT
        n = len(plan.slots)
        ops = ops[:n]
        result = ChargeResult(result.refused, result.used[:n], result.caps[:n])
    if result.caps:
        gov._outage.saw_caps(ops, result.caps)
    if result.admitted:
        return planning.admitted_by(plan, result.used, result.caps)
    return _decide(gov, plan.slots, result, now)


def _sent_ahead(
    gov: Admitting, ops: Sequence[CounterOp], event_id: str | None
) -> Awaitable[ChargeResult] | None:
    """An admission's charge written at once, its reply to await (:func:`recording.sent`),
    when the ledger can prepare its event meanwhile (``prepare``); else None."""
    if event_id is None or getattr(gov.ledger, "prepare", None) is None:
        return None
    return recording.sent(gov.backend, gov._outage, ops, event_id, None, want_used=True)


async def logged(
    gov: Admitting,
    event_id: str,
    kind: EntryType,
    now: float,
    ctx: Context,
    plan: planning.Plan,
    decision: Decision,
    approved: tuple[str, ...],
) -> None:
    """The ledger entry of an admission step: ``kind``, or a rejection."""
    assert gov.ledger is not None
    # Built here, positionally: once per call, and keyword passing through
    # _append cost more than the entry itself.
    admitted = decision.admitted
    await gov.ledger.append(
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


def _decide(gov: Admitting, slots: Sequence[Slot], result: ChargeResult, now: float) -> Decision:
    if result.admitted:
        return planning.admitted(slots, result.used, caps=result.caps)
    remaining = (
        planning.headroom(slots, result.used, charged=False, caps=result.caps)
        if result.used
        else None
    )
    return planning.refused(slots[result.refused], now, remaining=remaining)


def plan_of(
    gov: Admitting, ctx: Context, now: float, calls: int = 1, price: Price | None = None
) -> planning.Plan:
    # Planning (buckets, escaped keys, ops) is pure and the same for a whole
    # minute: cache it per context, so a hot caller pays for it once a minute.
    # A context of long ids is planned afresh: the cache stays small in bytes.
    cache_key: tuple[Any, ...] = (
        (ctx, int(now // 60), calls) if price is None else (ctx, int(now // 60), calls, price)
    )
    plan = gov._plans.get(cache_key)
    if plan is None:
        plan = fresh_plan(gov, ctx, now, calls, frozenset(), price)
        if cacheable(ctx):
            if len(gov._plans) >= 4096:
                gov._plans.clear()
            gov._plans[cache_key] = plan
    return plan


def fresh_plan(
    gov: Admitting,
    ctx: Context,
    now: float,
    calls: int,
    allowed: frozenset[str],
    price: Price | None,
) -> planning.Plan:
    """The check's plan, charging ``price`` too (:func:`planning.with_price`)."""
    plan = planning.check_plan(gov.policy, ctx, now, calls, allowed)
    if price is None:
        return plan
    pairs = [(gov.policy[name], amount) for name, amount in price.pairs]
    return planning.with_price(
        plan,
        planning.meter_slots(pairs, ctx, now, gov.policy.tz, gov.policy),
        hold=price.hold,
    )


async def charge(
    gov: Admitting,
    ops: Sequence[CounterOp],
    event_id: str | None,
    *,
    want_used: bool = True,
    op_id: str | None = None,
    lease: str | None = None,
    ticket: str | None = None,
) -> ChargeResult:
    outage = gov._outage
    if outage.down_until or outage.pending:  # down, or charges a busy store could not take
        await outage.ready(gov.backend)
    try:
        if ticket is not None:  # a call waiting for a concurrency slot
            return await gov.backend.charge(  # type: ignore[call-arg]
                ops, event_id=event_id, want_used=want_used, op_id=op_id,
                lease=lease, lease_ttl=gov.lease_ttl, ticket=ticket,
            )  # fmt: skip
        if lease is not None:  # only a policy with concurrency caps needs leases
            return await gov.backend.charge(  # type: ignore[call-arg]
                ops, event_id=event_id, want_used=want_used, op_id=op_id,
                lease=lease, lease_ttl=gov.lease_ttl,
            )  # fmt: skip
        if op_id is None:  # ledger mode: a Backend predating op_id works as before
            return await gov.backend.charge(ops, event_id=event_id, want_used=want_used)
        return await gov.backend.charge(ops, event_id=event_id, want_used=want_used, op_id=op_id)
    except BackendUnavailableError:
        gov._outage.mark_down()
        raise


#: The longest a call may wait for a concurrency slot (seconds).
MAX_WAIT = 3600.0


def wait_seconds(wait: Any) -> float:
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_WAIT:
        raise InvalidInputError("wait", wait, f"expected seconds from 0 to {MAX_WAIT:.0f}")
    return float(wait)


#: What :func:`admit` answers when the approval it was to spend was spent
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
