"""Scopes: which part of the context a limit counts per."""

from __future__ import annotations

from enum import StrEnum, nonmember
from typing import Any, Protocol

from .errors import PolicyError


class Scope(StrEnum):
    """A dimension of the caller's context. A limit with no scope is global."""

    TENANT = "tenant"
    USER = "user"
    AGENT = "agent"
    SESSION = "session"
    TOOL = "tool"
    #: The call itself: its tool and arguments hashed (:func:`~.repeats.call_hash`),
    #: for a loop guard, a cap on identical calls.
    CALL = "call"
    #: No dimension: one counter for everyone (``scope=Scope.GLOBAL`` is leaving it out).
    GLOBAL = nonmember(())


_ORDER = {s: i for i, s in enumerate(Scope)}

#: A limit's scope, normalised: the dimensions in canonical order, () for global.
Dimensions = tuple[Scope, ...]


def normalize_scope(scope: Any, field: str) -> Dimensions:
    """Accept None, a Scope, or a tuple/list of Scopes; return them in canonical order.

    ``(USER, TOOL)`` and ``(TOOL, USER)`` are the same scope and share counters.
    """
    if scope is None or scope == ():
        return ()
    items = [scope] if isinstance(scope, Scope | str) else scope
    if not isinstance(items, tuple | list | frozenset | set):
        raise PolicyError(field, scope, "expected a Scope or a tuple of Scopes")
    dims: list[Scope] = []
    for item in items:
        if item == ():  # Scope.GLOBAL beside a dimension adds nothing
            continue
        if isinstance(item, Scope):
            dims.append(item)
            continue
        try:
            dims.append(Scope(item))
        except ValueError:
            raise PolicyError(
                field, item, f"not a Scope (one of {', '.join(s.name for s in Scope)})"
            ) from None
    if len(set(dims)) != len(dims):
        raise PolicyError(field, scope, "a dimension appears twice")
    return tuple(sorted(dims, key=_ORDER.__getitem__))


def declared_order(scope: Any, dims: Dimensions) -> Dimensions:
    """``dims`` (``scope`` normalised) in the order ``scope`` named them; a dimension
    added by normalising (a session window's session) comes last."""
    items = [scope] if isinstance(scope, Scope | str) else list(scope or ())
    named = [Scope(item) for item in items if item != ()]
    return (*named, *(d for d in dims if d not in named))


class Caller(Protocol):
    """What :func:`scope_values` reads of a caller: a :class:`~.context.Context`, which
    stands above this module (it names its values by :class:`Scope`)."""

    @property
    def user(self) -> str | None: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def tool(self) -> str | None: ...
    @property
    def agent(self) -> str | None: ...
    @property
    def call(self) -> str | None: ...
    @property
    def session_key(self) -> str | None: ...


def scope_values(dims: Dimensions, ctx: Caller) -> tuple[str, ...] | None:
    """The context's values for ``dims``, or None when the context lacks one.

    A limit whose scope the context cannot supply is skipped, so a per-tenant
    limit stays inert until the caller starts passing a tenant.
    A session dimension takes the session's root (:attr:`Context.session_key`),
    so a session and its forks count on one counter.
    """
    values: list[str] = []
    for dim in dims:
        value = ctx.session_key if dim is Scope.SESSION else getattr(ctx, dim.value)
        if value is None:
            return None
        values.append(value)
    return tuple(values)
