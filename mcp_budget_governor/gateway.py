"""What ``mcpbg proxy`` adds to a policy file: prices by tool name or glob, and who calls.

A ``[gateway]`` table in the policy file (the rest of the file is the usual
policy; :mod:`mcp_budget_governor.policy_file` leaves this table to this module)::

    [gateway]
    charge = ["spend"]            # the money limits a price is charged to (default: every one)
    default_cost_usd = "0.001"    # a tool no pattern names
    user = "alice"                # stdio: the local user (else MCPBG_USER, else the login name)
    user_header = "x-mcpbg-user"  # HTTP: the caller's user id from this header
    [gateway.bearer]              # HTTP: or from the bearer token (token = user)
    "tok-3f9a" = "alice"
    [gateway.tools]               # dollars per call, by exact name first, then glob, in order
    "brave_*" = "0.01"
    "read_file" = "0"

Prices come from here only: an upstream is not trusted to price itself, so the
``mcpbg`` price in its tools' ``meta`` is ignored. Pure: no I/O but reading
the file it is given.

>>> from mcp_budget_governor import Limit, Policy, Unit, Window, usd
>>> p = Policy.of(Limit("spend", cap=usd(5), window=Window.DAY, unit=Unit.USD_MICROS))
>>> g = GatewayConfig.from_table(p, {"default_cost_usd": "0.001", "tools": {"brave_*": "0.01"}})
>>> g.price("brave_search"), g.price("echo")
({'spend': 10000}, {'spend': 1000})
"""

from __future__ import annotations

import fnmatch
import getpass
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidInputError
from .money import Unit, usd
from .policy import Policy

#: The policy file's table for the gateway.
TABLE = "gateway"
_KEYS = ("charge", "default_cost_usd", "user", "user_header", "bearer", "tools")


@dataclass(frozen=True)
class GatewayConfig:
    """The ``[gateway]`` table, validated against its policy (see the module docstring)."""

    #: Charges per call by tool pattern, in order: exact names first, then globs.
    tools: tuple[tuple[str, Mapping[str, int]], ...] = ()
    default: Mapping[str, int] | None = None
    user: str | None = None
    user_header: str | None = None
    bearer: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_table(cls, policy: Policy, table: Mapping[str, Any] | None) -> GatewayConfig:
        """Validate ``table`` (the parsed ``[gateway]``); errors name ``gateway.<key>``."""
        t = dict(table or {})
        for key in t:
            if key not in _KEYS:
                raise InvalidInputError(
                    f"gateway.{key}", t[key], f"unknown key ({', '.join(_KEYS)})"
                )
        money = [lim.name for lim in policy.limits if lim.unit is Unit.USD_MICROS]
        charge = t.get("charge", money)
        if isinstance(charge, str):
            charge = [charge]
        if not isinstance(charge, list) or not all(isinstance(n, str) for n in charge):
            raise InvalidInputError("gateway.charge", charge, "expected a limit name or a list")
        for name in charge:
            if name not in money:
                known = ", ".join(money) or "none"
                raise InvalidInputError("gateway.charge", name, f"no such money limit ({known})")

        def charges(where: str, dollars: Any) -> dict[str, int]:
            if not isinstance(dollars, str | int) or isinstance(dollars, bool):
                raise InvalidInputError(where, dollars, 'expected dollars as a string, e.g. "0.01"')
            try:
                amount = usd(dollars)
            except InvalidInputError as exc:
                raise InvalidInputError(where, dollars, exc.problem) from None
            if amount and not charge:
                raise InvalidInputError(where, dollars, "a price needs a money limit to charge")
            return dict.fromkeys(charge, amount)

        tools = t.get("tools", {})
        if not isinstance(tools, Mapping):
            raise InvalidInputError("gateway.tools", tools, 'expected a table: "name*" = "0.01"')
        rules = [(k, charges(f"gateway.tools.{k}", v)) for k, v in tools.items()]
        rules.sort(key=lambda r: _is_glob(r[0]))  # stable: exact names, then globs in order
        default = t.get("default_cost_usd")
        bearer = t.get("bearer", {})
        if not isinstance(bearer, Mapping) or not all(
            isinstance(v, str) and v for v in bearer.values()
        ):
            raise InvalidInputError("gateway.bearer", "…", "expected a table of token = user")
        for key in ("user", "user_header"):
            if key in t and (not isinstance(t[key], str) or not t[key]):
                raise InvalidInputError(f"gateway.{key}", t[key], "expected a non-empty string")
        return cls(
            tools=tuple(rules),
            default=None if default is None else charges("gateway.default_cost_usd", default),
            user=t.get("user"),
            user_header=t.get("user_header"),
            bearer=dict(bearer),
        )

    @classmethod
    def from_file(cls, policy: Policy, path: str | os.PathLike[str]) -> GatewayConfig:
        """The ``[gateway]`` table of the policy file at ``path`` (none: no prices)."""
        if not os.fspath(path).lower().endswith(".toml"):
            return cls()  # a policy given as module:attribute has no gateway table
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        return cls.from_table(policy, doc.get(TABLE))

    def price(self, tool: str) -> dict[str, int] | None:
        """The charges of one call to ``tool``: its pattern's, else the default."""
        for pattern, charges in self.tools:
            if pattern == tool or (_is_glob(pattern) and fnmatch.fnmatchcase(tool, pattern)):
                return dict(charges)
        return None if self.default is None else dict(self.default)

    def local_user(self, environ: Mapping[str, str]) -> str | None:
        """The stdio caller: ``user``, else the ``user`` setting, else the login name."""
        from .settings import SETTINGS

        named = self.user or environ.get(SETTINGS["user"].env)
        if named:
            return named
        try:
            return getpass.getuser()  # LOGNAME, USER, ... else the password database
        except (OSError, KeyError):  # pragma: no cover - a uid without a name
            return None

    def http_user(self, headers: Mapping[str, str]) -> str | None:
        """The HTTP caller from lower-cased ``headers``: the bearer mapping, else the header."""
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer " and auth[7:].strip() in self.bearer:
            return self.bearer[auth[7:].strip()]
        if self.user_header is not None:
            return headers.get(self.user_header.lower()) or None
        return None


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")
