"""One process of the fixed-price burst (tests/test_priced_burst.py).

Each process fires its share of concurrent calls through ``governed_call`` with
a fixed price, on one shared Redis: some tools raise, some calls are cancelled
while the tool runs, some the instant they start. Its ledger is in memory; the
entries go back to the test, which writes every process's into one file ledger.
"""

from __future__ import annotations

import asyncio
import time

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Unit, Window, usd
from mcp_budget_governor.errors import LimitExceeded
from mcp_budget_governor.integrations.flow import governed_call
from mcp_budget_governor.ledger import LedgerEntry
from mcp_budget_governor.producers.memory_ledger import MemoryLedger

PRICE = usd("0.01")
ROOM = usd(1)
CTX = Context(user="u_burst", tenant="acme", tool="search")


def priced_policy() -> Policy:
    """$1 a day for the tenant: a gated spend limit, so a price that does not fit refuses."""
    return Policy.of(
        Limit("calls", cap=10**6, window=Window.DAY),
        Limit("spend", cap=ROOM, window=Window.DAY, unit=Unit.USD_MICROS, scope="tenant"),
    )


def priced_calls(
    url: str, calls: int, start_at: float, seed: int
) -> tuple[list[LedgerEntry], dict[str, int]]:
    """Fire ``calls`` concurrent priced calls: the ledger entries this process appended,
    and how many calls ended how (``ok``, ``failed``, ``cancelled``, ``refused``)."""

    async def main() -> tuple[list[LedgerEntry], dict[str, int]]:
        outcomes = dict.fromkeys(("ok", "failed", "cancelled", "refused"), 0)
        ledger = MemoryLedger()
        gov = Governor(priced_policy(), RedisBackend.from_url(url), ledger=ledger)
        await gov.usage("spend", CTX)  # connected before the start line
        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)

        async def call(i: int) -> None:
            started = asyncio.Event()

            async def work() -> int:
                started.set()
                if i % 7 == 3:
                    raise RuntimeError("the tool failed")
                await asyncio.sleep(0.05 if i % 5 == 1 else 0)
                return i

            task = asyncio.ensure_future(governed_call(gov, CTX, work, fixed={"spend": PRICE}))
            if i % 5 == 1:  # cancelled while the tool runs
                waiter = asyncio.ensure_future(started.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                task.cancel()
            elif i % 11 == (seed % 11):  # cancelled at whatever instant it has reached
                await asyncio.sleep(0)
                task.cancel()
            try:
                await task
                outcomes["ok"] += 1
            except LimitExceeded:
                outcomes["refused"] += 1
            except RuntimeError:
                outcomes["failed"] += 1
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1

        await asyncio.gather(*(call(i) for i in range(calls)))
        await gov.aclose()
        return list(ledger.entries), outcomes

    return asyncio.run(main())
