"""A fixed price charged by the admission (``Governor.admitted(price=)``, issue 33):
one charge, two ledger events, each one's in-flight amounts under its own id."""

from __future__ import annotations

import pytest

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.errors import LimitExceeded
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.producers.memory_ledger import MemoryLedger

ANA = Context(user="ana", tenant="acme", tool="search")


def policy(**spend: object) -> Policy:
    return Policy.of(
        Limit("calls", cap=100, window=Window.DAY, scope=Scope.USER),
        Limit("spend", cap=usd("0.05"), window=Window.DAY, unit=Unit.USD_MICROS, **spend),  # type: ignore[arg-type]
    )


async def test_the_price_is_charged_with_the_admission_under_its_own_event(
    backend: Backend,
) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    admission = gov.admitted(ANA, price={"spend": usd("0.01")})
    async with admission as decision:
        assert decision.admitted
    # One round trip where the backend can; elsewhere the integrations meter it after.
    assert admission.price_charged is gov.prices_at_admission
    if not gov.prices_at_admission:
        return
    admitted, cost = ledger.entries
    assert (admitted.type, [(c.limit, c.amount) for c in admitted.charges]) == (
        EntryType.ADMITTED,
        [("calls", 1)],
    )
    assert (cost.type, [(c.limit, c.amount) for c in cost.charges]) == (
        EntryType.METERED,
        [("spend", usd("0.01"))],
    )
    spend = await backend.state(gov._read_slot("spend", ANA).key)
    calls = await backend.state(gov._read_slot("calls", ANA).key)
    assert spend.pending == {cost.id: usd("0.01")}  # the projection moves each once
    assert calls.pending == {admitted.id: 1}


@pytest.mark.parametrize("backend", ["memory", "redis", "postgres"], indirect=True)
async def test_a_price_that_does_not_fit_a_checked_limit_refuses_and_charges_nothing(
    backend: Backend,
) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    for _ in range(5):
        async with gov.admitted(ANA, price={"spend": usd("0.01")}) as decision:
            assert decision.admitted
    async with gov.admitted(ANA, price={"spend": usd("0.01")}) as decision:
        assert not decision.admitted and decision.limit == "spend"
    with pytest.raises(LimitExceeded):
        decision.raise_for_status()
    assert await gov.usage("spend", ANA) == usd("0.05")  # never past the cap
    assert await gov.usage("calls", ANA) == 5  # the refused call counted nothing
    assert [e.type for e in ledger.entries[-1:]] == [EntryType.REJECTED]


@pytest.mark.parametrize("backend", ["memory", "redis", "postgres"], indirect=True)
async def test_a_metered_only_limit_is_charged_past_its_cap_as_a_meter_would(
    backend: Backend,
) -> None:
    gov = Governor(policy(gated=False), backend)  # DENY, but check() never consults it
    for _ in range(7):
        async with gov.admitted(ANA, price={"spend": usd("0.01")}) as decision:
            assert decision.admitted and decision.over == ()
    assert await gov.usage("spend", ANA) == usd("0.07")
