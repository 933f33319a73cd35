"""Run-time changes (caps, plans, grants, resets) for the schema's property tests."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from mcp_budget_governor.bounds import LATEST_TIME
from mcp_budget_governor.caps import PLANS_KEY, Change, ChangeKind, caps_key
from mcp_budget_governor.context import Context
from mcp_budget_governor.keys import counter_key
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.money import MAX_AMOUNT
from mcp_budget_governor.provenance import CHANGE_KINDS
from mcp_budget_governor.windows import SESSION_TTL_SECONDS, Window, bucket_for

__all__ = ["CHANGE_KINDS", "changes_for"]

# (scope segment, the context that names it)
_SCOPES = [
    ("tenant=acme", Context(tenant="acme")),
    ("user=a%3Ab", Context(user="a:b")),
    ("user=u_1,tool=search", Context(user="u_1", tool="search")),
]


@st.composite
def changes_for(draw: st.DrawFn, kind: EntryType, now: float) -> tuple[Change, Context]:
    """A change of ``kind`` as a governor writes it at ``now``, and the event's context."""
    change = ChangeKind(kind.value)
    actor = draw(st.text(max_size=8))
    reason = draw(st.text(max_size=16))
    if change in (ChangeKind.CAP_SET, ChangeKind.CAP_UNSET):
        field, ctx = draw(st.sampled_from(_SCOPES))
        cap = draw(st.integers(0, MAX_AMOUNT)) if change is ChangeKind.CAP_SET else 0
        until = draw(st.integers(0, LATEST_TIME)) if change is ChangeKind.CAP_SET else 0
        change_ = Change(change, "lim", caps_key("lim"), field, cap, until, None, actor, reason)
        return change_, ctx
    if change is ChangeKind.PLAN_ASSIGNED:
        field, ctx = draw(st.sampled_from(_SCOPES[:2]))
        plan = draw(st.sampled_from([None, "pro", "free"]))
        return Change(change, "lim", PLANS_KEY, field, plan=plan, actor=actor, reason=reason), ctx
    scope, ctx = draw(st.sampled_from([("global", Context()), _SCOPES[0]]))
    if draw(st.booleans()):
        bucket = bucket_for(Window.DAY, now)
        key, until = counter_key("lim", scope, bucket.label), bucket.expire_at(0)
    else:  # a session counter lives a session's life past its last write
        key = counter_key("lim", scope, "session")
        until = draw(st.integers(1, math.ceil(now) + SESSION_TTL_SECONDS))
    amount = draw(st.integers(1 if change is ChangeKind.GRANTED else 0, MAX_AMOUNT))
    return Change(change, "lim", key, "", amount, until, None, actor, reason), ctx
