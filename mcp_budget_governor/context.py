"""Who is calling: the context a check or a charge is made for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInputError
from .scopes import Scope, scope_values


@dataclass(frozen=True, slots=True)
class Context:
    """The caller's identity along every scope dimension; any may be unknown (None).

    ``session_root`` names the session a forked ``session`` descends from:
    every ``Scope.SESSION`` counter (so every ``Window.SESSION`` budget) keys
    on the root, so a session and its forks share one budget; the ledger
    records both. Without it a session is its own root.

    >>> Context(user="u_42", tool="search").with_tool("fetch").tool
    'fetch'
    >>> Context(session="fork-7", session_root="fix-4821").session_key
    'fix-4821'
    """

    user: str | None = None
    tenant: str | None = None
    tool: str | None = None
    session: str | None = None
    agent: str | None = None
    session_root: str | None = None
    #: The call's tool and arguments hashed (:func:`~.repeats.call_hash`); set by
    #: the integrations only when a limit counts per ``Scope.CALL``.
    call: str | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value: Any = getattr(self, f.name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise InvalidInputError(f"Context.{f.name}", value, "expected a string or None")
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    # A lone surrogate (bytes decoded with surrogateescape) is not
                    # text: it could not be written to the ledger or shown to anyone.
                    raise InvalidInputError(
                        f"Context.{f.name}", value, "not valid Unicode (lone surrogate)"
                    ) from None
        if self.session_root is not None and self.session is None:
            raise InvalidInputError(
                "Context.session_root", self.session_root, "needs a session (the fork it roots)"
            )

    @property
    def session_key(self) -> str | None:
        """The session whose budget this caller spends: its root, else the session itself."""
        return self.session if self.session_root is None else self.session_root

    def as_scope_map(self) -> dict[Any, str]:
        """The values this context names, by :class:`Scope` (the unknown ones left out).

        >>> Context(user="u").as_scope_map()
        {<Scope.USER: 'user'>: 'u'}
        """
        return {s: v for s in Scope if (v := getattr(self, s.value, None)) is not None}

    def satisfies(self, limit: Any) -> bool:
        """Whether this context names every scope dimension of ``limit`` (so it counts)."""
        return scope_values(limit.dimensions, self) is not None

    def with_tool(self, tool: str | None) -> Context:
        """The same caller, using another tool."""
        return dataclasses.replace(self, tool=tool)


#: Caches keyed by a context (the governor's plans, the ledger's encoded
#: contexts) keep it only if its values total at most this many characters:
#: 4,096 entries of them stay within a few MiB, whatever callers send.
CACHED_CONTEXT_CHARS = 512


def cacheable(ctx: Context) -> bool:
    """Whether caches may keep ``ctx`` (see :data:`CACHED_CONTEXT_CHARS`)."""
    total = 0
    for value in (ctx.user, ctx.tenant, ctx.tool, ctx.session, ctx.agent, ctx.session_root):
        if value is not None:
            total += len(value)
    return total <= CACHED_CONTEXT_CHARS


EMPTY = Context()
"""The caller nobody named: every scope unknown."""

ANONYMOUS_USER = ""
"""The user id of the anonymous bucket (``Policy(anonymous=Anonymous.SHARED)``).

The empty string names nobody, so no caller with a real id lands in this
bucket; key escaping is injective, so no other id's key equals its ``user=``.
"""
