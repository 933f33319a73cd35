"""Pure rules of a call: which counters it touches and what the answer is.

No I/O here: the governor feeds these functions the clock and what the
backend returned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import tzinfo
from typing import TYPE_CHECKING

from .caps import PLAN_DIMENSIONS, CapRef, caps_key
from .context import Context
from .counters import CounterOp, fits
from .decision import (
    EXCEEDED,
    LEDGER_UNAVAILABLE,
    UNAVAILABLE,
    Decision,
    LimitName,
    MeterResult,
    at,
)
from .errors import InvalidInputError, MissingScopeError, NoPriceTableError
from .keys import counter_key, escape, lease_key, scope_segment
from .ledger import LedgerCharge, TokenUsage
from .limits import Limit, OnExceed
from .money import Unit, check_amount
from .policy import Policy
from .scopes import scope_values
from .windows import Bucket, bucket_for

#: The bucket of a concurrency cap's leases: no period, no end.
LEASE_BUCKET = Bucket("lease", None, None)

if TYPE_CHECKING:
    from .prices import PriceTable


@dataclass(frozen=True, slots=True)
class Slot:
    """One limit's counter for one call, and what the call does to it."""

    limit: Limit
    key: str
    bucket: Bucket
    amount: int
    enforce: bool
    expire_at: int
    ref: CapRef | None = None

    @property
    def op(self) -> CounterOp:
        return CounterOp(
            self.key, self.amount, self.limit.cap, self.enforce, self.expire_at, self.ref
        )

    def with_amount(self, amount: int, *, enforce: bool = False) -> Slot:
        """The same counter and bucket with another amount (a settlement's delta)."""
        return Slot(self.limit, self.key, self.bucket, amount, enforce, self.expire_at, self.ref)

    def ledger_charge(self) -> LedgerCharge:
        lim = self.limit
        return LedgerCharge(
            lim.name, lim.unit, self.amount, lim.window, self.bucket.label, self.key, self.expire_at
        )


def slot(
    limit: Limit,
    ctx: Context,
    now: float,
    tz: tzinfo,
    amount: int,
    *,
    enforce: bool,
    policy: Policy | None = None,
) -> Slot | None:
    """The counter of ``limit`` for ``ctx`` at ``now``; None if ctx lacks the scope.

    With ``policy``, the slot carries what the backend needs to resolve the
    counter's effective cap (:func:`cap_ref`)."""
    if limit.tools and not limit.applies_to(ctx.tool):
        return None
    dims = limit.dimensions
    values = scope_values(dims, ctx)
    if values is None:
        return None
    if limit.concurrent:
        # One lease per call in progress; the script prunes expired leases, so
        # the key needs no expiry of its own here.
        segment = scope_segment(dims, values)
        ref = cap_ref(policy, limit, segment, values) if policy is not None else None
        return Slot(limit, lease_key(limit.name, segment), LEASE_BUCKET, 1, enforce, 0, ref)
    bucket = bucket_for(limit.window, now, tz, limit.anchor_for(values))
    segment = scope_segment(dims, values)
    key = counter_key(limit.name, segment, bucket.label)
    ref = cap_ref(policy, limit, segment, values) if policy is not None else None
    return Slot(limit, key, bucket, amount, enforce, bucket.expire_at(now), ref)


def cap_ref(policy: Policy, limit: Limit, segment: str, values: tuple[str, ...]) -> CapRef:
    """Where a counter's effective cap comes from: its scope's value cap in the
    policy, the assignment fields of its user and tenant, every plan's cap. A
    global limit has only its default and grants (field ``""``: no lookup)."""
    if not limit.dimensions:
        return CapRef(caps_key(limit.name), "")
    plan_caps = policy.plan_caps(limit.name)
    fields: tuple[str, ...] = ()
    file_plan = None
    if plan_caps:
        by_dim = dict(zip(limit.dimensions, values, strict=True))
        fields = tuple(f"{d.value}={escape(by_dim[d])}" for d in PLAN_DIMENSIONS if d in by_dim)
        assigned = policy.assignments
        file_plan = next((assigned[f] for f in fields if f in assigned), None)
    value_cap = dict(limit.caps).get(segment) if limit.caps else None
    return CapRef(caps_key(limit.name), segment, value_cap, fields, file_plan, plan_caps)


def named_limits(policy: Policy, limit: str | Sequence[str]) -> tuple[Limit, ...]:
    """The limits a meter names: one name, or several charged by the same event.

    Several names make one ledger event with one charge per limit, so a cost
    metered on a user's budget and on a global one is one cost, counted once
    by every spend query, not two events of the same dollars.
    """
    names = (limit,) if isinstance(limit, str) else tuple(limit)
    if not names:
        raise InvalidInputError("limit", limit, "name at least one limit")
    if len(set(names)) != len(names):
        raise InvalidInputError("limit", limit, "names a limit twice")
    return tuple(metered_limit(policy, name) for name in names)


def require_keyed(limits: Sequence[Limit], ctx: Context) -> None:
    """Raise :class:`MissingScopeError` when ``ctx`` lacks a scope value of every one of
    ``limits``: a meter or a reservation naming them would count nothing anywhere."""
    for lim in limits:
        if scope_values(lim.dimensions, ctx) is not None:
            return
    lim = limits[0]
    missing = [d.value for d in lim.dimensions if scope_values((d,), ctx) is None]
    raise MissingScopeError(
        "ctx", ctx, f"does not carry {'+'.join(missing)}, which limit {lim.name!r} counts per"
    )


def metered_limit(policy: Policy, name: str) -> Limit:
    """The limit ``name`` as something a meter, reserve or settle may charge."""
    lim = policy[name]
    if lim.concurrent:
        raise InvalidInputError(
            "limit", name, "is a concurrency cap: it holds calls in progress, nothing is metered"
        )
    return lim


def meter_slots(
    charges: Sequence[tuple[Limit, int]],
    ctx: Context,
    now: float,
    tz: tzinfo,
    policy: Policy | None = None,
) -> tuple[Slot, ...]:
    """The counters one metered event charges: each limit whose scope ``ctx`` supplies."""
    out = []
    for limit, amount in charges:
        s = slot(limit, ctx, now, tz, amount, enforce=False, policy=policy)
        if s is not None:
            out.append(s)
    return tuple(out)


def metered(
    s: Slot, before: int | None, *, degraded: bool = False, cap: int | None = None
) -> MeterResult:
    """The result of charging ``s``, given its total before (None: no counter answered)
    and its effective cap with grants (None: the limit's default)."""
    if before is None:
        return MeterResult(True, 0, False, s.amount, s.limit.name, degraded)
    if cap is None:
        cap = s.limit.cap
    total = before + s.amount
    within = fits(total, 0, cap)
    crossed = not within and fits(before, 0, cap)
    return MeterResult(within, total, crossed, s.amount, s.limit.name, degraded)


def charge_pairs(policy: Policy, charges: Mapping[str, int]) -> list[tuple[Limit, int]]:
    """Validate a mapping of limit name -> amount whole, before anything is charged."""
    if not isinstance(charges, Mapping):
        raise InvalidInputError("charges", charges, "expected a mapping of limit name -> amount")
    return [
        (metered_limit(policy, name), check_amount(amount, f"charges[{name!r}]"))
        for name, amount in charges.items()
    ]


def token_charges(
    policy: Policy,
    limit: str | Sequence[str],
    prices: PriceTable | None,
    model: str,
    *,
    input_tokens: int,
    output_tokens: int,
    cache_read_tokens: int = 0,
    cache_write_tokens: int = 0,
) -> tuple[list[tuple[Limit, int]], TokenUsage]:
    """What a model call charges to each limit ``limit`` names, and the usage that travels with it.

    USD limits price the tokens (an unknown model raises); TOKENS limits count
    ``input_tokens + output_tokens`` (input already includes the cache tokens).
    The tokens are checked and the call priced once, however many limits.
    """
    limits = named_limits(policy, limit)
    for name, value in (
        ("input_tokens", input_tokens),
        ("output_tokens", output_tokens),
        ("cache_read_tokens", cache_read_tokens),
        ("cache_write_tokens", cache_write_tokens),
    ):
        check_amount(value, name)
    price_version: str | None = None
    cost = 0
    # Priced first unless every limit counts tokens: a CALLS limit is refused below,
    # after a missing table or an unknown model (the order the reference checked in).
    if any(lim.unit is not Unit.TOKENS for lim in limits):
        if prices is None:
            raise NoPriceTableError(
                "prices: meter_tokens needs a price table to price a model call: "
                "prices=PriceTable.builtin() or PriceTable().with_price(...)"
            )
        cost = prices.cost_micros(
            model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cache_read_tokens=cache_read_tokens,
            cache_write_tokens=cache_write_tokens,
        )
        price_version = prices.version
    for lim in limits:
        if lim.unit not in (Unit.USD_MICROS, Unit.TOKENS):
            raise InvalidInputError(
                "limit", lim.name, "meter_tokens needs a TOKENS or USD_MICROS limit, not CALLS"
            )
    tokens = 0
    if any(lim.unit is Unit.TOKENS for lim in limits):
        tokens = check_amount(input_tokens + output_tokens, "input_tokens + output_tokens")
    pairs = [(lim, cost if lim.unit is Unit.USD_MICROS else tokens) for lim in limits]
    usage = TokenUsage(
        model, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, price_version
    )
    return pairs, usage


@dataclass(frozen=True, slots=True)
class Plan:
    """What a check does for one context within one minute: its slots and their ops.

    ``shadow`` is true when a slot never refuses (``OnExceed.ALERT``): only then
    does the decision report what went over. ``room`` is per slot its limit's
    name and what is left of the cap after the call's amount, so an admitted
    check's headroom is one subtraction per limit.
    """

    slots: tuple[Slot, ...]
    ops: tuple[CounterOp, ...]
    shadow: bool
    charges: tuple[LedgerCharge, ...]
    room: tuple[tuple[str, int], ...] = ()
    #: The lease sets of the concurrency caps the call takes a slot of.
    leases: tuple[str, ...] = ()
    #: How many of the last slots charge the call's fixed price (:func:`with_price`):
    #: the cost event's, whose ledger charges are ``cost_charges``.
    cost: int = 0
    cost_charges: tuple[LedgerCharge, ...] = ()
    #: The cost slots reserve a hard cap's estimates (a ``reserved`` event), not a price.
    holds: bool = False

    @classmethod
    def of(cls, slots: Sequence[Slot]) -> Plan:
        """The plan that charges ``slots`` all or nothing."""
        slots = tuple(slots)
        return cls(
            slots,
            tuple(s.op for s in slots),
            any(not s.enforce for s in slots),
            ledger_charges(slots),
            tuple((s.limit.name, s.limit.cap - s.amount) for s in slots),
            tuple(s.key for s in slots if s.limit.concurrent),
        )


def check_plan(
    policy: Policy, ctx: Context, now: float, calls: int = 1, approved: frozenset[str] = frozenset()
) -> Plan:
    """The plan of a check at ``now`` counting ``calls`` calls. Valid for the whole
    minute: every bucket boundary (UTC or zoned) falls on a whole minute.
    ``approved``: ASK limits the user let this call go over (counted, not enforced)."""
    return Plan.of(check_slots(policy, ctx, now, calls, approved))


def with_price(plan: Plan, price: Sequence[Slot], *, hold: bool = False) -> Plan:
    """``plan`` that also charges a call's fixed price (``price``: :func:`meter_slots`)
    in the same all-or-nothing charge, as the slots of a second (cost) event.

    A priced limit the check consults refuses a price that does not fit, as the
    check would (the price replaces the check's read of it); a metered-only
    limit is charged without refusing, as a meter would. So concurrent calls
    never take a consulted limit past its cap. ``hold``: the slots are a hard cap's
    estimates (a ``reserved`` event), which every limit that refuses enforces, as
    a reservation does.
    """
    if not price:
        return plan
    checked = {s.key: s for s in plan.slots if not s.limit.concurrent}
    priced = []
    for p in price:
        c = checked.get(p.key)
        enforce = enforces(p.limit) if hold else c is not None and c.enforce
        priced.append(p.with_amount(p.amount, enforce=enforce))
    read = {p.key for p in priced if (c := checked.get(p.key)) is not None and not c.amount}
    kept = tuple(s for s in plan.slots if s.key not in read)
    slots = (*kept, *priced)
    return Plan(
        slots,
        tuple(s.op for s in slots),
        any(not s.enforce for s in kept),
        ledger_charges(kept),
        tuple((s.limit.name, s.limit.cap - s.amount) for s in slots),
        plan.leases,
        len(priced),
        ledger_charges(priced),
        hold,
    )


def ledger_charges(slots: Sequence[Slot]) -> tuple[LedgerCharge, ...]:
    """What the ledger records of these slots: every non-zero amount. Leases are not
    spend (they are given back at the end of the call): they never reach the ledger."""
    return tuple(s.ledger_charge() for s in slots if s.amount and not s.limit.concurrent)


def check_slots(
    policy: Policy, ctx: Context, now: float, calls: int = 1, approved: frozenset[str] = frozenset()
) -> list[Slot]:
    """Every counter a check consults: gated limits (charged) and breakers (read).

    ``calls`` is how many calls the check counts on gated CALLS limits; other
    limits are read whatever it is (spend is charged by meter and reserve).
    """
    out: list[Slot] = []
    tz = policy.tz
    for limit in policy.limits:
        if not (limit.gated or limit.breaker):
            continue
        enforce = enforces(limit) and limit.name not in approved
        s = slot(limit, ctx, now, tz, limit.check_charge * calls, enforce=enforce, policy=policy)
        if s is not None:
            out.append(s)
    return out


def enforces(limit: Limit) -> bool:
    """Whether ``limit`` refuses when exceeded (DENY, and ASK until approved)."""
    return limit.on_exceed is not OnExceed.ALERT


def reason(limit: Limit, prefix: str = EXCEEDED) -> str:
    """``budget_exceeded:user/day``: what an agent reads in a refusal."""
    return f"{prefix}:{limit.scope_label}/{limit.window_label}"


def headroom(
    slots: Sequence[Slot], used: Sequence[int], *, charged: bool, caps: Sequence[int] = ()
) -> dict[str, int]:
    """Per slot, what can still be charged before its limit is exhausted (its cap
    reached), from the totals read before the call (``charged``: after its amounts);
    ``caps``: the effective caps with grants the backend compared with."""
    limits = caps or [s.limit.cap for s in slots]
    return {
        s.limit.name: max(cap - total - (s.amount if charged else 0), 0)
        for s, total, cap in zip(slots, used, limits, strict=True)
    }


def refused(
    s: Slot, now: float, *, degraded: bool = False, remaining: Mapping[str, int] | None = None
) -> Decision:
    """The decision when ``s`` refuses a call; ``remaining``: :func:`headroom` of the check."""
    status = s.limit.refusal_status
    # A concurrency slot frees when a call ends: a second is the honest hint.
    left = 1 if s.limit.concurrent else s.bucket.seconds_left(now)
    return Decision(
        admitted=False,
        limit=LimitName(s.limit.name),
        status=status,
        retry_after=None if status == 402 else left,
        resets_at=at(s.bucket.end),
        reason=reason(s.limit),
        degraded=degraded,
        remaining={} if remaining is None else remaining,
    )


def unavailable(s: Slot, retry_after: float) -> Decision:
    """A fail-closed limit whose counters cannot be reached: 503, try again soon."""
    return Decision(
        admitted=False,
        limit=LimitName(s.limit.name),
        status=503,
        retry_after=max(1, math.ceil(retry_after)),
        resets_at=None,
        reason=reason(s.limit, UNAVAILABLE),
        degraded=True,
    )


def busy(store: str, retry_after: float) -> Decision:
    """The counter store is overloaded, not down: 503, try again soon, nothing charged,
    no fail mode (``degraded`` stays False: the store decided, by saying it is busy)."""
    return Decision(
        admitted=False,
        status=503,
        retry_after=max(1, math.ceil(retry_after)),
        reason=f"{UNAVAILABLE}:{store} busy",
    )


def ledger_full(retry_after: float) -> Decision:
    """The ledger cannot record new work: 503, try again soon, nothing charged."""
    return Decision(
        admitted=False,
        status=503,
        retry_after=max(1, math.ceil(retry_after)),
        reason=LEDGER_UNAVAILABLE,
        degraded=True,
    )


def admitted_by(plan: Plan, used: Sequence[int], caps: Sequence[int] = ()) -> Decision:
    """:func:`admitted` for a whole plan, on the hot path: no shadow limit to report
    means the headroom is all there is to compute. ``caps``: the effective caps
    (with grants) the backend compared with, when it said."""
    if plan.shadow or not used:
        return admitted(plan.slots, used, caps=caps)
    if caps:
        return Decision(
            admitted=True,
            remaining={
                s.limit.name: max(cap - s.amount - u, 0)
                for s, u, cap in zip(plan.slots, used, caps, strict=True)
            },
        )
    return Decision(
        admitted=True,
        remaining={
            name: room - u if room > u else 0
            for (name, room), u in zip(plan.room, used, strict=True)
        },
    )


def admitted(
    slots: Sequence[Slot],
    used: Sequence[int],
    *,
    degraded: bool = False,
    caps: Sequence[int] = (),
) -> Decision:
    """The decision for an admitted call, naming shadow limits it went over, with
    each limit's :func:`headroom` after the call.

    ``used`` may be empty when the backend was not asked for totals.
    """
    if not used:
        return Decision(admitted=True, degraded=degraded)
    limits = caps or [s.limit.cap for s in slots]
    over = tuple(
        s.limit.name
        for s, total, cap in zip(slots, used, limits, strict=True)
        if not s.enforce and not fits(total, s.amount, cap)
    )
    remaining = headroom(slots, used, charged=True, caps=caps)
    return Decision(admitted=True, over=over, degraded=degraded, remaining=remaining)
