"""A policy: the list of limits a governor enforces."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import tzinfo
from typing import Any

from .errors import PolicyError
from .limits import Limit
from .windows import zone


@dataclass(frozen=True)
class Policy:
    """An ordered, validated set of limits with unique names.

    ``timezone`` (an IANA name) sets where DAY and MONTH windows begin; UTC
    when omitted.

    >>> from mcp_budget_governor import Limit, Scope, Window
    >>> policy = Policy.of(Limit("per_user", cap=100, window=Window.DAY, scope=Scope.USER))
    >>> policy["per_user"].cap
    100
    """

    limits: tuple[Limit, ...]
    timezone: str | None = None

    def __post_init__(self) -> None:
        seen: set[str] = set()
        limits = self.limits
        if not isinstance(limits, tuple | list):
            raise PolicyError("Policy.limits", limits, "expected a sequence of Limit")
        for i, limit in enumerate(limits):
            if not isinstance(limit, Limit):
                raise PolicyError(f"Policy.limits[{i}]", limit, "expected a Limit")
            if limit.name in seen:
                raise PolicyError(f"Policy.limits[{i}].name", limit.name, "duplicate limit name")
            seen.add(limit.name)
        object.__setattr__(self, "limits", tuple(limits))
        object.__setattr__(self, "_by_name", {lim.name: lim for lim in limits})
        object.__setattr__(self, "_tz", zone(self.timezone))

    @classmethod
    def of(cls, *limits: Limit, timezone: str | None = None) -> Policy:
        """Build a policy from limits given as arguments."""
        return cls(tuple(limits), timezone=timezone)

    @property
    def tz(self) -> tzinfo:
        """The resolved time zone for DAY and MONTH buckets."""
        tz: tzinfo = self.__dict__["_tz"]
        return tz

    def __getitem__(self, name: str) -> Limit:
        by_name: dict[str, Limit] = self.__dict__["_by_name"]
        try:
            return by_name[name]
        except KeyError:
            raise PolicyError(
                "limit", name, f"no such limit (known: {', '.join(by_name)})"
            ) from None

    def __contains__(self, name: Any) -> bool:
        return name in self.__dict__["_by_name"]

    def __iter__(self) -> Iterator[Limit]:
        return iter(self.limits)

    def __len__(self) -> int:
        return len(self.limits)
