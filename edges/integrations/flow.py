"""One governed call, shared by every integration: check, run, meter.

``@governed``, the FastMCP middleware, the ASGI middleware and the low-level
MCP hook all run a call through :func:`governed_call`, so what a refused, a
failed, a cancelled or a completed call is charged is decided in one place:

- the call is checked first; a refusal raises :class:`LimitExceeded` and the
  work never runs (a refused call is charged nothing, and the ledger records
  the rejection). Integrations that identify their callers pass what
  ``identify`` produced through :meth:`Governor.identified` before (an
  unnamed caller is refused or shared, as the policy says); ``@governed``
  takes the context the developer gives it;
- every admitted call is paid for. When the work raises an ``Exception``, or
  is cancelled (``asyncio.CancelledError``: an MCP client's
  ``notifications/cancelled``, an HTTP client that went away, a timeout), the
  admission stands (retrying a failing or abandoned call is not free) and the
  ``fixed`` charges are metered: they are prices known without a result, and
  work that started may have spent them. ``priced`` is not called: there is
  no result to price. The exception or the cancellation then propagates
  unchanged;
- a price known before the work runs (``fixed``, with neither ``priced`` nor an
  ``estimate``) is charged by the admission itself, in its one round trip
  (:meth:`Governor.admitted` ``price=``, on Redis and in memory): a price that
  does not fit a limit the check consults refuses the call, and an admitted
  call has paid, so nothing is charged after the work, whatever it does. A
  hard cap's estimates are reserved by the admission the same way (``hold=``);
- when the work completes, ``priced(result)`` is metered if it returns charges,
  else ``fixed``: a completed call is always charged, even past a cap. A
  ``priced`` callback that raises, or returns something that is not valid
  charges (not a mapping, an unknown limit, an amount that is not an integer,
  negative or too large), is logged as an error naming the tool, the call is
  charged ``fixed`` instead, and the caller still gets the result;
- the charging runs to its end even when the caller's task is cancelled
  meanwhile (shielded, for asyncio and for anyio cancel scopes alike); the
  cancellation is raised once it is done. Other ``BaseException`` (process
  exit) is not metered;
- so does the admission: once the check has reached the counters, a
  cancellation arriving at any instant (before the reply, before the ledger
  event, during the reservation) lets it end, and is then raised where the
  work would run. An admitted call so cancelled pays as one cancelled while it
  ran (``fixed``, its reservations kept at their estimates or settled to
  ``fixed``; an estimate not yet reserved is metered as its price); its leases
  are given back at once; its ledger events are appended, so nothing is left
  in flight. A refused call so cancelled pays nothing, and a waiting one leaves
  the queue.

Charges map a limit name to an amount in that limit's unit (integer USD micros
for money). All of them are validated before any is metered, so a bad amount
meters nothing rather than part of a call.

This module also renders a refusal for people and agents (:func:`refusal_text`,
:func:`refusal_body`), and reads a caller's identity from an OAuth access token
(:func:`user_of_token`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from datetime import UTC
from typing import Any, TypeAlias, TypeVar

from mcp_budget_governor.context import EMPTY, Context
from mcp_budget_governor.decision import EXCEEDED, Decision
from mcp_budget_governor.errors import BudgetExceeded, InvalidInputError, LimitExceeded
from mcp_budget_governor.governor import Governor
from mcp_budget_governor.holds import Admission, Reservations
from mcp_budget_governor.limits import OnExceed
from mcp_budget_governor.money import check_amount
from mcp_budget_governor.producers.emit import Recorder
from mcp_budget_governor.repeats import is_repeat
from mcp_budget_governor.shielding import finished, to_the_end

__all__ = [
    "RATE_LIMITED",
    "REFUSAL_META_KEY",
    "Charges",
    "fixed_charges",
    "governed_call",
    "governed_context",
    "identify_with",
    "rate_limited_error",
    "refusal_body",
    "refusal_meta",
    "refusal_text",
    "user_of_token",
]

log = logging.getLogger("mcp_budget_governor")

R = TypeVar("R")

_current: ContextVar[Context | None] = ContextVar("mcpbg_governed_context", default=None)

Charges: TypeAlias = Mapping[str, int]
"""What a call costs: limit name -> amount in that limit's unit."""

PricedCost: TypeAlias = Callable[[Any], "Charges | Awaitable[Charges | None] | None"]

Ask: TypeAlias = Callable[[Decision], Awaitable[bool]]
"""Whether the user lets a call refused by an ``OnExceed.ASK`` limit go over it."""


async def governed_call(
    governor: Governor | Recorder,
    ctx: Context,
    work: Callable[[], Awaitable[R]],
    *,
    fixed: Charges | None = None,
    priced: PricedCost | None = None,
    estimate: Charges | None = None,
    ask: Ask | None = None,
    wait: float = 0,
    approved: Sequence[str] = (),
) -> R:
    """Check (a Governor only), run ``work``, meter what it cost; see the module docstring.

    A :class:`Recorder` has no counters: the work always runs and its cost is
    appended to the ledger. ``ctx`` is governed as given: integrations that
    identify callers pass it through :meth:`Governor.identified` first.

    ``estimate`` (``{limit: amount}``, a Governor only) makes the call a hard
    cap: the estimates are reserved before the work runs, all or nothing in one
    round trip (refused when one does not fit, so calls in flight cannot overshoot
    by more than their estimates' error), and settled afterwards, together, to
    what the call is charged; a limit the charges do not name keeps its estimate.

    ``ask(decision)`` (a Governor only) is asked when the check refuses by an
    ``OnExceed.ASK`` limit: True admits the call over that limit (the ledger
    records the approval), False refuses it as usual. A breaker never asks.

    ``wait`` (seconds, a Governor only): how long a call refused by a full
    concurrency cap waits for a slot, first come, first served
    (:meth:`Governor.check`). ``approved``: ``OnExceed.ASK`` limits the user
    already let this call go over (an answer from an earlier round).
    """
    held: Reservations | None = None
    # A Governor admits for the whole call: its concurrency-cap leases are
    # renewed while the work runs and given back when it ends, however it ends.
    admission: Admission | None = None
    # A cancellation that arrived once the check had reached the counters: the
    # admission ran to its end, and the cancellation is raised in the charged
    # block below, so an admitted call pays as if cancelled while it ran.
    cancelled: asyncio.CancelledError | None = None
    owed = fixed  # what a call that fails or is cancelled pays beyond its reservations
    # A price known before the call (fixed, nothing to price from the result, no
    # hard cap to reserve) is charged by the admission itself: one round trip.
    price = fixed if fixed and priced is None and not estimate else None
    if isinstance(governor, Governor):
        approved = list(approved)
        if estimate:
            estimate = _validated(governor, estimate)
        while True:
            # A hard cap's estimates are reserved by the admission too (one round trip),
            # but not on a limit the user let this call go over.
            hold = {k: v for k, v in estimate.items() if k not in approved} if estimate else None
            admission = governor.admitted(
                ctx, approved=approved, wait=wait, price=price, hold=hold or None
            )
            try:
                decision = await admission.__aenter__()  # refused: no lease held
            except asyncio.CancelledError as exc:
                if admission.decision is None or not admission.decision.admitted:
                    raise  # refused, or never reached the counters: nothing to pay
                decision, cancelled = admission.decision, exc  # its leases are back
                break
            limit = None if ask is None else askable(governor, decision, approved)
            if ask is None or limit is None or not await ask(decision):
                break
            approved.append(limit)  # a refused check charged nothing: check again
        decision.raise_for_status()
        if admission.price_charged:  # paid with the admission, whatever happens next
            owed = fixed = None
        if estimate:
            estimate = {k: v for k, v in estimate.items() if k not in approved}
        if decision.held is not None:  # reserved with the admission: settled below
            assert estimate
            held = Reservations.taken(governor, estimate, ctx, decision)
        elif estimate and cancelled is not None:
            # Cancelled before its reservation: the estimate is charged as a price.
            owed = {**_validated(governor, estimate), **(fixed or {})}
        elif estimate:
            # After the check: a reservation that fills its limit to the cap
            # exactly must not make that check refuse the very call it holds.
            # A call refused here has used its call quota (the check admitted it).
            try:
                held, cancelled = await _reserve_all(governor, estimate, ctx)
            except BaseException:
                await _to_the_end(admission.__aexit__(None, None, None))  # its leases back
                raise
    token = _current.set(ctx)
    try:
        try:
            if cancelled is not None:
                raise cancelled
            result = await work()
        except asyncio.CancelledError:
            if owed or held:
                try:
                    await _to_the_end(_charge(governor, ctx, owed, held))
                except Exception:  # the cancellation goes on, whatever the charge met
                    log.exception("tool %r: charging the cancelled call failed", ctx.tool)
            raise
        except Exception:
            if owed or held:
                await _to_the_end(_charge(governor, ctx, owed, held))
            raise
        if fixed or priced is not None or held is not None:
            await _to_the_end(_settle(governor, ctx, result, fixed, priced, held))
        return result
    finally:
        _current.reset(token)
        if admission is not None and admission.holding:  # its leases back, to the end
            await _to_the_end(admission.__aexit__(None, None, None))


def askable(governor: Governor, decision: Decision, approved: Sequence[str]) -> str | None:
    """The ``OnExceed.ASK`` limit whose refusal the user may wave through, else None:
    never a breaker, an unnamed caller, unreachable counters or a full ledger."""
    name = decision.limit
    if decision.admitted or decision.degraded or name is None or name in approved:
        return None
    if not decision.reason.startswith(EXCEEDED):
        return None
    if name not in governor.policy:
        return None
    limit = governor.policy[name]
    if limit.on_exceed is not OnExceed.ASK or limit.breaker:
        return None
    return name


async def _reserve_all(
    governor: Governor, estimate: Charges, ctx: Context
) -> tuple[Reservations, asyncio.CancelledError | None]:
    """Reserve every estimate, all or nothing, in one round trip, to its end even when
    the call is cancelled meanwhile: the reservation and that cancellation (the call
    then settles what it holds, as one cancelled while it ran)."""
    held = Reservations(governor, _validated(governor, estimate), ctx)

    async def enter() -> None:
        await held.__aenter__()

    _, cancelled = await finished(enter())
    return held, cancelled


async def _settle_all(held: Reservations | None, charges: Charges) -> None:
    if held is None:
        return
    for limit, amount in charges.items():
        if limit in held.estimates:
            held.actual[limit] = amount
    await held.__aexit__(None, None, None)


async def _charge(
    governor: Governor | Recorder,
    ctx: Context,
    charges: Charges | None,
    held: Reservations | None,
) -> None:
    """Charge ``charges``: reserved limits settle to them (else keep their estimate),
    the others are metered as one event."""
    charges = charges or {}
    await _settle_all(held, charges)
    reserved = held.limit_names if held is not None else frozenset()
    rest = {limit: amount for limit, amount in charges.items() if limit not in reserved}
    if rest:
        await meter_all(governor, rest, ctx)


async def _settle(
    governor: Governor | Recorder,
    ctx: Context,
    result: Any,
    fixed: Charges | None,
    priced: PricedCost | None,
    held: Reservations | None = None,
) -> None:
    """Charge a completed call: ``priced(result)`` when it gives valid charges, else ``fixed``."""
    charges = fixed
    if priced is not None:
        try:
            got = priced(result)
            if inspect.isawaitable(got):
                got = await got
            if got is not None:
                _validated(governor, got)
                charges = got
        except Exception as exc:
            price = f"its fixed price {dict(fixed)}" if fixed else "nothing beyond its admission"
            log.error(
                "tool %r: its cost callback failed, so the call is charged %s: %s",
                ctx.tool, price, exc,
            )  # fmt: skip
    if charges or held:
        await _charge(governor, ctx, charges, held)


#: A step run to its end whatever instant a cancellation arrives (:mod:`..shielding`).
_to_the_end = to_the_end


def governed_context() -> Context | None:
    """The context of the governed call running now, as it was checked; None outside one.

    A tool (or a ``cost`` callback) that meters more itself, such as the
    model tokens it spent, charges the same caller with it::

        await governor.meter_tokens("spend", model, input_tokens=..., output_tokens=...,
                                    ctx=governed_context())
    """
    return _current.get()


def _validated(governor: Governor | Recorder, charges: Any) -> dict[str, int]:
    """The non-zero charges of a ``{limit: amount}`` mapping, after validating all of them."""
    if not isinstance(charges, Mapping):
        raise InvalidInputError("cost", charges, "expected a mapping of limit name -> amount")
    for limit, amount in charges.items():
        governor.policy[limit]  # an unknown limit raises PolicyError here
        check_amount(amount, f"amount for {limit!r}")
    return {limit: amount for limit, amount in charges.items() if amount != 0}


def fixed_charges(
    governor: Governor | Recorder, charges: Charges | None, field: str = "fixed"
) -> dict[str, int] | None:
    """Validate a fixed price given to an integration when it is built (None: no price)."""
    if charges is None:
        return None
    try:
        _validated(governor, charges)
    except InvalidInputError as exc:
        raise InvalidInputError(field, exc.value, f"{exc.field}: {exc.problem}") from None
    return dict(charges)


async def meter_all(governor: Governor | Recorder, charges: Charges, ctx: Context) -> None:
    """Meter every charge as one ledger event, after validating them all (nothing partial)."""
    nonzero = _validated(governor, charges)
    if nonzero and isinstance(governor, Governor):
        await governor.meter_behind(nonzero, ctx)  # the reply is off the caller's path
    elif nonzero:
        await governor.meter_charges(nonzero, ctx)


async def identify_with(identify: Callable[..., Any], *args: Any) -> Context:
    """Call a sync or async ``identify``; None (nobody named) becomes the empty context."""
    got = identify(*args)
    if inspect.isawaitable(got):
        got = await got
    if got is None:
        return EMPTY
    if not isinstance(got, Context):
        raise TypeError(f"identify() returned {type(got).__name__}, not a Context or None")
    return got


def user_of_token(token: Any) -> str | None:
    """The user an OAuth access token stands for: its subject, else its client id.

    Works with the MCP SDK's and FastMCP's ``AccessToken``; None for no token.
    """
    if token is None:
        return None
    subject = getattr(token, "subject", None) or (getattr(token, "claims", None) or {}).get("sub")
    if isinstance(subject, str) and subject:
        return subject
    client_id = getattr(token, "client_id", None)
    return client_id if isinstance(client_id, str) and client_id else None


REFUSAL_META_KEY = "dev.mcpbg/refusal"
"""The key of a refused tool result's ``_meta`` that holds :func:`refusal_meta`."""

RATE_LIMITED = -32023
"""The JSON-RPC error code of MCP's rate-limit proposal (SEP-3304, a draft: opt-in)."""


def refusal_meta(decision: Decision) -> dict[str, Any]:
    """A refusal as data a program reads beside the text, in a tool result's ``_meta``
    under :data:`REFUSAL_META_KEY`: ``status``, ``error`` and ``reason``, the ``limit``
    with its ``scope`` and ``window`` (None when the refusal names none), ``retry_after``
    (seconds; None: waiting will not help) and ``resets_at`` (ISO 8601 UTC, or None)."""
    error, _, where = decision.reason.partition(":")
    scope, _, window = where.partition("/")
    return {
        "status": decision.status,
        "error": error,
        "reason": decision.reason,
        "limit": decision.limit,
        "scope": scope or None,
        "window": window or None,
        "retry_after": decision.retry_after,
        "resets_at": _iso(decision),
    }


def rate_limited_error(decision: Decision) -> dict[str, Any] | None:
    """The JSON-RPC error (``code``, ``message``, ``data``) MCP's rate-limit proposal
    defines for a refusal that waiting fixes (status 429 with ``retry_after``), for
    servers that opt in; None for any other refusal, which stays a tool result.
    ``data`` holds the proposal's ``retryAfterMs`` and :func:`refusal_meta`."""
    if decision.status != 429 or decision.retry_after is None:
        return None
    return {
        "code": RATE_LIMITED,
        "message": refusal_text(decision),
        "data": {
            "retryAfterMs": decision.retry_after * 1000,
            REFUSAL_META_KEY: refusal_meta(decision),
        },
    }


def refusal_body(decision: Decision) -> dict[str, Any]:
    """A refusal as JSON-ready fields: error, reason, limit, status, retry hint, message."""
    return {
        "error": decision.reason.split(":", 1)[0],
        "reason": decision.reason,
        "limit": decision.limit,
        "status": decision.status,
        "retry_after": decision.retry_after,
        "resets_at": _iso(decision),
        "message": refusal_text(decision),
    }


def refusal_text(decision: Decision) -> str:
    """A refusal an agent can act on: the reason, the limit, and when (if ever) to retry.

    The first words are the machine-readable reason (``budget_exceeded:user/minute``),
    then ``key=value`` facts, then one sentence saying whether retrying can help,
    so a model stops instead of calling again in a loop.
    """
    facts = [decision.reason]
    if decision.limit is not None:
        facts.append(f"limit={decision.limit}")
    facts.append(f"status={decision.status}")
    if decision.retry_after is not None:
        facts.append(f"retry_after={decision.retry_after}s")
    resets = _iso(decision)
    if resets is not None:
        facts.append(f"resets_at={resets}")
    return f"{' '.join(facts)}. {_advice(decision, resets)}"


#: What a loop guard's refusal tells the agent (mcp_budget_governor.repeats).
REPEAT_ADVICE = (
    "You are repeating yourself: this exact call (the same tool with the same "
    "arguments) was already made as many times as {what} allows{until}. Calling it "
    "again will not give a different answer; change your approach (other arguments, "
    "another tool) or report to the user."
)


def _advice(d: Decision, resets: str | None) -> str:
    what = f"limit {d.limit!r}" if d.limit is not None else "the budget governor"
    if is_repeat(d.reason):
        return REPEAT_ADVICE.format(what=what, until=f" until {resets}" if resets else "")
    if d.status == 403:
        return (
            f"Refused: {what} counts per user and this caller could not be identified. "
            "Retrying will not help; the server must identify its callers."
        )
    if d.retry_after is not None:
        when = f" (at {resets})" if resets is not None else ""
        return (
            f"{_opener(d, what)}. Do not call again for {d.retry_after} seconds{when}; "
            "calls before then are refused too."
        )
    if resets is not None:
        return (
            f"Refused by {what}: this budget is spent until {resets}. "
            "Do not retry before then; report this to the user instead."
        )
    return f"Refused by {what}. Do not retry; report this to the user instead."


def _opener(d: Decision, what: str) -> str:
    """A refusal that passes with time, named as mcp-budget-governor 0.1.0's tool errors
    named it: a quota (429) rate limits, a tripped breaker's budget is exceeded."""
    kind = d.refusal_type()
    if kind is BudgetExceeded:
        return f"Budget exceeded: {what} refuses every caller"
    if kind is LimitExceeded and d.status == 429:
        return f"Rate limited by {what}"
    return f"Refused by {what}"


def _iso(d: Decision) -> str | None:
    if d.resets_at is None:
        return None
    return d.resets_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
