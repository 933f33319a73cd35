"""Who is calling: the context a check or a charge is made for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class Context:
    """The caller's identity along every scope dimension; any may be unknown (None).

    >>> Context(user="u_42", tool="search").with_tool("fetch").tool
    'fetch'
    """

    user: str | None = None
    tenant: str | None = None
    tool: str | None = None
    session: str | None = None
    agent: str | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value: Any = getattr(self, f.name)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"Context.{f.name}", value, "expected a string or None")

    def with_tool(self, tool: str | None) -> Context:
        """The same caller, using another tool."""
        return dataclasses.replace(self, tool=tool)


EMPTY = Context()
