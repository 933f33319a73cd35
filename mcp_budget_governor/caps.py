"""Caps per customer: value caps, plans, run-time changes and grants, and the one rule
that resolves a counter's effective cap.

A limit has a default ``cap``; ``Limit(caps=...)`` names other caps for particular
scope values, a :class:`Plan` is a named set of caps that tenants or users are
assigned to, and operators change caps, assignments and grants at run time
(ledger events, projected like charges). For one counter the effective cap is,
first match wins:

1. a run-time value cap (``mcpbg caps set``) whose ``until`` has not passed;
2. the policy's value cap (``Limit(caps=...)``);
3. the plan assigned to the counter's user, else its tenant, at run time
   (``mcpbg plans assign``), else in the policy (``Policy(assignments=...)``),
   when that plan caps this limit;
4. the limit's default.

A grant adds room to one counter (one bucket: the current period) without
changing its recorded spend: ``room = cap + grant - used``.

:func:`resolve` is that rule; ``lua/charge.lua`` (``effective_cap``) mirrors it and
the golden vectors (``caps`` section) hold the two together.

>>> resolve(25, value_cap=None, runtime=None, plan="pro", plan_caps={"pro": 100}, now=0)
Effective(cap=100, grant=0, source='plan:pro')
>>> resolve(25, value_cap=50, runtime=(70, 2000), plan="pro", plan_caps={"pro": 100}, now=1000)
Effective(cap=70, grant=0, source='run-time until 2000')
>>> resolve(25, value_cap=50, runtime=(70, 2000), plan=None, plan_caps={}, now=2000, grant=5)
Effective(cap=50, grant=5, source='value')
>>> scope_field((Scope.USER, Scope.TOOL), "user=u_42,tool=search", "caps")
'user=u_42,tool=search'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import quote, unquote

from .errors import PolicyError
from .keys import NAME_PATTERN, PREFIX, escape, scope_segment, unescape
from .money import MAX_AMOUNT
from .scopes import Dimensions, Scope

#: Hash per limit of run-time value caps: field = scope segment, value = "<cap> <until>".
CAPS_PREFIX = f"{PREFIX}:_caps"
#: Hash of run-time plan assignments: field = ``tenant=<v>`` / ``user=<v>``, value = plan.
PLANS_KEY = f"{PREFIX}:_plans"
#: The counter-hash field holding the counter's grant (extra room this bucket).
GRANT_FIELD = "g"
#: The dimensions a plan can be assigned by, most specific first.
PLAN_DIMENSIONS: tuple[Scope, ...] = (Scope.USER, Scope.TENANT)


def caps_key(limit: str) -> str:
    """The run-time caps hash of ``limit``.

    >>> caps_key("tenant_spend")
    'mcpbg:v1:_caps:tenant_spend'
    """
    return f"{CAPS_PREFIX}:{limit}"


@dataclass(frozen=True, slots=True)
class Effective:
    """A counter's effective cap, its grant, and where the cap comes from."""

    cap: int
    grant: int
    source: str

    @property
    def room_cap(self) -> int:
        """What the admission rule compares with: ``cap + grant``."""
        return self.cap + self.grant


def resolve(
    default: int,
    *,
    value_cap: int | None,
    runtime: tuple[int, int] | None,
    plan: str | None,
    plan_caps: Mapping[str, int],
    now: float,
    grant: int = 0,
    runtime_plan: bool = False,
) -> Effective:
    """The effective cap of one counter (see the module docstring for the order).

    ``runtime`` is ``(cap, until)`` of a run-time value cap (``until`` 0: for
    good; it applies while ``now < until``); ``plan`` the assigned plan (run-time
    assignment first, else the policy's); ``plan_caps`` each plan's cap for this
    limit (a plan without this limit is absent).
    """
    if runtime is not None and (runtime[1] == 0 or now < runtime[1]):
        until = runtime[1]
        return Effective(runtime[0], grant, f"run-time until {until}" if until else "run-time")
    if value_cap is not None:
        return Effective(value_cap, grant, "value")
    if plan is not None and plan in plan_caps:
        return Effective(plan_caps[plan], grant, f"plan:{plan}" + (" (run-time)" * runtime_plan))
    return Effective(default, grant, "default")


@dataclass(frozen=True, slots=True)
class CapRef:
    """What the admission script needs to resolve one counter's cap in the same call.

    ``field`` is the counter's scope segment (its field in :func:`caps_key`);
    ``plan_fields`` the assignment fields to look up (user, then tenant);
    ``file_plan`` the policy's assignment; ``plan_caps`` every plan's cap for
    this limit (empty: no plan caps it, and no assignment is looked up).
    """

    caps_key: str
    field: str
    value_cap: int | None = None
    plan_fields: tuple[str, ...] = ()
    file_plan: str | None = None
    plan_caps: tuple[tuple[str, int], ...] = ()


def effective(
    ref: CapRef,
    default: int,
    *,
    runtime: tuple[int, int] | None,
    assigned: Mapping[str, str],
    grant: int,
    now: float,
) -> Effective:
    """:func:`resolve` for one counter, from what a backend holds: its run-time value
    cap, the run-time assignments (by field) and its grant. ``lua/charge.lua``'s
    ``effective_cap`` is the same steps."""
    plan, from_runtime = ref.file_plan, False
    if ref.plan_caps:
        for f in ref.plan_fields:
            hit = assigned.get(f)
            if hit is not None:
                plan, from_runtime = hit, True
                break
    return resolve(
        default,
        value_cap=ref.value_cap,
        runtime=runtime,
        plan=plan,
        plan_caps=dict(ref.plan_caps),
        now=now,
        grant=grant,
        runtime_plan=from_runtime,
    )


class ChangeKind(StrEnum):
    """A run-time change, as the ledger records it (``mcpbg.<kind>.v1``)."""

    CAP_SET = "cap_set"
    CAP_UNSET = "cap_unset"
    PLAN_ASSIGNED = "plan_assigned"
    GRANTED = "granted"
    RESET = "reset"


@dataclass(frozen=True, slots=True)
class Change:
    """One run-time change, as applied to the counters store.

    - CAP_SET: ``key`` = :func:`caps_key`, ``field`` = scope segment, ``amount``
      = cap, ``until`` = epoch seconds (0: for good);
    - CAP_UNSET: ``key``, ``field``;
    - PLAN_ASSIGNED: ``key`` = :data:`PLANS_KEY`, ``field`` = ``tenant=<v>`` or
      ``user=<v>``, ``plan`` (None: back to the policy's assignment);
    - GRANTED: ``key`` = the counter, ``amount`` added to its grant, ``until``
      = the counter's expire_at;
    - RESET: ``key`` = the counter, ``amount`` = its new grant (what it had
      spent when the reset was made, so the room is the cap again), ``until``
      = its expire_at.
    """

    kind: ChangeKind
    limit: str
    key: str
    field: str = ""
    amount: int = 0
    until: int = 0
    plan: str | None = None
    actor: str = ""
    reason: str = ""


def why_token(actor: str, reason: str) -> str:
    """Who and why, as one space-free token the scripts store as is (``-``: neither).

    >>> why_token("ops", "trial, 2 weeks"), why_from(why_token("ops", "trial, 2 weeks"))
    ('ops%0Atrial%2C%202%20weeks', ('ops', 'trial, 2 weeks'))
    """
    if not actor and not reason:
        return "-"
    return quote(f"{actor}\n{reason}", safe="")


def why_from(token: str) -> tuple[str, str]:
    """``(actor, reason)`` of a :func:`why_token`."""
    if token == "-":
        return "", ""
    actor, _, reason = unquote(token).partition("\n")
    return actor, reason


def check_cap(value: Any, where: str) -> int:
    """A cap: a whole number from 0 to ``MAX_AMOUNT`` (micros for USD limits)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(where, value, "expected a whole number (use usd() for dollars)")
    if value < 0:
        raise PolicyError(where, value, "must not be negative")
    if value > MAX_AMOUNT:
        raise PolicyError(where, value, f"exceeds the largest amount ({MAX_AMOUNT})")
    return value


def scope_field(dims: Dimensions, entry: Any, where: str) -> str:
    """The scope segment (``keys.scope_segment``) a caps entry names.

    A one-part scope takes the bare value (``"acme"``) or ``"tenant=acme"``; a
    composite scope names every part, ``"user=u_42,tool=search"`` (its values
    then cannot hold ``,`` or ``=``).

    >>> scope_field((Scope.TENANT,), "acme", "caps")
    'tenant=acme'
    >>> scope_field((Scope.USER, Scope.TOOL), "user=u_42", "caps")
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.PolicyError: caps: names user; the scope is user+tool: \
name every part, as user=..,tool=.. (got 'user=u_42')
    """
    if not isinstance(entry, str) or not entry:
        raise PolicyError(where, entry, "expected a scope value (a non-empty string)")
    if not dims:
        raise PolicyError(where, entry, "a global limit has no scope values to cap")
    label = "+".join(d.value for d in dims)
    parts: dict[Scope, str] = {}
    if len(dims) == 1 and not any(entry.startswith(f"{d.value}=") for d in Scope):
        parts[dims[0]] = entry
    else:
        for item in entry.split(","):
            name, sep, value = item.partition("=")
            try:
                dim = Scope(name)
            except ValueError:
                dim = None
            if not sep or dim is None or not value:
                raise PolicyError(where, entry, f"expected {_form(dims)}")
            if dim not in dims:
                raise PolicyError(where, entry, f"the limit's scope ({label}) has no {name}")
            if dim in parts:
                raise PolicyError(where, entry, f"names {name} twice")
            parts[dim] = value
    if len(parts) != len(dims):
        named = "+".join(d.value for d in dims if d in parts)
        raise PolicyError(
            where, entry, f"names {named}; the scope is {label}: name every part, as {_form(dims)}"
        )
    return scope_segment(dims, tuple(parts[d] for d in dims))


def _form(dims: Dimensions) -> str:
    return ",".join(f"{d.value}=.." for d in dims)


def parse_caps(dims: Dimensions, caps: Any, where: str) -> tuple[tuple[str, int], ...]:
    """A limit's value caps as ``(scope segment, cap)`` pairs, validated once."""
    if caps is None:
        return ()
    if not isinstance(caps, Mapping):
        raise PolicyError(where, caps, "expected a mapping of scope value -> cap")
    out: dict[str, int] = {}
    for entry, cap in caps.items():
        seg = scope_field(dims, entry, f"{where}[{entry!r}]")
        if seg in out:
            raise PolicyError(f"{where}[{entry!r}]", entry, "names the same scope value twice")
        out[seg] = check_cap(cap, f"{where}[{entry!r}]")
    return tuple(sorted(out.items()))


def assignment_field(entry: Any, where: str) -> str:
    """The assignment field of a tenant or user: ``"acme"`` is a tenant, ``"user=u_42"`` a user.

    >>> assignment_field("acme", "assign"), assignment_field("user=a:b", "assign")
    ('tenant=acme', 'user=a%3Ab')
    """
    if not isinstance(entry, str) or not entry:
        raise PolicyError(where, entry, "expected a tenant, or user=<id>")
    for dim in PLAN_DIMENSIONS:
        prefix = f"{dim.value}="
        if entry.startswith(prefix):
            value = entry[len(prefix) :]
            if not value:
                raise PolicyError(where, entry, f"expected {prefix}<value>")
            return f"{prefix}{escape(value)}"
    return f"tenant={escape(entry)}"


def field_value(field_: str) -> tuple[str, str]:
    """An assignment or one-part scope field taken apart: ``("tenant", "acme")``."""
    dim, _, seg = field_.partition("=")
    return dim, unescape(seg)


@dataclass(frozen=True)
class Plan:
    """A named set of caps, by limit name; tenants or users assigned to it get them.

    >>> Plan("pro", caps={"tenant_spend": 100_000_000, "burst": 60}).caps["burst"]
    60
    >>> Plan("Pro plan", caps={})
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.PolicyError: Plan.name: expected 1-64 characters from \
A-Z a-z 0-9 _ . -, starting with a letter or digit (got 'Pro plan')
    """

    name: str
    caps: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.fullmatch(self.name):
            raise PolicyError(
                "Plan.name",
                self.name,
                "expected 1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit",
            )
        if not isinstance(self.caps, Mapping):
            raise PolicyError(f"Plan({self.name!r}).caps", self.caps, "expected limit -> cap")
        checked = {
            str(k): check_cap(v, f"Plan({self.name!r}).caps[{k!r}]") for k, v in self.caps.items()
        }
        object.__setattr__(self, "caps", dict(sorted(checked.items())))
