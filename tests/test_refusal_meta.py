"""A program reads a refusal as data: the official Python MCP client (``mcp.client.Client``,
streamable HTTP) reads ``status``, ``retry_after`` and ``resets_at`` from the refused tool
result's ``_meta["dev.mcpbg/refusal"]`` on every kind of refusal (429 quota, 402 spend,
503 breaker, 503 counters not ready, 403 unidentified), beside the text agents read;
and a server that opts in answers a 429 with the JSON-RPC error of MCP's rate-limit
proposal (SEP-3304, code -32023)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import pytest
from fastmcp import FastMCP
from fastmcp.server.middleware import MiddlewareContext
from mcp.client import Client
from mcp.shared.exceptions import MCPError

from mcp_budget_governor import (
    Anonymous,
    Context,
    FailMode,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware
from mcp_budget_governor.integrations.flow import (
    RATE_LIMITED,
    REFUSAL_META_KEY,
    refusal_meta,
    refusal_text,
)
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from testing.thread_server import ThreadServer

USD = Unit.USD_MICROS


def policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER),
        Limit("user_spend", cap=usd("0.02"), window=Window.DAY, scope=Scope.USER, unit=USD),
        Limit("spend", cap=usd("0.10"), window=Window.DAY, unit=USD, breaker=True, gated=False),
        anonymous=Anonymous.REFUSE,
    )


def user_from_meta(context: MiddlewareContext[Any]) -> Context | None:
    fc = context.fastmcp_context
    rc = fc.request_context if fc is not None else None
    user = (rc.meta or {}).get("user") if rc is not None else None
    return Context(user=user) if isinstance(user, str) else None


def build(governor: Governor, **middleware: Any) -> FastMCP:
    mcp = FastMCP("refusing")
    mcp.add_middleware(BudgetMiddleware(governor, identify=user_from_meta, **middleware))

    @mcp.tool
    async def cheap() -> str:
        return "ok"

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.02", "limit": "user_spend"}})
    async def pricey() -> str:
        return "ok"

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.10", "limit": "spend"}})
    async def expensive() -> str:
        return "ok"

    return mcp


@asynccontextmanager
async def served(make: Any, **middleware: Any) -> AsyncIterator[str]:
    async def serve() -> tuple[Any, Governor]:
        gov = make()
        return build(gov, **middleware).http_app(), gov

    server = await asyncio.to_thread(ThreadServer(serve).start)
    try:
        yield f"{server.url}/mcp"
    finally:
        await asyncio.to_thread(server.stop)


async def call(client: Client, tool: str, user: str | None) -> Any:
    return await client.call_tool(tool, {}, meta=None if user is None else {"user": user})


def refusal_of(result: Any) -> dict[str, Any]:
    """The refusal a program reads: the result's ``_meta`` entry (the text is beside it)."""
    assert result.is_error, result
    meta = (result.meta or {})[REFUSAL_META_KEY]
    text = result.content[0].text
    assert text.startswith(f"{meta['reason']} ") and f"status={meta['status']}" in text
    return dict(meta)


def iso(value: str) -> datetime:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ")


async def test_the_official_client_reads_every_refusal_kind_from_meta(redis_url: str) -> None:
    got: dict[str, dict[str, Any]] = {}
    async with (
        served(lambda: Governor(policy(), MemoryBackend())) as url,
        Client(url) as client,
    ):
        for _ in range(2):
            assert not (await call(client, "cheap", "quota")).is_error
        got["429"] = refusal_of(await call(client, "cheap", "quota"))
        assert not (await call(client, "pricey", "spender")).is_error  # reaches its cap
        got["402"] = refusal_of(await call(client, "pricey", "spender"))
        got["403"] = refusal_of(await call(client, "cheap", None))
        assert not (await call(client, "expensive", "big")).is_error  # trips the breaker
        got["503 breaker"] = refusal_of(await call(client, "cheap", "anyone"))

    def not_ready() -> Governor:  # a ledger's counters the worker has not marked ready
        # Not the default fail mode: an OPEN limit (the default) counts locally while the
        # counters are unreachable, and only a CLOSED one refuses with 503.
        closed = Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER,
                       fail_mode=FailMode.CLOSED)  # fmt: skip
        backend = RedisBackend.from_url(redis_url, require_epoch=True, timeout=2.0)
        return Governor(Policy.of(closed), backend, ledger=MemoryLedger())

    async with served(not_ready) as url, Client(url) as client:
        got["503 not ready"] = refusal_of(await call(client, "cheap", "early"))

    q = got["429"]
    assert (q["status"], q["limit"], q["scope"], q["window"]) == (429, "burst", "user", "minute")
    assert q["error"] == "budget_exceeded" and 1 <= q["retry_after"] <= 60
    assert iso(q["resets_at"]).second == 0  # the minute's end
    s = got["402"]
    assert (s["status"], s["limit"], s["scope"], s["window"]) == (402, "user_spend", "user", "day")
    assert s["retry_after"] is None and iso(s["resets_at"]).hour == 0  # waiting a day
    u = got["403"]
    assert (u["status"], u["error"], u["retry_after"], u["resets_at"]) == (
        403, "caller_unidentified", None, None,
    )  # fmt: skip
    b = got["503 breaker"]
    assert (b["status"], b["limit"], b["scope"], b["window"]) == (503, "spend", "global", "day")
    assert b["retry_after"] >= 1 and b["resets_at"] is not None
    n = got["503 not ready"]
    assert (n["status"], n["error"]) == (503, "budget_unavailable")
    assert n["retry_after"] >= 1 and n["resets_at"] is None


async def test_an_opted_in_server_answers_a_429_with_the_rate_limited_error() -> None:
    async with (
        served(lambda: Governor(policy(), MemoryBackend()), rate_limit_error=True) as url,
        Client(url) as client,
    ):
        for _ in range(2):
            await call(client, "cheap", "quota")
        with pytest.raises(MCPError) as exc:
            await call(client, "cheap", "quota")
        assert exc.value.code == RATE_LIMITED == -32023
        data = exc.value.data
        meta = data[REFUSAL_META_KEY]
        assert meta["status"] == 429 and data["retryAfterMs"] == meta["retry_after"] * 1000
        assert exc.value.message.startswith("budget_exceeded:user/minute limit=burst status=429")
        # Only a refusal that waiting fixes is an error: a spent budget stays a tool result.
        await call(client, "pricey", "spender")
        assert refusal_of(await call(client, "pricey", "spender"))["status"] == 402


def test_meta_names_scope_and_window_only_when_the_reason_has_them() -> None:
    from mcp_budget_governor.decision import Decision

    d = Decision(admitted=False, limit=None, status=503, retry_after=1, reason="ledger_unavailable")
    meta = refusal_meta(d)
    assert (meta["error"], meta["scope"], meta["window"]) == ("ledger_unavailable", None, None)
    assert refusal_text(d).startswith("ledger_unavailable status=503")


async def test_the_low_level_hook_carries_the_refusal_in_meta_and_opts_in_to_the_error() -> None:
    import mcp_types as mt

    from mcp_budget_governor.integrations.lowlevel import governed_call_tool

    gov = Governor(policy(), MemoryBackend())

    async def handler(ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
        return mt.CallToolResult(content=[mt.TextContent(type="text", text="ok")])

    def who(ctx: Any, params: mt.CallToolRequestParams) -> Context:
        return Context(user="low")

    plain = governed_call_tool(gov, handler, identify=who)
    opted = governed_call_tool(gov, handler, identify=who, rate_limit_error=True)
    params = mt.CallToolRequestParams(name="cheap", arguments={})
    for _ in range(2):
        assert not (await plain(None, params)).is_error
    refused = await plain(None, params)
    assert refused.is_error and refused.meta is not None
    meta = refused.meta[REFUSAL_META_KEY]
    assert (meta["status"], meta["limit"], meta["window"]) == (429, "burst", "minute")
    assert refused.structured_content is not None  # the body it had, and the text, unchanged
    assert refused.structured_content["mcpbg"]["message"] == refused.content[0].text
    with pytest.raises(MCPError) as exc:
        await opted(None, params)
    assert exc.value.code == RATE_LIMITED
    assert exc.value.data[REFUSAL_META_KEY] == meta
