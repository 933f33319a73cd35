"""One completed call metered on several limits is one ledger event with one charge each.

Spend queries read an event's dollars once (``projections/ledger_view.py``), so
a cost charged to a user's budget and to a global one must travel as one event:
two events of the same dollars would be counted twice.
"""

from __future__ import annotations

import pytest

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    MemoryBackend,
    Policy,
    PriceTable,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.producers.emit import Recorder
from mcp_budget_governor.producers.memory_ledger import MemoryLedger

PRICES = PriceTable().with_price("m", 3, 15)


def policy() -> Policy:
    return Policy.of(
        Limit("user_spend", cap=usd(1), window=Window.DAY, scope=Scope.USER,
              unit=Unit.USD_MICROS, gated=False),
        Limit("tenant_spend", cap=usd(5), window=Window.DAY, scope=Scope.TENANT,
              unit=Unit.USD_MICROS, gated=False),
        Limit("global_spend", cap=usd(10), window=Window.DAY, unit=Unit.USD_MICROS,
              breaker=True, gated=False),
        Limit("user_tokens", cap=1_000_000, window=Window.DAY, scope=Scope.USER,
              unit=Unit.TOKENS, gated=False),
    )  # fmt: skip


async def test_meter_on_two_limits_is_one_event_charging_both(backend: Backend) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    ctx = Context(user="u1")  # no tenant: tenant_spend does not apply
    got = await gov.meter(("user_spend", "tenant_spend", "global_spend"), usd("0.25"), ctx)
    assert got.charged == usd("0.25") and got.limit == "user_spend"
    (entry,) = ledger.entries
    assert entry.type is EntryType.METERED
    assert [(c.limit, c.amount) for c in entry.charges] == [
        ("user_spend", usd("0.25")),
        ("global_spend", usd("0.25")),
    ]
    assert await gov.usage("user_spend", ctx) == usd("0.25")
    assert await gov.usage("global_spend") == usd("0.25")


async def test_meter_tokens_prices_usd_limits_and_counts_token_limits(backend: Backend) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger, prices=PRICES)
    ctx = Context(user="u1")
    cost = await gov.meter_tokens(
        ["user_tokens", "global_spend"], "m", input_tokens=1_000, output_tokens=100, ctx=ctx
    )
    assert cost.charged == 1_100  # the first named limit counts tokens
    (entry,) = ledger.entries
    assert [(c.limit, c.amount) for c in entry.charges] == [
        ("user_tokens", 1_100),
        ("global_spend", 3 * 1_000 + 15 * 100),
    ]
    assert entry.usage is not None and entry.usage.price_version == PRICES.version
    assert await gov.usage("user_tokens", ctx) == 1_100
    assert await gov.usage("global_spend") == 4_500


async def test_meter_charges_charges_each_limit_its_amount_in_one_event(backend: Backend) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    ctx = Context(user="u1", tenant="t")
    await gov.meter_charges({"user_tokens": 40, "tenant_spend": 7}, ctx)
    (entry,) = ledger.entries
    charged = [(c.limit, c.amount) for c in entry.charges]
    assert charged == [("user_tokens", 40), ("tenant_spend", 7)]
    assert await gov.usage("tenant_spend", ctx) == 7


@pytest.mark.parametrize(
    ("limit", "problem"),
    [((), "at least one"), (("user_spend", "user_spend"), "twice")],
)
async def test_bad_limit_lists_are_refused_and_charge_nothing(
    backend: Backend, limit: tuple[str, ...], problem: str
) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    with pytest.raises(InvalidInputError, match=problem):
        await gov.meter(limit, 5, Context(user="u1"))
    assert ledger.entries == []
    assert await gov.usage("user_spend", Context(user="u1")) == 0


async def test_one_bad_amount_meters_nothing(backend: Backend) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    with pytest.raises(InvalidInputError, match="charges\\['global_spend'\\]"):
        await gov.meter_charges({"user_spend": 5, "global_spend": -1}, Context(user="u1"))
    assert ledger.entries == []
    assert await gov.usage("user_spend", Context(user="u1")) == 0


async def test_recorder_appends_the_same_single_event() -> None:
    ledger = MemoryLedger()
    rec = Recorder(policy(), ledger, prices=PRICES, clock=lambda: 1_700_000_000.0)
    gov_ledger = MemoryLedger()
    gov = Governor(
        policy(), MemoryBackend(), ledger=gov_ledger, prices=PRICES, clock=lambda: 1_700_000_000.0
    )
    ctx = Context(user="u1", tenant="t")
    for target in (rec, gov):
        await target.meter_tokens(
            ("user_spend", "global_spend"), "m", input_tokens=10, output_tokens=2, ctx=ctx
        )
    (a,), (b,) = ledger.entries, gov_ledger.entries
    assert a.charges == b.charges and a.usage == b.usage


async def test_meter_tokens_refuses_a_calls_limit_and_charges_nothing(backend: Backend) -> None:
    ledger = MemoryLedger()
    pol = Policy.of(*policy(), Limit("calls", cap=10, window=Window.DAY))
    gov = Governor(pol, backend, ledger=ledger, prices=PRICES)
    with pytest.raises(InvalidInputError, match=r"not CALLS \(got 'calls'\)"):
        await gov.meter_tokens(
            ("global_spend", "calls"), "m", input_tokens=10, output_tokens=1, ctx=Context(user="u")
        )
    assert ledger.entries == []
    assert await gov.usage("global_spend") == 0
