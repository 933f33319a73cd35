"""Run-time changes, validated whole before anything is written: pure builders.

The governor (``set_cap``, ``unset_cap``, ``assign_plan``, ``grant``, ``reset``)
and the ``mcpbg`` verbs build a :class:`~mcp_budget_governor.caps.Change` here,
then append it to the ledger (projected like a charge) or, with no ledger,
write it to the counters directly (the governor's side: :mod:`.changing`).

>>> from mcp_budget_governor import Limit, Policy, Scope, Window
>>> policy = Policy.of(Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER))
>>> change, ctx = cap_change(policy, "burst", {"user": "u_42"}, 60, until=None, now=0.0)
>>> change.key, change.field, change.amount, ctx.user
('mcpbg:v1:_caps:burst', 'user=u_42', 60, 'u_42')
>>> cap_change(policy, "burst", {"tenant": "acme"}, 60, until=None, now=0.0)
Traceback (most recent call last):
...
mcp_budget_governor.errors.InvalidInputError: scope: limit 'burst' counts per user, \
not per tenant (got {'tenant': 'acme'})
"""

from __future__ import annotations

import math
import time as _time
from collections.abc import Mapping
from datetime import UTC, date, datetime, time
from typing import Any

from . import bounds
from .caps import PLANS_KEY, Change, ChangeKind, assignment_field, caps_key, check_cap
from .context import Context
from .errors import InvalidInputError, PolicyError
from .keys import scope_segment
from .limits import Limit
from .money import Unit
from .numbers import dollars, whole
from .planning import slot
from .policy import Policy
from .scopes import Scope


def _text(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise InvalidInputError(name, value, f"expected text of at most {limit} characters")
    return value


def _scope(limit: Limit, scope: Mapping[str, Any]) -> tuple[tuple[str, ...], Context]:
    dims = limit.dimensions
    names = {d.value for d in dims}
    label = limit.scope_label
    for name, value in scope.items():
        if name not in names:
            raise InvalidInputError(
                "scope", dict(scope), f"limit {limit.name!r} counts per {label}, not per {name}"
            )
        if not isinstance(value, str) or not value:
            raise InvalidInputError(name, value, "expected a non-empty scope value")
    missing = [d.value for d in dims if d.value not in scope]
    if missing:
        raise InvalidInputError(
            "scope",
            dict(scope),
            f"limit {limit.name!r} counts per {label}: name {'+'.join(missing)}",
        )
    values = tuple(str(scope[d.value]) for d in dims)
    return values, Context(**{d.value: scope[d.value] for d in dims})


def _until(until: Any, now: float) -> int:
    if until is None:
        return 0
    if isinstance(until, datetime):
        if until.tzinfo is None:
            raise InvalidInputError("until", until, "expected a time with a time zone")
        moment = until.timestamp()
    elif isinstance(until, int | float) and not isinstance(until, bool):
        moment = float(until)
    else:
        raise InvalidInputError("until", until, "expected a datetime or epoch seconds")
    shown = until.isoformat() if isinstance(until, datetime) else until  # never a repr
    if not math.isfinite(moment) or moment <= now:
        raise InvalidInputError("until", shown, "must be in the future")
    why = bounds.problem("until", math.ceil(moment))
    if why is not None:  # a time every zone, language and store can still show
        raise InvalidInputError("until", shown, why)
    return math.ceil(moment)


def cap_change(
    policy: Policy,
    limit: str,
    scope: Mapping[str, Any],
    cap: Any,
    *,
    until: Any,
    now: float,
    reason: str = "",
    actor: str = "",
) -> tuple[Change, Context]:
    """A run-time cap of ``cap`` (micros for USD limits) for one scope value, until
    ``until`` (None: for good)."""
    lim = policy[limit]
    values, ctx = _scope(lim, scope)
    amount = check_cap(cap, "cap")
    segment = scope_segment(lim.dimensions, values)
    change = Change(
        ChangeKind.CAP_SET,
        lim.name,
        caps_key(lim.name),
        segment,
        amount,
        _until(until, now),
        None,
        _text(actor, "actor", 256),
        _text(reason, "reason", 1024),
    )
    return change, ctx


def uncap_change(
    policy: Policy, limit: str, scope: Mapping[str, Any], *, reason: str = "", actor: str = ""
) -> tuple[Change, Context]:
    """The removal of one scope value's run-time cap."""
    lim = policy[limit]
    values, ctx = _scope(lim, scope)
    segment = scope_segment(lim.dimensions, values)
    change = Change(
        ChangeKind.CAP_UNSET,
        lim.name,
        caps_key(lim.name),
        segment,
        actor=_text(actor, "actor", 256),
        reason=_text(reason, "reason", 1024),
    )
    return change, ctx


def plan_change(
    policy: Policy,
    plan: str | None,
    *,
    tenant: str | None = None,
    user: str | None = None,
    reason: str = "",
    actor: str = "",
) -> tuple[Change, Context]:
    """A tenant or a user (exactly one) assigned to ``plan`` (None: the policy's again)."""
    if (tenant is None) == (user is None):
        raise InvalidInputError("tenant/user", (tenant, user), "name a tenant or a user, not both")
    if plan is not None:
        policy.plan(plan)  # PolicyError naming the known plans
    dim, value = (Scope.TENANT, tenant) if tenant is not None else (Scope.USER, user)
    if not isinstance(value, str) or not value:
        raise InvalidInputError(dim.value, value, "expected a non-empty value")
    field = assignment_field(f"{dim.value}={value}", dim.value)
    limit = next((p for p in policy.plans if p.name == plan), None)
    # The event names a limit of the plan (any limit when unassigning): the schema wants one.
    name = next(iter(limit.caps)) if limit is not None and limit.caps else policy.limits[0].name
    change = Change(
        ChangeKind.PLAN_ASSIGNED,
        name,
        PLANS_KEY,
        field,
        plan=plan,
        actor=_text(actor, "actor", 256),
        reason=_text(reason, "reason", 1024),
    )
    return change, Context(**{dim.value: value})


def grant_change(
    policy: Policy,
    limit: str,
    scope: Mapping[str, Any],
    amount: Any,
    *,
    now: float,
    used: int | None = None,
    reason: str = "",
    actor: str = "",
) -> tuple[Change, Context]:
    """A grant of ``amount`` on the counter of the current period; with ``used``
    instead (``amount`` None), a reset: the grant becomes what was spent, so the
    room is the cap again and the spend stays recorded."""
    lim = policy[limit]
    _, ctx = _scope(lim, scope)
    s = slot(lim, ctx, now, policy.tz, 0, enforce=False)
    if s is None:  # pragma: no cover - _scope supplied every dimension
        raise PolicyError("scope", dict(scope), "incomplete")
    if used is None:
        if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
            raise InvalidInputError("amount", amount, "expected a positive whole number")
        check_cap(amount, "amount")
        kind, value = ChangeKind.GRANTED, amount
    else:
        kind, value = ChangeKind.RESET, max(used, 0)
    change = Change(
        kind,
        lim.name,
        s.key,
        "",
        value,
        s.expire_at,
        None,
        _text(actor, "actor", 256),
        _text(reason, "reason", 1024),
    )
    return change, ctx


# -- what a person types: an option of mcpbg caps, a field of POST /v1/caps ----------


def parse_amount(
    policy: Policy, limit: str, usd: tuple[str, str | None], count: tuple[str, str | None]
) -> int:
    """The amount from the dollar option (money limits) or the whole-number one, each
    given as (its name, the text typed or None)."""
    lim = policy[limit]
    money = lim.unit is Unit.USD_MICROS
    given, other = (usd, count) if money else (count, usd)
    if other[1] is not None:
        raise InvalidInputError(
            other[0], other[1], f"limit {limit!r} counts {lim.unit.value}: use {given[0]}"
        )
    name, text = given
    if text is None:
        raise InvalidInputError(name, None, f"required for limit {limit!r}")
    return dollars(text, name) if money else whole(text, name)


def parse_until(policy: Policy, text: str | None) -> datetime | None:
    """``--until``: an ISO date (its start, in the policy's time zone) or time (UTC unless
    it names an offset)."""
    if text is None:
        return None
    if not text.isascii():
        raise InvalidInputError("--until", text, "expected an ISO date or time")
    try:
        # Every ISO date form (2030-01-01, 20300101, 2030-W01, 2030-W01-1): its start
        # where the policy's days start, whichever form it is written in.
        moment = datetime.combine(date.fromisoformat(text), time(), tzinfo=policy.tz)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise InvalidInputError("--until", text, "expected an ISO date or time") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
    if moment.timestamp() <= _time.time():  # named as typed, before anything is read
        raise InvalidInputError("--until", text, f"must be in the future ({moment.isoformat()})")
    return moment
