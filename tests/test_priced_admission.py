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


async def test_the_projection_moves_each_events_in_flight_amounts_once(backend: Backend) -> None:
    """Priced admissions (some refused) in ledger mode, then the ledger's events applied
    to the same store, as the worker applies them: every counter committed at the sum
    of its events' charges, nothing left in flight, on every store that prices at
    admission. A cost event whose amounts sat under the admission's id would leave
    them in flight for good."""
    from mcp_budget_governor.events import encode, parse
    from mcp_budget_governor.stream.projector import WatermarkBackend, to_applied

    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    for _ in range(7):  # $0.05 of room: five admitted, two refused
        async with gov.admitted(ANA, price={"spend": usd("0.01")}):
            pass
    assert [e.type for e in ledger.entries].count(EntryType.METERED) == 5
    assert isinstance(backend, WatermarkBackend)
    events = [
        to_applied(parse(encode(entry, "test")), offset)
        for offset, entry in enumerate(ledger.entries)
    ]
    await backend.apply("priced:0", events)
    for limit, total in (("calls", 5), ("spend", usd("0.05"))):
        state = await backend.state(gov._read_slot(limit, ANA).key)
        assert (state.committed, state.in_flight, state.pending) == (total, 0, {}), limit
