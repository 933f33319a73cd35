"""Emit-only metering: charge budgets from code that cannot reach the counters.

A batch job, a worker on another network, a script replaying a provider's
usage export: it spent money and the budget must know, but it has no Redis and
no business gating anyone. :class:`Recorder` (and the one-shot :func:`emit`)
appends a ``metered`` ledger event, exactly the event ``Governor.meter`` /
``Governor.meter_tokens`` would append for the same context at the same
instant: same validation, same pricing, the same bucket, counter key and
expiry (``planning.slot`` at the event time), token usage and price-table
version attached. The projection then counts it like any other event.

When to use which:

- :class:`~mcp_budget_governor.Governor` where calls are served and Redis is
  reachable: ``check()`` gates before the work, and ``meter()`` writes the
  amount in flight so the very next check already sees it.
- :class:`Recorder` / :func:`emit` everywhere else. They never check, never
  refuse, never read a counter: no hot-path enforcement, emit only. The charge
  reaches the counters when the projection applies the event, so checks see it
  after the projection lag (a breaker trips then, not at once).
- Never both for the same cost: that charges it twice.

The ledger must be the one the projection reads (the Kafka producer, the
durable outbox, ...). A context lacking a limit's scope is not charged on
that limit (0 is returned and nothing is appended), as with ``Governor.meter``.

>>> import asyncio
>>> from mcp_budget_governor import Context, Limit, Policy, Unit, Window, usd
>>> from mcp_budget_governor.producers.memory_ledger import MemoryLedger
>>> policy = Policy.of(Limit("spend", cap=usd(25), window=Window.DAY,
...                          unit=Unit.USD_MICROS, breaker=True, gated=False))
>>> ledger = MemoryLedger()
>>> asyncio.run(emit(ledger, policy, "spend", usd("0.05"), Context(user="nightly-batch")))
50000
>>> [(e.type.value, e.charges[0].limit, e.charges[0].amount) for e in ledger.entries]
[('metered', 'spend', 50000)]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from mcp_budget_governor import planning
from mcp_budget_governor.context import Context
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.ledger import EntryType, Ledger, LedgerEntry, TokenUsage, new_id
from mcp_budget_governor.limits import Limit
from mcp_budget_governor.metering import Metering
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.prices import PriceTable

__all__ = ["Recorder", "emit"]


class Recorder(Metering[int]):
    """Appends ``metered`` events for a policy to a ledger; keeps no counters.

    ``meter`` and ``meter_tokens`` take the same arguments and validate them the
    same way as the :class:`Governor` methods of the same name, and return the
    amount charged (the ``charged`` of the Governor's ``MeterResult``: a
    Recorder reads no counter, so knows no total); invalid input raises before
    anything is appended.
    ``prices`` is needed by ``meter_tokens`` on USD limits; ``clock`` gives
    the event time, which picks the window bucket.

    >>> import asyncio
    >>> from mcp_budget_governor import Context, Limit, Policy, PriceTable, Unit, Window, usd
    >>> from mcp_budget_governor.producers.memory_ledger import MemoryLedger
    >>> policy = Policy.of(Limit("spend", cap=usd(25), window=Window.DAY,
    ...                          unit=Unit.USD_MICROS, breaker=True, gated=False))
    >>> ledger = MemoryLedger()
    >>> rec = Recorder(policy, ledger, prices=PriceTable().with_price("my-model", 3, 15))
    >>> asyncio.run(rec.meter_tokens("spend", "my-model", input_tokens=3200, output_tokens=850,
    ...                              ctx=Context(user="u_42")))
    22350
    >>> entry = ledger.entries[0]
    >>> entry.type.value, entry.charges[0].amount, entry.usage.model
    ('metered', 22350, 'my-model')
    """

    def __init__(
        self,
        policy: Policy,
        ledger: Ledger,
        *,
        prices: PriceTable | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(ledger, Ledger):
            raise InvalidInputError(
                "ledger", ledger, "expected a Ledger (async append(entry) and aclose())"
            )
        if not isinstance(policy, Policy):
            raise InvalidInputError("policy", policy, "expected a Policy (use Policy.of(...))")
        self.policy = policy
        self.ledger = ledger
        self.prices = prices
        self._clock = clock

    async def _meter(
        self, charges: Sequence[tuple[Limit, int]], ctx: Context, usage: TokenUsage | None
    ) -> int:
        now = self._clock()
        slots = planning.meter_slots(charges, ctx, now, self.policy.tz)
        if not slots:
            return 0
        await self.ledger.append(
            LedgerEntry(
                new_id(), EntryType.METERED, now, ctx, planning.ledger_charges(slots), usage=usage
            )
        )
        return slots[0].amount

    async def aclose(self) -> None:
        """Flush and close the ledger (as ``Governor.aclose`` does)."""
        await self.ledger.aclose()

    async def __aenter__(self) -> Recorder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def emit(
    ledger: Ledger,
    policy: Policy,
    limit: str,
    amount: int,
    ctx: Context | None = None,
    *,
    clock: Callable[[], float] = time.time,
) -> int:
    """Append one ``metered`` event of ``amount`` on ``limit``; returns the amount charged.

    A one-shot :meth:`Recorder.meter` that leaves ``ledger`` open; keep a
    :class:`Recorder` when emitting many events or token usage.

    >>> import asyncio
    >>> from mcp_budget_governor import Context, Limit, Policy, Scope, Window
    >>> from mcp_budget_governor.producers.memory_ledger import MemoryLedger
    >>> policy = Policy.of(Limit("calls", cap=100, window=Window.DAY, scope=Scope.USER))
    >>> ledger = MemoryLedger()
    >>> asyncio.run(emit(ledger, policy, "calls", 3, Context(user="u_42")))
    3
    >>> asyncio.run(emit(ledger, policy, "calls", 3))  # no user: the limit does not apply
    0
    >>> len(ledger.entries)
    1
    """
    return await Recorder(policy, ledger, clock=clock).meter(limit, amount, ctx)
