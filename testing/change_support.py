"""Run-time changes (caps, plans, grants, resets) for the schema's property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from mcp_budget_governor.caps import PLANS_KEY, Change, ChangeKind, caps_key
from mcp_budget_governor.keys import counter_key
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.money import MAX_AMOUNT
from mcp_budget_governor.provenance import CHANGE_KINDS

__all__ = ["CHANGE_KINDS", "changes_for"]


@st.composite
def changes_for(draw: st.DrawFn, kind: EntryType) -> Change:
    """A change of ``kind`` as a governor writes it."""
    change = ChangeKind(kind.value)
    actor = draw(st.text(max_size=8))
    reason = draw(st.text(max_size=16))
    if change in (ChangeKind.CAP_SET, ChangeKind.CAP_UNSET):
        field = draw(st.sampled_from(["tenant=acme", "user=a%3Ab", "user=u_1,tool=search"]))
        cap = draw(st.integers(0, MAX_AMOUNT)) if change is ChangeKind.CAP_SET else 0
        until = draw(st.integers(0, 2**40)) if change is ChangeKind.CAP_SET else 0
        return Change(change, "lim", caps_key("lim"), field, cap, until, None, actor, reason)
    if change is ChangeKind.PLAN_ASSIGNED:
        field = draw(st.sampled_from(["tenant=acme", "user=a%3Ab"]))
        plan = draw(st.sampled_from([None, "pro", "free"]))
        return Change(change, "lim", PLANS_KEY, field, plan=plan, actor=actor, reason=reason)
    key = counter_key("lim", draw(st.sampled_from(["global", "tenant=acme"])), "20261129")
    amount = draw(st.integers(1 if change is ChangeKind.GRANTED else 0, MAX_AMOUNT))
    return Change(change, "lim", key, "", amount, draw(st.integers(1, 2**40)), None, actor, reason)
