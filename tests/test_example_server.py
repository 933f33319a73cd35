"""examples/server.py as deployed: a subprocess on real Redis and Kafka, called over HTTP.

A FastMCP client on the streamable HTTP transport calls the governed server:
admitted calls succeed, the call past the burst cap gets the budget error with
its retry hint, the cost is metered (in Redis and on the ledger topic), and
once spend reaches the global breaker's cap the next call is shed.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.client.transports import StreamableHttpTransport
from fastmcp.exceptions import ToolError

from mcp_budget_governor import Context, Governor, Policy, PriceTable, RedisBackend, usd
from mcp_budget_governor.stream.topic_reader import read_topic
from testing.buckets import room
from testing.example_server import example_server
from testing.services import KafkaService, start_kafka

ROOT = Path(__file__).resolve().parent.parent
SEARCH_PRICE = usd(0.004)  # examples/server.py's flat price

POLICY = """\
anonymous = "refuse"

[[limits]]
name = "burst"
cap = 3
window = "minute"
scope = "user"

[[limits]]
name = "user_spend"
cap_usd = "1.00"
window = "day"
scope = "user"

[[limits]]
name = "global_spend"
cap_usd = "0.02"
window = "day"
breaker = true
gated = false
fail_mode = "closed"
"""


@pytest.fixture(scope="module")
def kafka() -> Iterator[KafkaService]:
    svc = start_kafka()
    yield svc
    svc.stop()


@pytest.fixture
def server(tmp_path: Path, redis_url: str, kafka: KafkaService) -> Iterator[tuple[str, str, Path]]:
    """The example server on a free port; yields (base URL, ledger topic, policy file)."""
    # A loaded CI machine can take longer than the default 0.25 s for the first check
    # (connect, load the script); this test is about budgets, not fail modes.
    with example_server(
        tmp_path, POLICY, redis_url, kafka.bootstrap, MCPBG_CHECK_TIMEOUT="5"
    ) as srv:
        srv.wait_health('"status":"ok"')
        yield srv.base, srv.topic, srv.policy


def client(base: str, user: str | None) -> Client[StreamableHttpTransport]:
    headers = {} if user is None else {"X-User-Id": user, "X-Tenant-Id": "acme"}
    return Client(StreamableHttpTransport(f"{base}/mcp", headers=headers))


async def test_governed_calls_over_streamable_http(
    server: tuple[str, str, Path], redis_url: str, kafka: KafkaService
) -> None:
    base, topic, policy = server
    # What the stream worker does once it has rebuilt the counters: without the
    # epoch marker the server's checks follow their fail modes.
    backend = RedisBackend.from_url(redis_url)
    await backend.mark_ready("test")

    await room(60, needed=30)  # "burst" is a minute's: alice's 4th call is refused
    async with client(base, "alice") as alice:
        tools = {t.name for t in await alice.list_tools()}
        assert {"search", "summarise"} <= tools
        for i in range(3):
            reply = await alice.call_tool("search", {"query": f"q{i}"})
            assert "results" in str(reply.data)
        with pytest.raises(ToolError) as refused:
            await alice.call_tool("search", {"query": "one too many"})
    message = str(refused.value)
    assert message.startswith("budget_exceeded:user/minute")
    assert "status=429" in message and "retry_after=" in message

    # bob: a model call (its tokens priced) and two searches; the last one is
    # admitted under the $0.02 breaker and takes the spend past it.
    text = "x" * 400
    summary_cost = PriceTable.builtin().cost_micros(
        "claude-sonnet-4-5", input_tokens=400 + len(text) // 4, output_tokens=120
    )
    assert 4 * SEARCH_PRICE + summary_cost < usd("0.02") <= 5 * SEARCH_PRICE + summary_cost
    async with client(base, "bob") as bob:
        reply = await bob.call_tool("summarise", {"text": text})
        assert reply.structured_content["usage"]["output_tokens"] == 120
        for i in range(2):
            await bob.call_tool("search", {"query": f"b{i}"})
    # The breaker has tripped: the next caller is shed.
    async with client(base, "carol") as carol:
        with pytest.raises(ToolError) as shed:
            await carol.call_tool("search", {"query": "shed"})
    assert str(shed.value).startswith("budget_exceeded:global/day")
    assert "status=503" in str(shed.value)

    async with client(base, None) as nobody:
        with pytest.raises(ToolError) as anonymous:
            await nobody.call_tool("search", {"query": "who am I"})
    assert "status=403" in str(anonymous.value)

    # Spend is metered on the shared counters...
    gov = Governor(Policy.from_file(policy), backend)
    assert await gov.usage("user_spend", Context(user="alice")) == 3 * SEARCH_PRICE
    assert await gov.usage("user_spend", Context(user="bob")) == 2 * SEARCH_PRICE + summary_cost
    assert await gov.usage("global_spend") == 5 * SEARCH_PRICE + summary_cost
    await gov.aclose()

    # ...and on the ledger: the server ships its events to the topic.
    # Events ship in the background, per partition (keyed by tenant, else user),
    # so read until every expected one has arrived.
    deadline = time.monotonic() + 30
    while True:
        records = await read_topic(kafka.bootstrap, topic)
        types = [r.event.type for r in records]
        # One metered event per completed call, charging both spend limits; the
        # anonymous caller's refusal is a rejection too.
        expected = {"mcpbg.admitted.v1": 6, "mcpbg.rejected.v1": 3, "mcpbg.metered.v1": 6}
        if all(types.count(t) >= n for t, n in expected.items()):
            break
        assert time.monotonic() < deadline, f"the ledger holds only {sorted(types)}"
        await asyncio.sleep(0.2)
    assert types.count("mcpbg.admitted.v1") == 6
    refusals = sorted(
        r.event.data.decision.status for r in records if r.event.type == "mcpbg.rejected.v1"
    )
    assert refusals == [403, 429, 503]
    metered = [r.event for r in records if r.event.type == "mcpbg.metered.v1"]
    spent = [c.amount for e in metered for c in e.data.charges if c.limit == "global_spend"]
    assert sum(spent) == 5 * SEARCH_PRICE + summary_cost
    # The model call's events carry its tokens, so its cost can be re-derived.
    priced = [e.data.usage for e in metered if e.data.usage is not None]
    assert len(priced) == 1  # one event charging user_spend and global_spend
    assert all({c.limit for c in e.data.charges} == {"user_spend", "global_spend"} for e in metered)
    assert {(u.model, u.input_tokens, u.output_tokens) for u in priced} == {
        ("claude-sonnet-4-5", 500, 120)
    }


def test_health_reports_the_policy(server: tuple[str, str, Path]) -> None:
    base, _, _ = server
    with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:
        assert reply.status == 200
        assert b'"limits":3' in reply.read()
