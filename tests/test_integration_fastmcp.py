"""BudgetMiddleware on a real FastMCP 4 server, called by a real FastMCP Client.

Every test runs over both transports (the in-memory transport, and streamable
HTTP against a uvicorn server on a free loopback port in its own thread and
event loop) and both backends (memory, and the real Redis of the fixtures).
The governor lives in the server's event loop; the test reads its counters
there (``Served.usage``), as an operator's ``usage()`` would.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
from fastmcp import Client, FastMCP
from fastmcp.exceptions import ToolError
from fastmcp.server.middleware import MiddlewareContext

from mcp_budget_governor import (
    ANONYMOUS_USER,
    Anonymous,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    MemoryBackend,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware, BudgetToolError, tool_price
from mcp_budget_governor.integrations.flow import governed_context
from testing.thread_server import ThreadServer

T = TypeVar("T")
# One instant for the whole run: every call lands in the same minute bucket,
# so a cap cannot be reset by a minute boundary mid-test, and the retry hint
# is exact. Counters still get a real TTL (bucket end plus an hour of grace).
NOW = time.time()
MINUTE_LEFT = max(1, math.ceil((NOW // 60 + 1) * 60 - NOW))
USD = Unit.USD_MICROS
#: Tools that saw their call cancelled (appended in the server's loop, read by the test).
CANCELLED: list[str] = []


def policy(anonymous: Anonymous = Anonymous.REFUSE) -> Policy:
    return Policy.of(
        Limit("burst", cap=3, window=Window.MINUTE, scope=Scope.USER),
        Limit("user_spend", cap=usd(1), window=Window.DAY, scope=Scope.USER, unit=USD, gated=False),
        Limit("spend", cap=usd("0.10"), window=Window.DAY, unit=USD, breaker=True, gated=False),
        Limit("per_tool", cap=1000, window=Window.DAY, scope=Scope.TOOL),
        anonymous=anonymous,
    )


def user_from_meta(context: MiddlewareContext[Any]) -> Context | None:
    """Tests name the caller in the request's _meta (a real server would use its auth)."""
    fc = context.fastmcp_context
    rc = fc.request_context if fc is not None else None
    user = (rc.meta or {}).get("user") if rc is not None else None
    return Context(user=user, tenant="acme") if isinstance(user, str) else None


def build_server(governor: Governor, **middleware: Any) -> FastMCP:
    mcp = FastMCP("governed", mask_error_details=True)
    mcp.add_middleware(BudgetMiddleware(governor, **middleware))
    both = ["user_spend", "spend"]

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.01", "limit": both}})
    async def echo(text: str) -> str:
        return text

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.02", "limit": "user_spend"}})
    async def fail() -> str:
        raise ValueError("the upstream API broke")

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.10", "limit": both}})
    async def expensive() -> str:
        return "done"

    @mcp.tool
    async def priced(n: int) -> int:
        return n

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.01", "limit": "nope"}})
    async def misconfigured() -> str:
        return "never runs"

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.03", "limit": "user_spend"}})
    async def stuck() -> str:
        # Runs until the client gives up and cancels the call.
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            CANCELLED.append("stuck")
            raise
        return "never"

    @mcp.tool
    async def self_metering(micros: int) -> str:
        # A tool that meters what it spent itself, charged to the governed caller.
        ctx = governed_context()
        assert ctx is not None
        await governor.meter("user_spend", micros, ctx)
        return f"{ctx.user}/{ctx.tenant}/{ctx.tool}"

    return mcp


class Served:
    """A governed FastMCP server reachable by a client, over one transport."""

    def __init__(self, governor: Governor, client: Callable[[], Client[Any]], host: Any) -> None:
        self.governor = governor
        self.client = client
        self._host = host

    async def usage(self, limit: str, ctx: Context | None = None) -> int:
        coro = self.governor.usage(limit, ctx)
        if isinstance(self._host, ThreadServer):
            return await self._host.run(coro)
        return await coro


Serve = Callable[..., Any]


@pytest.fixture(params=["memory", "redis"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["in-memory", "http"])
def serve(request: pytest.FixtureRequest, backend_kind: str) -> Serve:
    """``async with serve(policy, **middleware) as served``: a governed server and a client."""
    url = request.getfixturevalue("redis_url") if backend_kind == "redis" else None

    def make_governor() -> Governor:
        backend = RedisBackend.from_url(url, timeout=2.0) if url else MemoryBackend()
        return Governor(the_policy, backend, clock=lambda: NOW)

    @asynccontextmanager
    async def served(pol: Policy, **middleware: Any) -> AsyncIterator[Served]:
        nonlocal the_policy
        the_policy = pol
        if request.param == "in-memory":
            gov = make_governor()
            mcp = build_server(gov, **middleware)
            try:
                yield Served(gov, lambda: Client(mcp), None)
            finally:
                await gov.aclose()
            return

        async def build() -> tuple[Any, Governor]:
            gov = make_governor()
            return build_server(gov, **middleware).http_app(), gov

        host = await asyncio.to_thread(ThreadServer(build).start)
        try:
            yield Served(host.state, lambda: Client(f"{host.url}/mcp"), host)
        finally:
            await asyncio.to_thread(host.stop)

    the_policy = policy()
    return served


async def call(client: Client[Any], tool: str, user: str | None = "u_1", **args: Any) -> Any:
    meta = {"user": user} if user is not None else None
    return (await client.call_tool(tool, args, meta=meta)).data


async def refusal(client: Client[Any], tool: str, user: str | None = "u_1", **args: Any) -> str:
    with pytest.raises(ToolError) as exc:
        await call(client, tool, user, **args)
    return str(exc.value)


async def test_admits_up_to_the_burst_cap_then_refuses_with_the_retry_hint(serve: Serve) -> None:
    async with serve(policy(), identify=user_from_meta) as s, s.client() as client:
        assert [await call(client, "echo", text=f"hi {i}") for i in range(3)] == [
            "hi 0",
            "hi 1",
            "hi 2",
        ]
        text = await refusal(client, "echo", text="one too many")
        assert text.startswith("budget_exceeded:user/minute limit=burst status=429 ")
        assert f"retry_after={MINUTE_LEFT}s" in text
        assert "resets_at=" in text and f"Do not call again for {MINUTE_LEFT} seconds" in text
        # The refused call was charged nothing; the three admitted ones were metered.
        me = Context(user="u_1", tenant="acme")
        assert await s.usage("burst", me) == 3
        assert await s.usage("user_spend", me) == 3 * usd("0.01")
        assert await s.usage("spend") == 3 * usd("0.01")
        assert await s.usage("per_tool", Context(tool="echo")) == 3
        # Another user has a burst of their own.
        assert await call(client, "echo", user="u_2", text="mine") == "mine"


async def test_the_breaker_trips_on_metered_spend_and_sheds_the_next_call(serve: Serve) -> None:
    async with serve(policy(), identify=user_from_meta) as s, s.client() as client:
        assert await call(client, "expensive") == "done"  # $0.10: reaches the cap, completes
        assert await s.usage("spend") == usd("0.10")
        text = await refusal(client, "echo", user="u_2", text="x")
        assert text.startswith("budget_exceeded:global/day limit=spend status=503 ")
        assert "retry_after=" in text
        assert await s.usage("burst", Context(user="u_2", tenant="acme")) == 0


async def test_a_tool_that_raises_keeps_its_admission_and_pays_its_fixed_price(
    serve: Serve,
) -> None:
    priced_calls: list[str] = []

    def cost(context: MiddlewareContext[Any], result: Any) -> dict[str, int] | None:
        priced_calls.append(context.message.name)
        return None

    async with serve(policy(), identify=user_from_meta, cost=cost) as s, s.client() as client:
        text = await refusal(client, "fail")
        assert "fail" in text and "budget" not in text  # the tool's own error, masked
        me = Context(user="u_1", tenant="acme")
        assert await s.usage("burst", me) == 1
        assert await s.usage("user_spend", me) == usd("0.02")
        assert priced_calls == []  # no result to price


async def eventually(read: Callable[[], Awaitable[T]], want: T) -> T:
    """Poll ``read`` until it returns ``want`` (the server finishes a cancelled call on its own
    time); the last value read otherwise, for the assertion to show."""
    got = await read()
    for _ in range(200):
        if got == want:
            break
        await asyncio.sleep(0.025)
        got = await read()
    return got


async def test_a_call_the_client_cancels_pays_its_fixed_price(serve: Serve) -> None:
    """The client gives up on an admitted call: it sends ``notifications/cancelled``, the
    server cancels the tool, and the call is charged its meta price all the same."""
    CANCELLED.clear()
    async with serve(policy(), identify=user_from_meta) as s, s.client() as client:
        me = Context(user="u_1", tenant="acme")
        pending = asyncio.ensure_future(call(client, "stuck"))
        assert await eventually(lambda: s.usage("burst", me), 1) == 1  # admitted, running
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        # The price was charged with the admission, before the cancellation: once.
        assert await eventually(lambda: asyncio.sleep(0, CANCELLED), ["stuck"]) == ["stuck"]
        assert await s.usage("user_spend", me) == usd("0.03")  # not left to finish, paid once
        assert await s.usage("burst", me) == 1
        # The session goes on: the next call is served and charged as usual.
        assert await call(client, "echo", text="after") == "after"
        assert await s.usage("user_spend", me) == usd("0.03") + usd("0.01")


async def test_a_call_that_times_out_on_the_client_pays_its_fixed_price(serve: Serve) -> None:
    CANCELLED.clear()
    async with serve(policy(), identify=user_from_meta) as s, s.client() as client:
        with pytest.raises(Exception, match=r"(?i)time"):
            await client.call_tool("stuck", {}, meta={"user": "u_2"}, timeout=0.5)
        me = Context(user="u_2", tenant="acme")
        assert await eventually(lambda: s.usage("user_spend", me), usd("0.03")) == usd("0.03")
        assert await eventually(lambda: asyncio.sleep(0, CANCELLED), ["stuck"]) == ["stuck"]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda r: 1 / 0, id="raises"),
        pytest.param(lambda r: {"user_spend": -1}, id="negative"),
        pytest.param(lambda r: {"user_spend": 2**60}, id="too-large"),
        pytest.param(lambda r: {"nope": 1}, id="unknown-limit"),
        pytest.param(lambda r: {"user_spend": "0.01"}, id="wrong-type"),
        pytest.param(lambda r: [("user_spend", 1)], id="not-a-mapping"),
    ],
)
async def test_a_failing_cost_callback_charges_the_meta_price_and_returns_the_result(
    serve: Serve, bad: Callable[[Any], Any], caplog: pytest.LogCaptureFixture
) -> None:
    def cost(context: MiddlewareContext[Any], result: Any) -> Any:
        return bad(result)

    async with serve(policy(), identify=user_from_meta, cost=cost) as s, s.client() as client:
        assert await call(client, "echo", text="still here") == "still here"
        me = Context(user="u_1", tenant="acme")
        assert await s.usage("user_spend", me) == usd("0.01")  # echo's meta price
        assert await s.usage("spend") == usd("0.01")
    assert "tool 'echo': its cost callback failed" in caplog.text


async def test_cost_from_the_callback_replaces_the_meta_price(serve: Serve) -> None:
    def cost(context: MiddlewareContext[Any], result: Any) -> dict[str, int] | None:
        if context.message.name != "priced":
            return None  # keep the tool's meta price
        return {"user_spend": result.structured_content["result"] * usd("0.001")}

    async with serve(policy(), identify=user_from_meta, cost=cost) as s, s.client() as client:
        assert await call(client, "priced", n=7) == 7
        assert await call(client, "echo", text="x") == "x"
        me = Context(user="u_1", tenant="acme")
        assert await s.usage("user_spend", me) == 7 * usd("0.001") + usd("0.01")
        assert await s.usage("spend") == usd("0.01")  # only echo's meta charges spend


async def test_an_async_callback_and_identify_work_too(serve: Serve) -> None:
    async def identify(context: MiddlewareContext[Any]) -> Context | None:
        await asyncio.sleep(0)
        return user_from_meta(context)

    async def cost(context: MiddlewareContext[Any], result: Any) -> dict[str, int]:
        await asyncio.sleep(0)
        return {"spend": usd("0.03")}

    async with serve(policy(), identify=identify, cost=cost) as s, s.client() as client:
        assert await call(client, "priced", n=1) == 1
        assert await s.usage("spend") == usd("0.03")
        assert await s.usage("burst", Context(user="u_1", tenant="acme")) == 1


async def test_a_tool_meters_its_own_spend_on_the_governed_context(serve: Serve) -> None:
    async with serve(policy(), identify=user_from_meta) as s, s.client() as client:
        assert await call(client, "self_metering", micros=1234) == "u_1/acme/self_metering"
        assert await s.usage("user_spend", Context(user="u_1", tenant="acme")) == 1234
    assert governed_context() is None  # set only while a governed call runs


async def test_an_unidentified_caller_is_refused_by_default(serve: Serve) -> None:
    async with serve(policy(), identify=user_from_meta) as s, s.client() as client:
        text = await refusal(client, "echo", user=None, text="who am I")
        assert text.startswith("caller_unidentified limit=burst status=403.")
        assert "Retrying will not help" in text
        assert await s.usage("spend") == 0
        assert await s.usage("per_tool", Context(tool="echo")) == 0
        assert await call(client, "echo", text="named") == "named"


async def test_without_identify_and_without_auth_nobody_is_named(serve: Serve) -> None:
    async with serve(policy()) as s, s.client() as client:
        assert "caller_unidentified" in await refusal(client, "echo", text="x")
        assert await s.usage("spend") == 0


async def test_unidentified_callers_share_one_anonymous_bucket_when_the_policy_says_so(
    serve: Serve,
) -> None:
    async with serve(policy(Anonymous.SHARED), identify=user_from_meta) as s, s.client() as c:
        assert await call(c, "echo", user=None, text="a") == "a"
        assert await call(c, "echo", user="", text="b") == "b"  # an empty id names nobody
        assert await call(c, "echo", user=None, text="c") == "c"
        assert "budget_exceeded:user/minute" in await refusal(c, "echo", user=None, text="d")
        anonymous = Context(user=ANONYMOUS_USER)
        assert await s.usage("burst", anonymous) == 3
        assert await s.usage("user_spend", anonymous) == 3 * usd("0.01")
        # A real user is untouched by the anonymous bucket.
        assert await call(c, "echo", text="named") == "named"
        assert await s.usage("burst", Context(user="u_1", tenant="acme")) == 1


async def test_a_malformed_meta_price_fails_before_the_tool_runs(serve: Serve) -> None:
    async with serve(policy(), identify=user_from_meta) as s, s.client() as client:
        text = await refusal(client, "misconfigured")
        assert text.startswith("budget configuration error: tool 'misconfigured' meta.mcpbg.limit")
        assert "no such limit" in text and "'nope'" in text
        assert await s.usage("burst", Context(user="u_1", tenant="acme")) == 0


# -- tool_price: the meta format, without a server ---------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        ("0.01", "tool 't' meta.mcpbg", "expected"),
        ({"cost_usd": "0.01"}, "tool 't' meta.mcpbg.limit", "limit name"),
        ({"limit": [], "cost": 1}, "tool 't' meta.mcpbg.limit", "limit name"),
        ({"limit": "spend"}, "tool 't' meta.mcpbg", "exactly one"),
        ({"limit": "spend", "cost": 1, "cost_usd": "1"}, "tool 't' meta.mcpbg", "exactly one"),
        ({"limit": "spend", "cost_usd": "-1"}, "tool 't' meta.mcpbg.cost_usd", "negative"),
        ({"limit": "spend", "cost_usd": "lots"}, "tool 't' meta.mcpbg.cost_usd", "not a number"),
        ({"limit": "burst", "cost_usd": "0.01"}, "tool 't' meta.mcpbg.cost_usd", "counts calls"),
        ({"limit": "spend", "cost": 1.5}, "tool 't' meta.mcpbg.cost", "integer"),
        ({"limit": "spend", "cost": 1, "price": 2}, "tool 't' meta.mcpbg.price", "unknown"),
    ],
)
def test_tool_price_rejects_a_bad_declaration_naming_the_field(
    spec: Any, field: str, words: str
) -> None:
    with pytest.raises(InvalidInputError) as exc:
        tool_price(policy(), "t", {"mcpbg": spec})
    assert exc.value.field == field
    assert words in str(exc.value)


def test_tool_price_reads_dollars_and_raw_amounts() -> None:
    pol = policy()
    assert tool_price(pol, "t", None) is None
    assert tool_price(pol, "t", {"other": 1}) is None
    both = {"mcpbg": {"limit": ["user_spend", "spend"], "cost_usd": 0.1}}
    assert tool_price(pol, "t", both) == {"user_spend": 100_000, "spend": 100_000}
    assert tool_price(pol, "t", {"mcpbg": {"limit": "burst", "cost": 2}}) == {"burst": 2}
    with pytest.raises(InvalidInputError, match="no such limit") as exc:
        tool_price(pol, "t", {"mcpbg": {"limit": "nope", "cost": 1}})
    assert (exc.value.field, exc.value.value) == ("tool 't' meta.mcpbg.limit", "nope")


def test_the_refusal_is_a_tool_error_carrying_the_decision() -> None:
    from mcp_budget_governor.decision import Decision

    d = Decision(admitted=False, limit="spend", status=402, reason="budget_exceeded:user/day")
    err = BudgetToolError(d)
    assert isinstance(err, ToolError) and err.decision is d
    assert str(err).startswith("budget_exceeded:user/day limit=spend status=402. ")
    assert "Do not retry" in str(err)


def test_the_middleware_refuses_misuse_when_built() -> None:
    with pytest.raises(TypeError, match="Governor"):
        BudgetMiddleware(object())  # type: ignore[arg-type]
    gov = Governor(policy(), MemoryBackend())
    with pytest.raises(TypeError, match="identify"):
        BudgetMiddleware(gov, identify="user")  # type: ignore[arg-type]
