"""A fixed price charged with its admission on a Redis Cluster (issue 33): each slot's
charge names the cost's first counter within its own group, and a check refused on
one slot takes back the other slot's holds under both event ids."""

from __future__ import annotations

import uuid

from redis.crc import key_slot

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.counters.cluster import ClusterBackend
from testing.services import RedisClusterService


def priced_policy(tag: str) -> Policy:
    return Policy.of(
        Limit(f"calls{tag}", cap=100, window=Window.DAY, scope=Scope.USER),
        Limit(f"spend{tag}", cap=usd("0.03"), window=Window.DAY, unit=Unit.USD_MICROS),
    )


async def test_a_price_is_charged_with_its_admission_across_slots(
    redis_cluster: RedisClusterService,
) -> None:
    tag = uuid.uuid4().hex[:8]
    backend = RedisBackend.from_url(redis_cluster.url)
    assert isinstance(backend, ClusterBackend) and backend.prices_at_admission
    ledger = MemoryLedger()
    gov = Governor(priced_policy(tag), backend, ledger=ledger)
    ana = Context(user="ana")
    calls_key = gov._read_slot(f"calls{tag}", ana).key
    spend_key = gov._read_slot(f"spend{tag}", ana).key
    assert key_slot(calls_key.encode()) != key_slot(spend_key.encode())  # two slot charges
    sent: list[str | None] = []
    real = backend._node.charge_with

    async def counted(c):  # type: ignore[no-untyped-def]
        sent.append(c.event_id)
        return await real(c)

    backend._node.charge_with = counted  # type: ignore[method-assign]
    try:
        for _ in range(3):
            admission = gov.admitted(ana, price={f"spend{tag}": usd("0.01")})
            async with admission as decision:
                assert decision.admitted and admission.price_charged
        assert len(sent) == 6  # one charge per slot per call, nothing metered after
        entries = ledger.entries
        admitted = [e.id for e in entries if e.type is EntryType.ADMITTED]
        costs = [e.id for e in entries if e.type is EntryType.METERED]
        assert len(admitted) == len(costs) == 3
        # Each slot's in-flight entries are its own event's: the projection moves each once.
        assert (await backend.state(calls_key)).pending == dict.fromkeys(admitted, 1)
        assert (await backend.state(spend_key)).pending == dict.fromkeys(costs, usd("0.01"))

        # The spend is full: refused on its slot, the call's hold on the other taken back.
        async with gov.admitted(ana, price={f"spend{tag}": usd("0.01")}) as decision:
            assert not decision.admitted and decision.limit == f"spend{tag}"
        calls, spend = await backend.state(calls_key), await backend.state(spend_key)
        assert (calls.in_flight, calls.pending) == (3, dict.fromkeys(admitted, 1))
        assert (spend.in_flight, spend.pending) == (usd("0.03"), dict.fromkeys(costs, usd("0.01")))
    finally:
        await gov.aclose()


async def test_a_refusal_on_the_admission_slot_takes_back_the_price_under_its_own_id(
    redis_cluster: RedisClusterService,
) -> None:
    """The calls counter refuses; the price, held on the spend slot meanwhile, is taken
    back and its cost event's in-flight entry dropped (none left for reconcile)."""
    tag = uuid.uuid4().hex[:8]
    backend = RedisBackend.from_url(redis_cluster.url)
    policy = Policy.of(
        Limit(f"calls{tag}", cap=1, window=Window.DAY, scope=Scope.USER),
        Limit(f"spend{tag}", cap=usd("1"), window=Window.DAY, unit=Unit.USD_MICROS),
    )
    ledger = MemoryLedger()
    gov = Governor(policy, backend, ledger=ledger)
    bo = Context(user="bo")
    try:
        async with gov.admitted(bo, price={f"spend{tag}": usd("0.25")}) as decision:
            assert decision.admitted
        async with gov.admitted(bo, price={f"spend{tag}": usd("0.25")}) as decision:
            assert not decision.admitted and decision.limit == f"calls{tag}"
        (cost,) = [e.id for e in ledger.entries if e.type is EntryType.METERED]
        spend = await backend.state(gov._read_slot(f"spend{tag}", bo).key)
        assert (spend.in_flight, spend.pending) == (usd("0.25"), {cost: usd("0.25")})
    finally:
        await gov.aclose()
