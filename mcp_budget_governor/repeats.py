"""The loop guard: a cap on identical calls, the same tool with the same arguments.

An agent stuck in a loop calls one tool with the same arguments again and
again, within every rate limit. A limit whose scope includes
:attr:`Scope.CALL <mcp_budget_governor.scopes.Scope.CALL>` counts per call
hash (:func:`call_hash`): ``scope = ["session", "call"]``, ``cap = 3``,
``window = "minute"`` admits three identical calls per session and minute and
refuses the rest with a text telling the agent it is repeating itself. It is an
ordinary count limit, so it rides the same one-round-trip admission as every
other limit. The integrations set :attr:`Context.call` only when such a limit
exists.

The hash is a contract (TypeScript computes the same, ``conformance/`` holds
vectors): SHA-256 over the tool's name, a newline, and the arguments as
canonical JSON (keys sorted by code point, no whitespace, non-ASCII as is,
integral numbers as integers, other numbers as JavaScript writes them, as
RFC 8785 does), as 32 lowercase hex digits. Integers past 2^53 are not
portable between the languages.

>>> call_hash("search", {"q": "mcp", "n": 3}) == call_hash("search", {"n": 3.0, "q": "mcp"})
True
>>> canonical_json({"b": [1, 2.5, None], "a": "é"})
'{"a":"é","b":[1,2.5,null]}'
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any

from .context import Context
from .errors import InvalidInputError
from .policy import Policy
from .scopes import Scope

#: Hex digits of the hash kept in the key: 128 bits, collisions out of reach.
HASH_HEX = 32


def canonical_json(value: Any) -> str:
    """``value`` as canonical JSON (see the module docstring); a value JSON cannot
    hold (NaN, a set, an object) raises :class:`InvalidInputError`."""
    return "".join(_write(value))


def _write(value: Any) -> Iterator[str]:
    if value is None or isinstance(value, bool):
        yield "null" if value is None else ("true" if value else "false")
    elif isinstance(value, str):
        yield json.dumps(value, ensure_ascii=False)
    elif isinstance(value, int | float):
        yield es_number(value)
    elif isinstance(value, Mapping):
        yield "{"
        for i, key in enumerate(sorted(map(_key, value))):
            yield ("," if i else "") + json.dumps(key, ensure_ascii=False) + ":"
            yield from _write(value[key])
        yield "}"
    elif isinstance(value, list | tuple):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _write(item)
        yield "]"
    else:
        raise InvalidInputError("arguments", type(value).__name__, "not a JSON value")


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise InvalidInputError("arguments", key, "an object key must be a string")
    return key


def es_number(value: float) -> str:
    """A number as ECMAScript's ``Number.prototype.toString`` writes it (RFC 8785).

    >>> [es_number(x) for x in (3, 3.0, 0.1, 1e-7, 1e21, -2.5e-300)]
    ['3', '3', '0.1', '1e-7', '1e+21', '-2.5e-300']
    """
    if isinstance(value, int) and abs(value) < 10**21:
        return str(value)
    x = float(value)
    if not math.isfinite(x):
        raise InvalidInputError("arguments", value, "not a JSON number")
    if x == 0:
        return "0"
    _, digits, exponent = Decimal(repr(abs(x))).normalize().as_tuple()
    s = "".join(map(str, digits))
    k = len(s)
    n = k + int(exponent)  # the value is 0.<s> times 10^n
    minus = "-" if x < 0 else ""
    if k <= n <= 21:
        return f"{minus}{s}{'0' * (n - k)}"
    if 0 < n <= 21:
        return f"{minus}{s[:n]}.{s[n:]}"
    if -6 < n <= 0:
        return f"{minus}0.{'0' * -n}{s}"
    e = n - 1
    mantissa = s if k == 1 else f"{s[0]}.{s[1:]}"
    return f"{minus}{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"


def call_hash(tool: str, arguments: Any) -> str:
    """The identity of one call: its tool and canonical arguments, hashed."""
    text = f"{tool}\n{canonical_json({} if arguments is None else arguments)}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_HEX]


def counts_calls(policy: Policy) -> bool:
    """Whether a limit of ``policy`` counts identical calls (so a call needs its hash)."""
    return any(Scope.CALL in lim.dimensions for lim in policy.limits)


def with_call(policy: Policy, ctx: Context, tool: str, arguments: Any) -> Context:
    """``ctx`` with the call's hash when the policy has a loop guard, else as it is."""
    if not counts_calls(policy):
        return ctx
    return dataclasses.replace(ctx, call=call_hash(tool, arguments))


def is_repeat(reason: str) -> bool:
    """Whether a refusal's reason (``budget_exceeded:session+call/minute``) is the loop guard's.

    >>> is_repeat("budget_exceeded:session+call/minute"), is_repeat("budget_exceeded:user/day")
    (True, False)
    """
    scope = reason.partition(":")[2].partition("/")[0]
    return Scope.CALL.value in scope.split("+")
