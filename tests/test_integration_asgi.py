"""BudgetASGIMiddleware on a Starlette app, and the low-level MCP SDK hook.

HTTP: statuses (429 / 402 / 503 / 403), ``Retry-After`` headers where waiting
helps, a JSON body naming the reason, the limit and the hint; metering after
the response. Over httpx's in-process ASGI transport and over a real uvicorn
server on a loopback port, with the memory backend and the real Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2 as httpx
import mcp_types as mt
import pytest
from mcp import Client as SdkClient
from mcp.server.lowlevel import Server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from mcp_budget_governor import (
    ANONYMOUS_USER,
    Anonymous,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    LimitExceeded,
    MemoryBackend,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.integrations.asgi import BudgetASGIMiddleware
from mcp_budget_governor.integrations.lowlevel import governed_call_tool
from testing.thread_server import ThreadServer

NOW = time.time()
USD = Unit.USD_MICROS


def policy(anonymous: Anonymous = Anonymous.REFUSE) -> Policy:
    return Policy.of(
        Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER),
        Limit("user_spend", cap=usd("0.05"), window=Window.DAY, scope=Scope.USER, unit=USD),
        Limit("spend", cap=usd(1), window=Window.DAY, unit=USD, breaker=True, gated=False),
        anonymous=anonymous,
    )


def identify(scope: Any) -> Context | None:
    user = dict(scope["headers"]).get(b"x-user")
    return Context(user=user.decode()) if user is not None else None


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def boom(request: Request) -> PlainTextResponse:
    raise RuntimeError("handler failed")


async def upload(request: Request) -> PlainTextResponse:
    # Reading a body the client stops sending: Starlette raises ClientDisconnect.
    return PlainTextResponse(f"{len(await request.body())} bytes")


async def slow(request: Request) -> PlainTextResponse:
    await asyncio.Event().wait()  # until cancelled
    return PlainTextResponse("never")


def starlette_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/hello", hello),
            Route("/boom", boom),
            Route("/upload", upload, methods=["POST"]),
            Route("/slow", slow),
            Route("/health", hello),
        ]
    )


def charge_by_status(scope: Any, status: int) -> dict[str, int] | None:
    """Successful responses cost a cent to the user and to the global spend."""
    return {"user_spend": usd("0.01"), "spend": usd("0.01")} if status < 400 else None


@asynccontextmanager
async def governed(
    backend_kind: str, redis_url: str | None, transport: str, pol: Policy, **kw: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """An httpx client on the governed app, and a function reading usage where it lives."""

    def make() -> tuple[Any, Governor]:
        backend = RedisBackend.from_url(redis_url, timeout=2.0) if redis_url else MemoryBackend()
        gov = Governor(pol, backend, clock=lambda: NOW)
        kw.setdefault("identify", identify)
        kw.setdefault("route", lambda scope: None if scope["path"] == "/health" else scope["path"])
        return BudgetASGIMiddleware(starlette_app(), gov, **kw), gov

    if transport == "asgi":
        app, gov = make()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
            base_url="http://test",
        ) as client:
            yield client, gov.usage
        await gov.aclose()
        return

    async def build() -> tuple[Any, Governor]:
        return make()

    host = await asyncio.to_thread(ThreadServer(build).start)
    try:
        async with httpx.AsyncClient(base_url=host.url) as client:

            async def usage(limit: str, ctx: Context | None = None) -> int:
                return await host.run(host.state.usage(limit, ctx))

            yield client, usage
    finally:
        await asyncio.to_thread(host.stop)


@pytest.fixture(params=["memory", "redis"])
def backend_url(request: pytest.FixtureRequest) -> str | None:
    return request.getfixturevalue("redis_url") if request.param == "redis" else None


@pytest.fixture(params=["asgi", "uvicorn"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


U1 = {"x-user": "u_1"}


async def test_429_with_retry_after_and_a_json_body_then_metering(
    backend_url: str | None, transport: str
) -> None:
    async with governed("", backend_url, transport, policy(), cost=charge_by_status) as (c, usage):
        assert [(await c.get("/hello", headers=U1)).status_code for _ in range(2)] == [200, 200]
        r = await c.get("/hello", headers=U1)
        assert r.status_code == 429
        left = int(r.headers["retry-after"])
        assert 1 <= left <= 60
        assert r.headers["content-type"] == "application/problem+json"  # RFC 9457
        body = r.json()
        assert body["error"] == "budget_exceeded"
        assert body["reason"] == "budget_exceeded:user/minute"
        assert (body["limit"], body["status"], body["retry_after"]) == ("burst", 429, left)
        assert body["resets_at"].endswith("Z")
        assert body["message"].startswith("budget_exceeded:user/minute limit=burst status=429 ")
        assert (body["title"], body["instance"]) == ("Limit exceeded", "/hello")
        assert body["type"].endswith("/problems/limit-exceeded")
        assert body["detail"] == body["reason"]
        me = Context(user="u_1")
        assert await usage("burst", me) == 2
        assert await usage("user_spend", me) == 2 * usd("0.01")  # the 429 was not charged
        assert await usage("spend") == 2 * usd("0.01")


async def test_402_on_a_spent_user_budget_has_no_retry_after(
    backend_url: str | None, transport: str
) -> None:
    pol = Policy.of(
        Limit("user_spend", cap=usd("0.02"), window=Window.DAY, scope=Scope.USER, unit=USD),
        Limit("spend", cap=usd(1), window=Window.DAY, unit=USD, gated=False),
    )
    async with governed("", backend_url, transport, pol, cost=charge_by_status) as (c, usage):
        assert (await c.get("/hello", headers=U1)).status_code == 200
        assert (await c.get("/hello", headers=U1)).status_code == 200
        r = await c.get("/hello", headers=U1)
        assert r.status_code == 402
        assert "retry-after" not in r.headers  # waiting seconds never restores a spend cap
        body = r.json()
        assert (body["reason"], body["limit"], body["retry_after"]) == (
            "budget_exceeded:user/day",
            "user_spend",
            None,
        )
        assert body["resets_at"].endswith("T00:00:00Z")
        assert "Do not retry before then" in body["message"]
        assert await usage("user_spend", Context(user="u_1")) == usd("0.02")


async def test_503_when_the_breaker_trips(backend_url: str | None, transport: str) -> None:
    def dear(scope: Any, status: int) -> dict[str, int]:
        return {"spend": usd(1)}

    async with governed("", backend_url, transport, policy(), cost=dear) as (c, usage):
        assert (await c.get("/hello", headers=U1)).status_code == 200
        r = await c.get("/hello", headers={"x-user": "u_2"})
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["reason"] == "budget_exceeded:global/day"
        assert r.json()["limit"] == "spend"
        assert await usage("spend") == usd(1)


async def test_403_for_an_unidentified_caller_and_the_anonymous_bucket(
    backend_url: str | None, transport: str
) -> None:
    async with governed("", backend_url, transport, policy()) as (c, usage):
        r = await c.get("/hello")
        assert r.status_code == 403
        assert "retry-after" not in r.headers
        assert (r.json()["reason"], r.json()["limit"]) == ("caller_unidentified", "burst")
        # Routes the app names None are not governed at all.
        assert (await c.get("/health")).status_code == 200
    async with governed("", backend_url, transport, policy(Anonymous.SHARED)) as (c, usage):
        assert [(await c.get("/hello")).status_code for _ in range(3)] == [200, 200, 429]
        assert await usage("burst", Context(user=ANONYMOUS_USER)) == 2


async def test_a_failing_handler_keeps_its_admission_and_is_not_priced(
    backend_url: str | None, transport: str
) -> None:
    async with governed("", backend_url, transport, policy(), cost=charge_by_status) as (c, usage):
        r = await c.get("/boom", headers=U1)
        assert r.status_code == 500
        me = Context(user="u_1")
        assert await usage("burst", me) == 1
        assert await usage("user_spend", me) == 0  # a 500 is priced at nothing here


FIXED = {"user_spend": usd("0.02")}


async def test_a_dropped_connection_pays_the_fixed_price(backend_url: str | None) -> None:
    """A real client on a real uvicorn server sends half a request body and hangs up:
    the app fails reading it, the admitted request pays ``fixed``."""
    import socket

    async def build() -> tuple[Any, Governor]:
        backend = (
            RedisBackend.from_url(backend_url, timeout=2.0) if backend_url else MemoryBackend()
        )
        gov = Governor(policy(), backend, clock=lambda: NOW)
        app = BudgetASGIMiddleware(starlette_app(), gov, identify=identify, fixed=FIXED)
        return app, gov

    host = await asyncio.to_thread(ThreadServer(build).start)
    try:
        me = Context(user="u_1")

        async def usage(limit: str) -> int:
            return await host.run(host.state.usage(limit, me))

        with socket.create_connection(("127.0.0.1", host.port)) as sock:
            sock.sendall(
                b"POST /upload HTTP/1.1\r\nHost: t\r\nx-user: u_1\r\n"
                b"Content-Length: 1000\r\n\r\n" + b"x" * 10
            )
            for _ in range(400):  # admitted: the app is waiting for the rest of the body
                if await usage("burst") == 1:
                    break
                await asyncio.sleep(0.025)
        for _ in range(400):  # the server notices the hang-up on its own time
            if await usage("user_spend") == FIXED["user_spend"]:
                break
            await asyncio.sleep(0.025)
        assert await usage("user_spend") == FIXED["user_spend"]
        assert await usage("burst") == 1
    finally:
        await asyncio.to_thread(host.stop)


async def test_a_request_cancelled_mid_way_pays_the_fixed_price(backend_url: str | None) -> None:
    """The app task is cancelled (its client gave up, in process): charged, then cancelled."""
    async with governed("", backend_url, "asgi", policy(), fixed=FIXED) as (c, usage):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await c.get("/slow", headers=U1)
        assert await usage("user_spend", Context(user="u_1")) == FIXED["user_spend"]
        # A completed request without a cost callback pays the fixed price too.
        assert (await c.get("/hello", headers=U1)).status_code == 200
        assert await usage("user_spend", Context(user="u_1")) == 2 * FIXED["user_spend"]


async def test_a_failing_cost_callback_charges_the_fixed_price(
    backend_url: str | None, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(scope: Any, status: int) -> dict[str, int]:
        return {"user_spend": -1}

    async with governed("", backend_url, transport, policy(), cost=broken, fixed=FIXED) as (
        c,
        usage,
    ):
        r = await c.get("/hello", headers=U1)
        assert (r.status_code, r.text) == (200, "hello")
        # Metered after the response is sent (the callback's error logged first): the
        # client may read before the server has charged, so it reads until it has.
        for _ in range(100):
            if await usage("user_spend", Context(user="u_1")) == FIXED["user_spend"]:
                break
            await asyncio.sleep(0.01)
        assert await usage("user_spend", Context(user="u_1")) == FIXED["user_spend"]
    assert "tool '/hello': its cost callback failed" in caplog.text


def test_a_bad_fixed_price_fails_when_the_middleware_is_built() -> None:
    gov = Governor(policy(), MemoryBackend())
    for bad in ({"nope": 1}, {"user_spend": -1}, {"user_spend": 0.5}):
        with pytest.raises(InvalidInputError, match=r"^fixed"):
            BudgetASGIMiddleware(starlette_app(), gov, fixed=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match=r"^fixed"):
            governed_call_tool(gov, hello_tool, fixed=bad)  # type: ignore[arg-type]


async def hello_tool(ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
    return mt.CallToolResult(content=[mt.TextContent(type="text", text="ok")])


async def test_a_refusal_a_bare_asgi_app_raises_is_answered_the_same_way() -> None:
    from mcp_budget_governor.decision import Decision

    decision = Decision(
        admitted=False, limit="x", status=429, retry_after=7, reason="budget_exceeded:user/hour"
    )

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        raise LimitExceeded(decision)  # e.g. a @governed function it awaited

    gov = Governor(policy(), MemoryBackend(), clock=lambda: NOW)
    app = BudgetASGIMiddleware(bare, gov, identify=identify)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/inner", headers=U1)
    assert (r.status_code, r.headers["retry-after"], r.json()["limit"]) == (429, "7", "x")
    assert r.json()["reason"] == "budget_exceeded:user/hour"


async def test_default_identify_reads_the_authenticated_scope_user() -> None:
    from starlette.authentication import SimpleUser

    class Authed:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            user = dict(scope["headers"]).get(b"authorization")
            if user is not None:
                scope["user"] = SimpleUser(user.decode())
            await self.app(scope, receive, send)

    gov = Governor(policy(), MemoryBackend(), clock=lambda: NOW)
    app = Authed(BudgetASGIMiddleware(starlette_app(), gov))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/hello", headers={"authorization": "alice"})).status_code == 200
        assert (await c.get("/hello")).status_code == 403
    assert await gov.usage("burst", Context(user="alice")) == 1


# -- the low-level MCP SDK server --------------------------------------------------


async def test_the_low_level_server_hook_refuses_with_an_error_result() -> None:
    gov = Governor(policy(), MemoryBackend(), clock=lambda: NOW)
    ran: list[str] = []

    async def call_tool(ctx: Any, params: mt.CallToolRequestParams) -> mt.CallToolResult:
        ran.append(params.name)
        return mt.CallToolResult(content=[mt.TextContent(type="text", text="ok")])

    async def list_tools(ctx: Any, params: Any) -> mt.ListToolsResult:
        schema = {"type": "object", "properties": {}}
        return mt.ListToolsResult(tools=[mt.Tool(name="search", input_schema=schema)])

    def who(ctx: Any, params: mt.CallToolRequestParams) -> Context | None:
        user = (ctx.meta or {}).get("user")
        return Context(user=user) if user else None

    server = Server(
        "low",
        on_list_tools=list_tools,
        on_call_tool=governed_call_tool(
            gov,
            call_tool,
            identify=who,
            cost=lambda params, result: {"user_spend": usd("0.01")},
        ),
    )
    async with SdkClient(server) as client:
        results = [await client.call_tool("search", {}, meta={"user": "u_1"}) for _ in range(3)]
        anonymous = await client.call_tool("search", {})
    assert [r.is_error for r in results] == [False, False, True]
    text = results[2].content[0].text  # type: ignore[union-attr]
    assert text.startswith("budget_exceeded:user/minute limit=burst status=429 retry_after=")
    assert results[2].structured_content["mcpbg"]["limit"] == "burst"  # type: ignore[index]
    assert anonymous.is_error and "caller_unidentified" in anonymous.content[0].text  # type: ignore[union-attr]
    assert ran == ["search", "search"]
    assert await gov.usage("user_spend", Context(user="u_1")) == 2 * usd("0.01")


async def test_the_low_level_hook_charges_fixed_when_the_cost_callback_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gov = Governor(policy(), MemoryBackend(), clock=lambda: NOW)

    async def list_tools(ctx: Any, params: Any) -> mt.ListToolsResult:
        schema = {"type": "object", "properties": {}}
        return mt.ListToolsResult(tools=[mt.Tool(name="search", input_schema=schema)])

    server = Server(
        "low",
        on_list_tools=list_tools,
        on_call_tool=governed_call_tool(
            gov,
            hello_tool,
            identify=lambda ctx, params: Context(user="u_1"),
            cost=lambda params, result: 1 / 0,
            fixed=FIXED,
        ),
    )
    async with SdkClient(server) as client:
        result = await client.call_tool("search", {})
    assert not result.is_error and result.content[0].text == "ok"  # type: ignore[union-attr]
    assert await gov.usage("user_spend", Context(user="u_1")) == FIXED["user_spend"]
    assert "tool 'search': its cost callback failed" in caplog.text
