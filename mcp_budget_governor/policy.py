"""A policy: the list of limits a governor enforces.

>>> from mcp_budget_governor import Limit, PolicyError, Scope, Unit, Window, usd
>>> policy = Policy.of(
...     Limit("per_user", cap=100, window=Window.DAY, scope=Scope.USER),
...     Limit("global_spend", cap=usd(25), window=Window.DAY, unit=Unit.USD_MICROS,
...           breaker=True, gated=False),
... )
>>> [limit.name for limit in policy], policy["global_spend"].cap
(['per_user', 'global_spend'], 25000000)
>>> Policy.of(Limit("a", cap=1, window=Window.DAY), Limit("a", cap=2, window=Window.DAY))
Traceback (most recent call last):
...
mcp_budget_governor.errors.PolicyError: Policy.limits[1].name: duplicate limit names (got 'a')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import tzinfo
from enum import StrEnum
from typing import Any

from .caps import Plan, assignment_field
from .context import ANONYMOUS_USER, Context
from .decision import Decision
from .errors import LimitExceeded, PolicyError, UnknownLimitError
from .limits import FailMode, Limit, OnExceed, _enum
from .money import Unit, usd
from .policy_toml import load_file
from .scopes import Scope
from .windows import Window, zone

# What mcp-budget-governor 0.1.0 imported from its ``policy`` module, here too.
__all__ = [
    "Anonymous", "FailMode", "Limit", "OnExceed", "Policy", "Scope", "Unit", "Window", "usd",
]  # fmt: skip


class Anonymous(StrEnum):
    """What an integration does with a caller its ``identify`` cannot name.

    It matters only when some limit counts per user (its scope includes
    ``Scope.USER``): such a limit cannot count a caller without a user id, so
    letting that caller through unchanged would leave it unlimited.

    - ``REFUSE`` (the default): refuse the call (status 403, reason
      ``caller_unidentified``). A missing or broken ``identify`` shows up on
      the first call instead of quietly turning per-user limits off.
    - ``SHARED``: count every such caller in one anonymous bucket, the user
      id ``""`` (``ANONYMOUS_USER``), which no caller with a real id can share.
    """

    REFUSE = "refuse"
    SHARED = "shared"


@dataclass(frozen=True)
class Policy:
    """An ordered, validated set of limits with unique names.

    ``timezone`` (an IANA name) sets where DAY and MONTH windows begin; UTC
    when omitted. ``plans`` are named sets of caps (:class:`Plan`) and
    ``assignments`` maps tenants (``"acme"``) or users (``"user=u_42"``) to a
    plan's name (see ``caps.py`` for which cap wins). ``anonymous`` says
    what integrations do with a caller they cannot identify
    (:class:`Anonymous`; refused by default).

    >>> from mcp_budget_governor import Limit, Scope, Window
    >>> policy = Policy.of(Limit("per_user", cap=100, window=Window.DAY, scope=Scope.USER))
    >>> policy["per_user"].cap
    100
    """

    limits: tuple[Limit, ...] = ()
    timezone: str | None = None
    anonymous: Anonymous = Anonymous.REFUSE
    plans: Any = ()
    assignments: Any = None

    def __post_init__(self) -> None:
        seen: set[str] = set()
        limits = self.limits
        if not isinstance(limits, tuple | list):
            raise PolicyError("Policy.limits", limits, "expected a sequence of Limit")
        for i, limit in enumerate(limits):
            if not isinstance(limit, Limit):
                raise PolicyError(f"Policy.limits[{i}]", limit, "expected a Limit")
            if limit.name in seen:
                raise PolicyError(f"Policy.limits[{i}].name", limit.name, "duplicate limit names")
            seen.add(limit.name)
        object.__setattr__(self, "limits", tuple(limits))
        object.__setattr__(self, "_by_name", {lim.name: lim for lim in limits})
        object.__setattr__(self, "_tz", zone(self.timezone))
        object.__setattr__(self, "anonymous", _enum(Anonymous, self.anonymous, "Policy.anonymous"))
        per_user = tuple(lim for lim in limits if Scope.USER in lim.dimensions)
        object.__setattr__(self, "_per_user", per_user)
        plans, assignments = _plans(self.plans, self.assignments, self.__dict__["_by_name"])
        object.__setattr__(self, "plans", plans)
        object.__setattr__(self, "assignments", assignments)

    def plan_caps(self, limit: str) -> tuple[tuple[str, int], ...]:
        """Each plan's cap for ``limit``, ``(plan, cap)`` sorted; plans without it left out."""
        return tuple((p.name, p.caps[limit]) for p in self.plans if limit in p.caps)

    def plan(self, name: str) -> Plan:
        """The plan called ``name``; PolicyError naming the known ones otherwise."""
        plans: tuple[Plan, ...] = self.plans
        for p in plans:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.plans) or "none"
        raise PolicyError("plan", name, f"no such plan (known: {known})")

    @classmethod
    def of(
        cls,
        *limits: Limit,
        timezone: str | None = None,
        anonymous: Anonymous | str = Anonymous.REFUSE,
        plans: Sequence[Plan] = (),
        assignments: Mapping[str, str] | None = None,
    ) -> Policy:
        """Build a policy from limits given as arguments."""
        mode: Anonymous = _enum(Anonymous, anonymous, "Policy.anonymous")
        return cls(
            tuple(limits),
            timezone=timezone,
            anonymous=mode,
            plans=tuple(plans),
            assignments=assignments,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Policy:
        """Load a policy file (TOML, see ``examples/policy.toml``), validated here;
        errors name the file, line, key and value (:class:`PolicyFileError`)."""
        return load_file(path, cls.of)

    def identified(self, ctx: Context) -> Context:
        """The context to govern a caller with, applying ``anonymous`` to an unnamed one.

        Integrations call this with what their ``identify`` produced. A caller
        with a user id (not ``""``), or any caller when no limit counts per
        user, comes back unchanged. Otherwise ``SHARED`` returns it with the
        anonymous user id and ``REFUSE`` raises :class:`LimitExceeded`
        (status 403, reason ``caller_unidentified``, naming a per-user limit).

        >>> from mcp_budget_governor import Limit, Scope, Window
        >>> burst = Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER)
        >>> Policy.of(burst, anonymous="shared").identified(Context(tool="search")).user
        ''
        >>> Policy.of(burst).identified(Context(tool="search"))
        Traceback (most recent call last):
        ...
        mcp_budget_governor.errors.LimitExceeded: caller_unidentified
        """
        per_user: tuple[Limit, ...] = self.__dict__["_per_user"]
        if ctx.user or not per_user:
            return ctx
        if self.anonymous is Anonymous.SHARED:
            return (
                ctx if ctx.user == ANONYMOUS_USER else dataclasses.replace(ctx, user=ANONYMOUS_USER)
            )
        raise LimitExceeded(
            Decision(
                admitted=False, limit=per_user[0].name, status=403, reason="caller_unidentified"
            )
        )

    @property
    def tz(self) -> tzinfo:
        """The resolved time zone for DAY, WEEK and MONTH buckets."""
        tz: tzinfo = self.__dict__["_tz"]
        return tz

    def __getitem__(self, name: str) -> Limit:
        by_name: dict[str, Limit] = self.__dict__["_by_name"]
        try:
            return by_name[name]
        except KeyError:
            raise UnknownLimitError(
                "limit",
                name,
                f"no such limit (known: {', '.join(by_name)}); there is no limit named {name!r}",
            ) from None

    def get(self, name: str) -> Limit:
        """``policy[name]``, as mcp-budget-governor 0.1.0 spelled it."""
        return self[name]

    def gated_limits(self) -> tuple[Limit, ...]:
        """The limits ``check()`` charges or reads (``gated=True``), in order."""
        return tuple(lim for lim in self.limits if lim.gated)

    def breakers(self) -> tuple[Limit, ...]:
        """The breaker limits, in order."""
        return tuple(lim for lim in self.limits if lim.breaker)

    def __contains__(self, name: Any) -> bool:
        return name in self.__dict__["_by_name"]

    def __iter__(self) -> Iterator[Limit]:
        return iter(self.limits)

    def __len__(self) -> int:
        return len(self.limits)


def _plans(
    plans: Any, assignments: Any, limits: Mapping[str, Limit]
) -> tuple[tuple[Plan, ...], dict[str, str]]:
    """Validate plans (unique names, known limits) and assignments (known plans)."""
    if not isinstance(plans, tuple | list):
        raise PolicyError("Policy.plans", plans, "expected a sequence of Plan")
    names: set[str] = set()
    for i, plan in enumerate(plans):
        if not isinstance(plan, Plan):
            raise PolicyError(f"Policy.plans[{i}]", plan, "expected a Plan")
        if plan.name in names:
            raise PolicyError(f"Policy.plans[{i}].name", plan.name, "duplicate plan name")
        names.add(plan.name)
        for limit in plan.caps:
            if limit not in limits:
                raise PolicyError(
                    f"Plan({plan.name!r}).caps",
                    limit,
                    f"no such limit (known: {', '.join(limits)})",
                )
            if not limits[limit].dimensions:
                raise PolicyError(
                    f"Plan({plan.name!r}).caps", limit, "a global limit has no tenant or user"
                )
    out: dict[str, str] = {}
    if assignments is None:
        assignments = {}
    if not isinstance(assignments, Mapping):
        raise PolicyError("Policy.assignments", assignments, "expected tenant or user -> plan")
    for who, plan_name in assignments.items():
        where = f"Policy.assignments[{who!r}]"
        field = assignment_field(who, where)
        if plan_name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise PolicyError(where, plan_name, f"no such plan (known: {known})")
        out[field] = plan_name
    return tuple(plans), out
