"""Recovery after an outage under concurrency (inline mode, no ledger).

Charges admitted by the fail-open fallback while the store was down are kept and
replayed when it answers again: once each, by one task, however many checks
arrive at that moment. Before, every concurrent check replayed the same charge
and then popped it, and all but one raised ``IndexError: pop from an empty deque``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

from mcp_budget_governor import (
    BackendUnavailableError,
    Context,
    FailMode,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    Scope,
    Window,
)
from mcp_budget_governor.counters import ChargeResult, CounterOp

RETRY = 0.05


class Recovering(MemoryBackend):
    """A store that is down until told otherwise; every call yields to the loop first
    (a round trip), so concurrent checks really overlap at recovery."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.replays: Counter[str] = Counter()

    async def charge(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
        **kwargs: object,
    ) -> ChargeResult:
        await asyncio.sleep(0.001)
        if self.down:
            raise BackendUnavailableError("store down (test)")
        if op_id is not None and not want_used:  # the governor's replays ask for no totals
            self.replays[op_id] += 1
        return await super().charge(ops, event_id=event_id, want_used=want_used, op_id=op_id)


def open_policy() -> Policy:
    return Policy.of(
        Limit("per_user", cap=1000, window=Window.DAY, scope=Scope.USER, fail_mode=FailMode.OPEN)
    )


async def test_64_concurrent_checks_at_recovery_replay_each_pending_charge_once() -> None:
    store = Recovering()
    gov = Governor(open_policy(), store, retry_interval=RETRY)
    users = [Context(user=f"u{i % 4}") for i in range(64)]
    outage = [await gov.check(users[i]) for i in range(12)]
    assert all(d.admitted and d.degraded for d in outage)
    assert gov.pending_charges == 12

    store.down = False
    await asyncio.sleep(RETRY * 2)
    decisions = await asyncio.gather(*(gov.check(c) for c in users))  # no exception

    assert all(d.admitted and not d.degraded for d in decisions)
    assert gov.pending_charges == 0
    assert len(store.replays) == 12 and set(store.replays.values()) == {1}
    # Each user's counter: its outage checks once, plus its 16 checks now.
    for u in range(4):
        assert await gov.usage("per_user", Context(user=f"u{u}")) == 3 + 16
    await gov.aclose()


async def test_a_replay_that_finds_the_store_down_again_leaves_the_rest_to_the_fail_mode() -> None:
    store = Recovering()
    gov = Governor(open_policy(), store, retry_interval=RETRY)
    alice = Context(user="alice")
    assert (await gov.check(alice)).degraded
    await asyncio.sleep(RETRY * 2)
    # Still down at the retry: one check tries the store, the others wait for it and
    # then take the fail mode without trying again; the charge stays buffered.
    decisions = await asyncio.gather(*(gov.check(alice) for _ in range(16)))
    assert all(d.admitted and d.degraded for d in decisions)
    assert gov.pending_charges == 17
    store.down = False
    await asyncio.sleep(RETRY * 2)
    assert not (await gov.check(alice)).degraded
    assert gov.pending_charges == 0
    assert await gov.usage("per_user", alice) == 18
    assert set(store.replays.values()) == {1}
    await gov.aclose()
