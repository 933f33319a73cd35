"""An approval over an ``OnExceed.ASK`` limit, spent once, by the caller it was given to.

A 2026-07-28 client's approval travels in the ``requestState`` the server sealed
with its question: :func:`approval_state` is the text sealed there (the limit, a
digest of the caller ``identify()`` produced, a one-time id and when it lapses).
On the retry, :func:`open_approval` gives the :class:`Approval` back only to the
same caller before it lapses; the governor then charges a marker counter
(:func:`spend_op`, cap 1) in the same atomic step as the admission it allows, so
a second use of the state, by anyone, is refused like an unapproved call.

>>> from mcp_budget_governor.context import Context
>>> ana = Context(user="ana", tool="search")
>>> state = approval_state("daily", ana, now=1000.0, ttl=120.0)
>>> approval = open_approval(state, ana, now=1010.0)
>>> (str(approval), approval.until, len(approval.once))
('daily', 1120, 32)
>>> open_approval(state, Context(user="bob", tool="search"), now=1010.0) is None
True
>>> open_approval(state, ana, now=1121.0) is None
True
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
from typing import Any

from .context import Context
from .counters import CounterOp
from .keys import SPENT_PREFIX

__all__ = ["Approval", "approval_state", "caller_key", "open_approval", "spend_op"]

#: The sealed text's version: a state of another shape (an older release's bare
#: limit name) opens to nothing, and the caller is asked again.
VERSION = "mcpbg2"

_ONCE = re.compile(r"[0-9a-f]{32}")


class Approval(str):
    """The name of the ``OnExceed.ASK`` limit approved, spendable once: ``once`` is
    its one-time id, ``until`` (epoch seconds) when it lapses. A ``str``, so it goes
    wherever an approved limit's name goes (``Governor.check(approved=...)``)."""

    __slots__ = ("once", "until")
    once: str
    until: int

    def __new__(cls, limit: str, once: str, until: int) -> Approval:
        self = super().__new__(cls, limit)
        self.once = once
        self.until = until
        return self


def caller_key(ctx: Context) -> str:
    """A digest of every field of ``ctx``: equal for the same caller and tool only."""
    fields = [ctx.user, ctx.tenant, ctx.tool, ctx.session, ctx.agent, ctx.session_root]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def approval_state(limit: str, caller: Context, *, now: float, ttl: float) -> str:
    """The text to seal into the question's ``requestState``: ``ttl`` seconds to answer."""
    return json.dumps(
        [VERSION, limit, caller_key(caller), secrets.token_hex(16), int(now + ttl)],
        separators=(",", ":"),
    )


def open_approval(state: Any, caller: Context, *, now: float) -> Approval | None:
    """The approval ``state`` carries for ``caller`` at ``now``; None for a state of
    another shape, another caller, or one that has lapsed."""
    if not isinstance(state, str) or not state.startswith(f'["{VERSION}"'):
        return None
    try:
        parts = json.loads(state)
    except ValueError:
        return None
    if not isinstance(parts, list) or len(parts) != 5:
        return None
    _, limit, key, once, until = parts
    if not (
        isinstance(limit, str)
        and key == caller_key(caller)
        and isinstance(once, str)
        and _ONCE.fullmatch(once)
        and until.__class__ is int
        and now < until
    ):
        return None
    return Approval(limit, once, until)


def spend_op(approval: Approval, lead: float = 0.0) -> CounterOp:
    """The marker the admission charges: cap 1, so it fits once; it lives until the
    approval lapses (a spent approval cannot be used after that anyway). ``lead``:
    seconds the store's clock runs ahead of this one (a governor's simulated clock),
    so the marker outlives the approval there too."""
    expire_at = approval.until + 1 + math.ceil(max(lead, 0.0))
    return CounterOp(f"{SPENT_PREFIX}:{approval.once}", 1, 1, True, expire_at)
