"""Hard caps in the integrations: reserve the estimate before the call, settle after it.

A real FastMCP server and client (in-memory transport), on both backends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fastmcp import Client, FastMCP
from fastmcp.exceptions import ToolError

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    MemoryBackend,
    Policy,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware, tool_estimate
from mcp_budget_governor.integrations.flow import governed_call
from mcp_budget_governor.producers.memory_ledger import MemoryLedger

USD = Unit.USD_MICROS
ANA = Context(user="ana")
#: One instant for the whole run: no day boundary falls inside a test.
NOW = time.time()


def policy() -> Policy:
    return Policy.of(Limit("spend", cap=usd(1), window=Window.DAY, unit=USD))


def server(governor: Governor, **middleware: Any) -> FastMCP:
    mcp = FastMCP("hard-capped")
    mcp.add_middleware(BudgetMiddleware(governor, identify=lambda c: ANA, **middleware))

    @mcp.tool(meta={"mcpbg": {"estimate_usd": "0.05", "limit": "spend"}})
    async def browse(pause: float = 0.0) -> str:
        await asyncio.sleep(pause)
        return "page"

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.05", "limit": "spend"}})
    async def fixed_browse(pause: float = 0.0) -> str:
        await asyncio.sleep(pause)
        return "page"

    @mcp.tool(meta={"mcpbg": {"estimate_usd": "0.05", "limit": "spend"}})
    async def broken() -> str:
        raise RuntimeError("upstream down")

    @mcp.tool
    async def unpriced() -> str:
        return "?"

    return mcp


async def calls(client: Client, tool: str, n: int) -> tuple[int, int]:
    got = await asyncio.gather(
        *(client.call_tool(tool, {"pause": 0.01}) for _ in range(n)), return_exceptions=True
    )
    refused = [g for g in got if isinstance(g, ToolError)]
    assert len(refused) + sum(1 for g in got if not isinstance(g, BaseException)) == n, got
    return n - len(refused), len(refused)


async def test_fifty_concurrent_estimated_calls_stop_at_the_cap(backend: Backend) -> None:
    gov = Governor(policy(), backend, clock=lambda: NOW)
    async with Client(server(gov)) as client:
        admitted, refused = await calls(client, "browse", 50)
    # $1 of room, $0.05 each: exactly twenty fit, whatever the interleaving.
    assert (admitted, refused) == (20, 30)
    assert await gov.usage("spend", ANA) == usd(1)


async def test_a_cost_callback_settles_the_reservation_to_the_actual_cost(
    backend: Backend,
) -> None:
    gov = Governor(policy(), backend, clock=lambda: NOW)
    mcp = server(gov, cost=lambda ctx, result: {"spend": usd("0.02")})
    async with Client(mcp) as client:
        await client.call_tool("browse", {})
        await client.call_tool("browse", {})
    assert await gov.usage("spend", ANA) == usd("0.04")


async def test_a_failed_call_settles_to_its_estimate(backend: Backend) -> None:
    gov = Governor(policy(), backend, clock=lambda: NOW)
    async with Client(server(gov)) as client:
        with pytest.raises(ToolError):
            await client.call_tool("broken", {})
    assert await gov.usage("spend", ANA) == usd("0.05")


async def test_the_default_estimate_hard_caps_a_tool_of_unknown_cost(backend: Backend) -> None:
    gov = Governor(policy(), backend, clock=lambda: NOW)
    async with Client(server(gov, estimate={"spend": usd("0.30")})) as client:
        for _ in range(3):
            await client.call_tool("unpriced", {})  # its estimate stands: no cost is known
        with pytest.raises(ToolError, match="budget_exceeded"):
            await client.call_tool("unpriced", {})  # $0.90 + $0.30 does not fit $1
        # A priced tool keeps its soft cap: the check sees $0.90 < $1.
        await client.call_tool("fixed_browse", {})
    assert await gov.usage("spend", ANA) == usd("0.95")


async def test_a_refused_reservation_runs_nothing_and_holds_nothing() -> None:
    gov = Governor(policy(), MemoryBackend(), clock=lambda: NOW)
    ran: list[int] = []

    async def work() -> str:
        ran.append(1)
        return "ok"

    await governed_call(gov, ANA, work, estimate={"spend": usd("0.90")})
    with pytest.raises(Exception, match="budget_exceeded"):
        await governed_call(gov, ANA, work, estimate={"spend": usd("0.20")})
    assert ran == [1]
    assert await gov.usage("spend", ANA) == usd("0.90")


@pytest.mark.parametrize(
    ("fixed", "charged"), [(None, usd("0.05")), ({"spend": usd("0.01")}, usd("0.01"))]
)
async def test_a_cancelled_call_settles_to_its_fixed_price_else_its_estimate(
    fixed: dict[str, int] | None, charged: int
) -> None:
    gov = Governor(policy(), MemoryBackend(), clock=lambda: NOW)
    started = asyncio.Event()

    async def work() -> str:
        started.set()
        await asyncio.Event().wait()  # until cancelled
        return "never"

    task = asyncio.ensure_future(
        governed_call(gov, ANA, work, fixed=fixed, estimate={"spend": usd("0.05")})
    )
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await gov.usage("spend", ANA) == charged


def test_an_estimate_in_float_dollars_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidInputError) as err:
        tool_estimate(policy(), "browse", {"mcpbg": {"estimate_usd": 0.05, "limit": "spend"}})
    assert "meta.mcpbg.estimate_usd" in str(err.value) and "0.05" in str(err.value)
    assert "string" in str(err.value)


def two_limits() -> Policy:
    return Policy.of(
        Limit("user_spend", cap=usd(1), window=Window.DAY, scope="user", unit=USD),
        Limit("tenant_spend", cap=usd("0.10"), window=Window.DAY, scope="tenant", unit=USD),
    )


async def test_estimates_on_several_limits_are_held_all_or_nothing_in_one_round_trip(
    backend: Backend,
) -> None:
    """Two hard-capped limits: one charge reserves both (one `reserved` event with both
    charges), one closes both (one `settled` event naming it); a refusal on one holds
    nothing on the other, so two calls near their caps never each hold half."""
    kept = MemoryLedger()
    gov = Governor(two_limits(), backend, ledger=kept, clock=lambda: NOW)
    ctx = Context(user="ana", tenant="acme")
    charges = 0
    real = backend.charge

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal charges
        charges += 1
        return await real(*args, **kwargs)

    backend.charge = counted  # type: ignore[method-assign]
    sent = getattr(backend, "charge_sent", None)
    if sent is not None:  # the settle is written without awaiting its reply (Redis)

        def counted_sent(*args: Any, **kwargs: Any) -> Any:
            nonlocal charges
            charges += 1
            return sent(*args, **kwargs)

        backend.charge_sent = counted_sent  # type: ignore[attr-defined]

    async def work() -> str:
        return "ok"

    both = {"user_spend": usd("0.05"), "tenant_spend": usd("0.05")}
    charges = 0
    await governed_call(gov, ctx, work, estimate=both, fixed={"user_spend": usd("0.02")})
    # Check and reserve both (one charge where the backend reserves with the admission,
    # else two), settle both: whatever the number of limits.
    assert charges == (2 if gov.prices_at_admission else 3)
    reserved, closed = [e for e in kept.entries if e.type.value in ("reserved", "settled")]
    assert reserved.type.value == "reserved" and len(reserved.charges) == 2
    assert closed.type.value == "settled" and closed.reservation == reserved.id
    assert [(c.limit, c.amount) for c in closed.charges] == [("user_spend", -usd("0.03"))]
    assert await gov.usage("user_spend", ctx) == usd("0.02")
    assert await gov.usage("tenant_spend", ctx) == usd("0.05")  # its estimate stands

    # tenant_spend has 0.05 left: 0.06 does not fit, and user_spend holds nothing.
    kept.entries.clear()
    with pytest.raises(Exception, match="budget_exceeded"):
        await governed_call(
            gov, ctx, work, estimate={"user_spend": usd("0.06"), "tenant_spend": usd("0.06")}
        )
    assert await gov.usage("user_spend", ctx) == usd("0.02")
    assert await gov.usage("tenant_spend", ctx) == usd("0.05")
    # The reservation was refused whole, nothing reserved; where it goes with the
    # admission, the call is refused whole too (else its check had admitted it).
    refused = ["rejected"] if gov.prices_at_admission else ["admitted", "rejected"]
    assert [e.type.value for e in kept.entries] == refused
    await gov.aclose()
