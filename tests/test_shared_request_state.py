"""``shared_request_state``: FastMCP replicas on one Redis share the approval seal.

Two real FastMCP servers (the same name, each its own Governor, counters in the
same Redis) stand for two replicas: a 2026-07-28 client's approval question
sealed by one is answered on the other. Built with ``shared_request_state``, the
answer admits the call over the ASK limit there; with FastMCP's own per-process
key, the other replica cannot open the state and asks again.
"""

from __future__ import annotations

import re
from typing import Any

import mcp_types as mt
import pytest
import redis
from fastmcp import Client, FastMCP
from mcp.server.request_state import RequestStateSecurity
from mcp.shared.exceptions import MCPError

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    OnExceed,
    Policy,
    RedisBackend,
    Scope,
    Window,
)
from mcp_budget_governor.errors import BackendUnavailableError, GovernorError, InvalidInputError
from mcp_budget_governor.integrations.fastmcp import (
    APPROVAL_REQUEST,
    BudgetMiddleware,
    shared_request_state,
)
from mcp_budget_governor.keys import APPROVAL_KEY

ANA = Context(user="ana")


def stored(url: str) -> bytes | None:
    client = redis.Redis.from_url(url)
    try:
        value = client.get(APPROVAL_KEY)
        return value if isinstance(value, bytes) else None
    finally:
        client.close()


def replica(url: str, shared: bool) -> tuple[Governor, FastMCP]:
    gov = Governor(
        Policy.of(
            Limit("daily", cap=1, window=Window.DAY, scope=Scope.USER, on_exceed=OnExceed.ASK)
        ),
        RedisBackend.from_url(url, timeout=2.0),
    )
    security = shared_request_state(url) if shared else None
    mcp = FastMCP("asking", request_state_security=security)
    mcp.add_middleware(BudgetMiddleware(gov, identify=lambda c: ANA))

    @mcp.tool
    async def search(q: str) -> str:
        return f"results for {q}"

    return gov, mcp


async def never_asked(*args: Any) -> Any:
    raise AssertionError("the test answers the question itself")


async def ask_on_a_answer_on_b(url: str, shared: bool) -> Any:
    """The over-cap call's question from replica A; its answered retry to B."""
    (gov_a, a), (gov_b, b) = replica(url, shared), replica(url, shared)
    try:
        async with (
            Client(a, elicitation_handler=never_asked) as on_a,
            Client(b, elicitation_handler=never_asked) as on_b,
        ):
            await on_a.call_tool("search", {"q": "a"})  # the cap's one call
            question = await on_a.session.call_tool("search", {"q": "b"}, allow_input_required=True)
            assert isinstance(question, mt.InputRequiredResult)
            assert APPROVAL_REQUEST in (question.input_requests or {})
            yes = mt.ElicitResult(action="accept", content={"value": True})
            return await on_b.session.call_tool(
                "search",
                {"q": "b"},
                input_responses={APPROVAL_REQUEST: yes},
                request_state=question.request_state,
                allow_input_required=True,
            )
    finally:
        await gov_a.aclose()
        await gov_b.aclose()


async def test_a_question_sealed_on_one_replica_is_approved_on_another(redis_url: str) -> None:
    answer = await ask_on_a_answer_on_b(redis_url, shared=True)
    assert isinstance(answer, mt.CallToolResult) and not answer.is_error, answer
    assert answer.structured_content == {"result": "results for b"}
    gov = Governor(Policy.of(Limit("daily", cap=1, window=Window.DAY, scope=Scope.USER)),
                   RedisBackend.from_url(redis_url, timeout=2.0))  # fmt: skip
    assert await gov.usage("daily", ANA) == 2  # admitted over the cap, on B
    await gov.aclose()


async def test_with_fastmcps_own_key_the_other_replica_does_not_approve(redis_url: str) -> None:
    with pytest.raises(MCPError, match="Invalid or expired requestState"):
        await ask_on_a_answer_on_b(redis_url, shared=False)
    assert stored(redis_url) is None  # nothing shared was made
    gov = Governor(Policy.of(Limit("daily", cap=1, window=Window.DAY, scope=Scope.USER)),
                   RedisBackend.from_url(redis_url, timeout=2.0))  # fmt: skip
    assert await gov.usage("daily", ANA) == 1  # only the call within the cap
    await gov.aclose()


def test_the_key_is_created_once_as_64_hex_digits_and_then_read(redis_url: str) -> None:
    first = shared_request_state(redis_url)
    value = stored(redis_url)
    assert value is not None and re.fullmatch(rb"[0-9a-f]{64}", value)
    again = shared_request_state(redis_url, ttl=30.0)
    assert stored(redis_url) == value and again.ttl == 30.0 and first.ttl == 600.0
    # The stored digits are the seal's key: a codec built from them opens its state.
    token = first.codec.seal(b"daily")
    assert (
        RequestStateSecurity(keys=[bytes.fromhex(value.decode())]).codec.unseal(token) == b"daily"
    )


@pytest.mark.parametrize(
    ("value", "shape"),
    [(b"ab" * 31, "62 bytes"), (b"AB" * 32, "64 bytes"), (b"zz" * 32, "64 bytes")],
)
def test_a_malformed_stored_key_is_one_clear_error(
    redis_url: str, value: bytes, shape: str
) -> None:
    redis.Redis.from_url(redis_url).set(APPROVAL_KEY, value)
    with pytest.raises(GovernorError, match=f"holds no approval key .*got {shape}") as err:
        shared_request_state(redis_url)
    assert APPROVAL_KEY in str(err.value) and value.decode() not in str(err.value)
    assert err.value.__context__ is None  # one error, nothing chained


def test_a_key_of_another_type_is_one_clear_error(redis_url: str) -> None:
    redis.Redis.from_url(redis_url).hset(APPROVAL_KEY, "a", "b")
    with pytest.raises(GovernorError, match="got the error WRONGTYPE"):
        shared_request_state(redis_url)


def test_an_unreachable_redis_names_the_url_without_its_password() -> None:
    url = "redis://:s3cret@127.0.0.1:1/0"
    with pytest.raises(BackendUnavailableError, match=r"redis://\*\*\*@127.0.0.1:1/0") as err:
        shared_request_state(url, timeout=0.5)
    assert "s3cret" not in str(err.value) and err.value.__suppress_context__


@pytest.mark.parametrize(
    ("url", "options", "field"),
    [
        ("http://x", {}, "redis_url"),
        ("redis+cluster://h:7000", {}, "redis_url"),
        ("redis://h/0", {"ttl": 0}, "ttl"),
        ("redis://h/0", {"ttl": float("inf")}, "ttl"),
        ("redis://h/0", {"timeout": True}, "timeout"),
    ],
)
def test_bad_arguments_are_named(url: str, options: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInputError, match=f"^{field}:"):
        shared_request_state(url, **options)
