"""Limits: one declarative ceiling each; a bad value is refused when the limit is made.

>>> from mcp_budget_governor import Scope, Window
>>> burst = Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER)
>>> burst.gated, burst.fail_mode, burst.on_exceed
(True, <FailMode.OPEN: 'open'>, <OnExceed.DENY: 'deny'>)
>>> Limit("spend", cap=-1, window=Window.DAY)
Traceback (most recent call last):
...
mcp_budget_governor.errors.PolicyError: Limit('spend').cap: must be non-negative (got -1)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .caps import parse_caps, scope_field
from .errors import PolicyError
from .keys import NAME_PATTERN as NAME_PATTERN  # its home is with the keys it must fit
from .keys import scope_segment
from .money import MAX_AMOUNT, Unit
from .scopes import Dimensions, Scope, declared_order, normalize_scope
from .windows import Window, check_anchor


class FailMode(StrEnum):
    """What a limit does when the shared counters cannot be reached.

    CLOSED refuses (503); OPEN keeps admitting, against a process-local
    counter unless the limit sets ``local_fallback=False``.
    """

    OPEN = "open"
    CLOSED = "closed"


class OnExceed(StrEnum):
    """What happens when a limit is exceeded: refuse (DENY), admit and report (ALERT),
    or ask the MCP client's user whether to go over for this call (ASK; refused when
    the user declines, does not answer, or the client cannot be asked)."""

    DENY = "deny"
    ALERT = "alert"
    ASK = "ask"


def _enum(cls: type[Any], value: Any, field_name: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if value.lower() in (member.value, member.name.lower()):
                return member
    choices = ", ".join(m.name for m in cls)
    raise PolicyError(field_name, value, f"unknown {cls.__name__} (one of {choices})")


@dataclass(frozen=True)
class Limit:
    """One ceiling: ``cap`` units per ``window`` per ``scope``.

    - ``gated`` limits are consulted by ``check()``; a CALLS limit charges one
      call per admitted check, other units refuse once the window is spent.
    - ``breaker`` limits shed every check (503) once their total reaches the
      cap, until the window ends; they are typically ``gated=False`` spend
      limits fed by ``meter()``.
    - ``on_exceed=OnExceed.ALERT`` is shadow mode: never refuses, reports.
    - ``on_exceed=OnExceed.ASK`` refuses like DENY, unless the integration asks
      the user (MCP elicitation) and the user approves going over for this call.
    - ``status`` overrides the refusal status (429 quota, 402 spend, 503 breaker).
    - ``caps`` gives particular scope values their own cap: ``{"acme": usd(100)}``,
      ``{"user=u_42,tool=search": 5}`` for a composite scope (see ``caps.py``).

    >>> Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER).scope
    (<Scope.USER: 'user'>,)
    """

    name: str
    cap: int
    #: None only for a concurrency cap (``unit=Unit.CONCURRENT``), which has no window.
    window: Window = None  # type: ignore[assignment]
    scope: Any = None
    unit: Unit = Unit.CALLS
    breaker: bool = False
    gated: bool = True
    fail_mode: FailMode = FailMode.OPEN
    local_fallback: bool = True
    status: int | None = None
    on_exceed: OnExceed = OnExceed.DENY
    alert_at: tuple[int, ...] = field(default=())
    #: The billing day MONTH periods start on (None: the calendar month); see windows.py.
    anchor_day: int | None = None
    #: Billing days of particular scope values (``{"acme": 15}``; composite scopes
    #: name every part: ``"tenant=acme,user=u_42"``); the others get ``anchor_day``.
    anchors: Mapping[str, int] = field(default_factory=dict)
    caps: Any = None
    #: The tools it applies to, by name or glob (``("brave_*", "fetch")``); () all.
    tools: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise PolicyError(
                "Limit.name",
                name,
                ("must be non-empty: " if name == "" else "") + "expected 1-64 characters "
                "from A-Z a-z 0-9 _ . -, starting with a letter or digit",
            )
        where = f"Limit({name!r})"
        cap = self.cap
        if isinstance(cap, bool) or not isinstance(cap, int):
            raise PolicyError(f"{where}.cap", cap, "expected an integer (use usd() for dollars)")
        if cap < 0:
            raise PolicyError(f"{where}.cap", cap, "must be non-negative")
        if cap > MAX_AMOUNT:
            raise PolicyError(f"{where}.cap", cap, f"exceeds the largest amount ({MAX_AMOUNT})")
        set_ = object.__setattr__
        set_(self, "unit", _enum(Unit, self.unit, f"{where}.unit"))
        if self.unit is Unit.CONCURRENT:
            # Calls in progress are counted now, not per period: a window would
            # be silently inert, so giving one is an error.
            if self.window is not None:
                raise PolicyError(
                    f"{where}.window",
                    self.window,
                    "a concurrency cap counts calls in progress and has no window: omit it",
                )
            if self.breaker or not self.gated:
                raise PolicyError(
                    f"{where}.unit", self.unit.value, "a concurrency cap is gated, never a breaker"
                )
            if self.anchor_day is not None or self.anchors:
                raise PolicyError(
                    f"{where}.anchor_day", self.anchor_day, "no window, no billing day"
                )
        else:
            set_(self, "window", _enum(Window, self.window, f"{where}.window"))
        set_(self, "fail_mode", _enum(FailMode, self.fail_mode, f"{where}.fail_mode"))
        set_(self, "on_exceed", _enum(OnExceed, self.on_exceed, f"{where}.on_exceed"))
        dims: Dimensions = normalize_scope(self.scope, f"{where}.scope")
        if self.window is Window.SESSION and Scope.SESSION not in dims:
            # A session window counts per session by definition.
            dims = normalize_scope((*dims, Scope.SESSION), f"{where}.scope")
        # Not a field (equality, hashing and policy files use the canonical scope).
        set_(self, "_declared", declared_order(self.scope, dims))
        set_(self, "scope", dims)
        for flag in ("breaker", "gated", "local_fallback"):
            if not isinstance(getattr(self, flag), bool):
                raise PolicyError(f"{where}.{flag}", getattr(self, flag), "expected True or False")
        status = self.status
        if status is not None and (
            isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599
        ):
            raise PolicyError(f"{where}.status", status, "expected an HTTP status from 400 to 599")
        set_(self, "alert_at", _levels(self.alert_at, f"{where}.alert_at"))
        set_(self, "anchors", _anchors(self, where))
        set_(self, "caps", parse_caps(dims, self.caps, f"{where}.caps"))
        tools = (self.tools,) if isinstance(self.tools, str) else self.tools
        if not isinstance(tools, tuple | list) or not all(isinstance(t, str) and t for t in tools):
            raise PolicyError(f"{where}.tools", self.tools, 'expected tool names or globs: ["a_*"]')
        set_(self, "tools", tuple(tools))
        if self.breaker and self.on_exceed is OnExceed.ASK:
            # A tripped breaker protects everyone: nobody may wave it through.
            raise PolicyError(
                f"{where}.on_exceed", self.on_exceed.value, "a breaker cannot ask for approval"
            )
        if not self.gated and not self.breaker and self.on_exceed is OnExceed.DENY:
            # Metered-only limit: fine, check() never consults it; meter() records.
            pass

    def anchor_for(self, values: tuple[str, ...]) -> int:
        """The billing day of the counter for scope ``values``: the one rule mapping a
        scope value to its MONTH period (a run-time anchor can feed :attr:`anchors`).

        >>> lim = Limit("m", cap=1, window=Window.MONTH, scope=Scope.TENANT,
        ...             anchor_day=5, anchors={"acme": 15})
        >>> lim.anchor_for(("acme",)), lim.anchor_for(("initech",))
        (15, 5)
        """
        if self.anchors:
            found = self.anchors.get(scope_segment(self.dimensions, values))
            if found is not None:
                return found
        return 1 if self.anchor_day is None else self.anchor_day

    @property
    def value_caps(self) -> dict[str, int]:
        """The caps of particular scope values, by scope segment (``tenant=acme``).

        >>> Limit("t", cap=5, window=Window.DAY, scope=Scope.TENANT, caps={"acme": 9}).value_caps
        {'tenant=acme': 9}
        """
        return dict(self.caps)

    def applies_to(self, tool: str | None) -> bool:
        """Whether this limit counts a call to ``tool`` (its :attr:`tools`, by name or glob).

        >>> Limit("r", cap=3, window=Window.MINUTE, tools=("brave_*",)).applies_to("brave_web")
        True
        """
        if not self.tools:
            return True
        return tool is not None and any(fnmatch.fnmatchcase(tool, t) for t in self.tools)

    @property
    def dimensions(self) -> Dimensions:
        """The scope as a normalised tuple of dimensions (() is global)."""
        dims: Dimensions = self.scope
        return dims

    @property
    def declared_dimensions(self) -> Dimensions:
        """:attr:`dimensions` in the order the scope was declared: the order of
        mcp-budget-governor 0.1.0's key strings (``reference_keys``). Ours share one
        canonical order, so ``(USER, TOOL)`` and ``(TOOL, USER)`` count together.

        >>> Limit("x", cap=1, window=Window.DAY, scope=(Scope.TOOL, Scope.USER)).declared_dimensions
        (<Scope.TOOL: 'tool'>, <Scope.USER: 'user'>)
        """
        declared: Dimensions = self.__dict__.get("_declared", self.dimensions)
        return declared

    @property
    def scopes(self) -> Dimensions:
        """:attr:`dimensions`, as mcp-budget-governor 0.1.0 named them."""
        return self.dimensions

    @property
    def requires_context(self) -> bool:
        """Whether a context must name something for this limit to count (not global)."""
        return bool(self.scope)

    @property
    def scope_label(self) -> str:
        """``user``, ``tenant+tool`` or ``global``: how refusals name the scope."""
        return "+".join(d.value for d in self.dimensions) or "global"

    @property
    def concurrent(self) -> bool:
        """Whether this is a concurrency cap: leases on calls in progress, no window."""
        return self.unit is Unit.CONCURRENT

    @property
    def window_label(self) -> str:
        """``day``, ``minute``... or ``concurrent`` (a concurrency cap): refusals and reports."""
        return Unit.CONCURRENT.value if self.window is None else self.window.value

    @property
    def refusal_status(self) -> int:
        """The HTTP status a refusal by this limit carries."""
        if self.status is not None:
            return self.status
        if self.breaker:
            return 503
        if self.unit is Unit.USD_MICROS:
            return 402
        return 429

    @property
    def check_charge(self) -> int:
        """What one admitted check charges to this limit: a call, or nothing."""
        return 1 if self.gated and self.unit is Unit.CALLS else 0


class FrozenMap(Mapping[str, int]):
    """A read-only, hashable, picklable mapping (a limit is a frozen value)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, int]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> int:
        return self._items[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._items.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self._items == dict(other)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


_EMPTY = FrozenMap({})


def _anchors(limit: Limit, where: str) -> Mapping[str, int]:
    """Check ``anchor_day`` and ``anchors``: billing days of a MONTH limit with a scope."""
    if limit.anchor_day is None and not limit.anchors:
        return _EMPTY
    field_name = f"{where}.anchor_day" if limit.anchor_day is not None else f"{where}.anchors"
    if limit.window is not Window.MONTH:
        shown = limit.anchor_day if limit.anchor_day is not None else limit.anchors
        raise PolicyError(
            field_name, shown, f"billing days apply to month windows, not {limit.window.value}"
        )
    if limit.anchor_day is not None:
        check_anchor(limit.anchor_day, f"{where}.anchor_day")
    anchors = limit.anchors
    if not isinstance(anchors, Mapping):
        raise PolicyError(f"{where}.anchors", anchors, "expected a mapping of scope value -> day")
    if anchors and not limit.dimensions:
        raise PolicyError(f"{where}.anchors", dict(anchors), "a global limit has no scope values")
    # Keyed by scope segment: one syntax (and one parser) for caps and anchors.
    out: dict[str, int] = {}
    for value, day in anchors.items():
        segment = scope_field(limit.dimensions, value, f"{where}.anchors")
        out[segment] = check_anchor(day, f"{where}.anchors.{value}")
    return FrozenMap(out)


def _levels(levels: Any, field_name: str) -> tuple[int, ...]:
    if not isinstance(levels, Iterable) or isinstance(levels, str):
        raise PolicyError(field_name, levels, "expected a list of percentages")
    out: list[int] = []
    for level in levels:
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 1000:
            raise PolicyError(field_name, level, "expected whole percentages from 1 to 1000")
        out.append(level)
    return tuple(sorted(set(out)))
