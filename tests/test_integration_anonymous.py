"""Unidentified callers are never silently unlimited: ``Policy.anonymous``.

An integration hands ``Policy.identified`` what its ``identify`` produced. A
caller without a user id is refused (the default) or counted in one anonymous
bucket, the user id ``""``, whose key no real user id can produce.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_budget_governor import (
    ANONYMOUS_USER,
    Anonymous,
    Context,
    Governor,
    Limit,
    LimitExceeded,
    MemoryBackend,
    Policy,
    PolicyError,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.planning import slot
from mcp_budget_governor.windows import UTC

NOW = 1_764_374_400.0 + 3_723.5
BURST = Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER)
PER_TOOL = Limit("per_tool", cap=100, window=Window.DAY, scope=Scope.TOOL)
# Every scope that includes USER: the limits an unnamed caller would slip past.
USER_SCOPES = [
    (Scope.USER, *extra)
    for n in range(len(Scope))
    for extra in itertools.combinations([s for s in Scope if s is not Scope.USER], n)
]


def test_default_is_refuse_and_the_value_is_validated() -> None:
    assert Policy.of(BURST).anonymous is Anonymous.REFUSE
    assert Policy.of(BURST, anonymous="SHARED").anonymous is Anonymous.SHARED
    assert Policy((BURST,), anonymous="shared").anonymous is Anonymous.SHARED  # type: ignore[arg-type]
    with pytest.raises(PolicyError) as exc:
        Policy.of(BURST, anonymous="allow")
    assert exc.value.field == "Policy.anonymous"
    assert exc.value.value == "allow"
    assert "one of REFUSE, SHARED" in str(exc.value)


@pytest.mark.parametrize("user", [None, ""])
def test_refuse_raises_a_403_naming_the_per_user_limit(user: str | None) -> None:
    policy = Policy.of(PER_TOOL, BURST)
    with pytest.raises(LimitExceeded) as exc:
        policy.identified(Context(user=user, tool="search"))
    d = exc.value.decision
    assert (d.admitted, d.status, d.limit, d.reason) == (False, 403, "burst", "caller_unidentified")
    assert d.retry_after is None  # waiting does not identify anyone


def test_shared_counts_unnamed_callers_in_one_bucket() -> None:
    policy = Policy.of(BURST, anonymous=Anonymous.SHARED)
    for ctx in (Context(tool="a"), Context(user="", tool="a"), Context(tenant="t", tool="a")):
        got = policy.identified(ctx)
        assert got.user == ANONYMOUS_USER
        assert (got.tenant, got.tool) == (ctx.tenant, ctx.tool)


@pytest.mark.parametrize("mode", list(Anonymous))
def test_named_callers_and_policies_without_per_user_limits_pass_unchanged(
    mode: Anonymous,
) -> None:
    named = Context(user="u_42", tool="a")
    assert Policy.of(BURST, anonymous=mode).identified(named) is named
    nobody = Context(tool="a")
    assert Policy.of(PER_TOOL, anonymous=mode).identified(nobody) is nobody


async def test_shared_bucket_enforces_its_cap_across_unnamed_callers() -> None:
    policy = Policy.of(BURST, anonymous=Anonymous.SHARED)
    gov = Governor(policy, MemoryBackend(clock=lambda: NOW), clock=lambda: NOW)
    callers = [Context(tool="a"), Context(user="", tool="b"), Context(session="s", tool="a")]
    statuses = [(await gov.check(policy.identified(c))).status for c in callers]
    assert statuses == [200, 200, 429]
    assert await gov.usage("burst", Context(user=ANONYMOUS_USER)) == 2
    # A real user is untouched by the anonymous spend.
    assert (await gov.check(policy.identified(Context(user="u_1")))).status == 200


@settings(max_examples=300, deadline=None)
@given(
    user=st.text(st.characters(codec="utf-8"), min_size=1, max_size=300),
    dims=st.sampled_from(USER_SCOPES),
    others=st.text(st.characters(codec="utf-8"), max_size=20),
)
def test_no_real_user_id_shares_the_anonymous_key(
    user: str, dims: tuple[Scope, ...], others: str
) -> None:
    """Invariant 7 for the anonymous bucket: every non-empty id keys elsewhere,
    whatever the other dimensions hold (the same tenant, tool, session)."""
    lim = Limit("l", cap=1, window=Window.DAY, scope=dims, unit=Unit.CALLS)
    rest = {"tenant": others, "tool": others, "session": others, "agent": others, "call": others}
    anon = Policy.of(lim, anonymous="shared").identified(Context(**rest))
    real = Context(user=user, **rest)
    anon_slot = slot(lim, anon, NOW, UTC, 1, enforce=True)
    real_slot = slot(lim, real, NOW, UTC, 1, enforce=True)
    assert anon_slot is not None and real_slot is not None
    assert anon_slot.key != real_slot.key
    assert "user=:" in anon_slot.key or "user=," in anon_slot.key


async def test_a_refused_unnamed_caller_is_a_rejection_in_the_ledger() -> None:
    from mcp_budget_governor.ledger import EntryType
    from mcp_budget_governor.producers.memory_ledger import MemoryLedger

    ledger = MemoryLedger()
    gov = Governor(Policy.of(BURST, PER_TOOL), MemoryBackend(), ledger=ledger)
    with pytest.raises(LimitExceeded) as refused:
        await gov.identified(Context(tool="search"))
    assert refused.value.decision.status == 403
    (entry,) = ledger.entries
    assert entry.type is EntryType.REJECTED
    assert (entry.limit, entry.status, entry.charges) == ("burst", 403, ())
    assert entry.context == Context(tool="search")
    # A named caller passes unchanged and appends nothing.
    named = Context(user="u", tool="search")
    assert await gov.identified(named) == named
    assert len(ledger.entries) == 1
