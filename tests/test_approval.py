"""Approval instead of refusal: ``OnExceed.ASK`` asks the MCP client's user.

A real FastMCP server and a real FastMCP client with an elicitation handler
(in-memory transport): accepted, the over-budget call runs and its admission
is marked over in the ledger with the approval; declined, unanswered, or a
client that cannot elicit, it is refused as usual. A breaker never asks.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import mcp_types as mt
import pytest
from fastmcp import Client, FastMCP
from fastmcp.exceptions import ToolError

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    OnExceed,
    Policy,
    PolicyError,
    Scope,
    Window,
)
from mcp_budget_governor.approval import Approval, approval_state, open_approval
from mcp_budget_governor.events import encode, parse, to_entry
from mcp_budget_governor.integrations.fastmcp import APPROVAL_REQUEST, BudgetMiddleware
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.policy_file import loads
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.fastdecode import decode

ANA = Context(user="ana")
#: One instant for the pure approval-state tests.
NOW = time.time()


def governed(
    backend: Backend, now: float | None = None, **middleware: Any
) -> tuple[Governor, MemoryLedger, FastMCP]:
    """The governor's clock stands still at ``now`` (when it is built, by default), so no
    day boundary falls inside a test; the backend's markers lapse in real time, so the
    instant is taken when the test runs, not when the module was imported."""
    at = time.time() if now is None else now
    ledger = MemoryLedger()
    gov = Governor(
        Policy.of(
            Limit("daily", cap=1, window=Window.DAY, scope=Scope.USER, on_exceed=OnExceed.ASK)
        ),
        backend,
        ledger=ledger,
        clock=lambda: at,
    )
    mcp = FastMCP("asking")
    mcp.add_middleware(BudgetMiddleware(gov, identify=lambda c: ANA, **middleware))

    @mcp.tool
    async def search(q: str) -> str:
        return f"results for {q}"

    return gov, ledger, mcp


def answering(action: str, value: bool = True) -> Any:
    asked: list[str] = []

    async def handler(message: str, response_type: Any, params: Any, context: Any) -> Any:
        asked.append(message)
        if action == "accept":
            return response_type(value=value)
        if action == "hang":
            await asyncio.Event().wait()
        from fastmcp.client.elicitation import ElicitResult

        return ElicitResult(action=action)

    handler.asked = asked  # type: ignore[attr-defined]
    return handler


async def test_an_accepted_approval_admits_the_call_marked_over(backend: Backend) -> None:
    gov, ledger, mcp = governed(backend)
    handler = answering("accept")
    async with Client(mcp, mode="legacy", elicitation_handler=handler) as client:
        await client.call_tool("search", {"q": "a"})  # within the cap: nobody is asked
        assert handler.asked == []
        result = await client.call_tool("search", {"q": "b"})
    assert result.data == "results for b"
    assert len(handler.asked) == 1 and "'daily'" in handler.asked[0]
    assert await gov.usage("daily", ANA) == 2
    kinds = [(e.type, e.over, e.approved) for e in ledger.entries]
    assert kinds == [
        (EntryType.ADMITTED, (), ()),
        (EntryType.REJECTED, (), ()),  # the refusal that asked
        (EntryType.ADMITTED, ("daily",), ("daily",)),
    ]
    # The approval survives the topic: the full parse keeps it, the fast path defers.
    raw = encode(ledger.entries[-1], "test")
    assert to_entry(parse(raw)).approved == ("daily",)
    assert decode(raw, 0) is None


@pytest.mark.parametrize("action", ["decline", "cancel"])
async def test_a_declined_approval_refuses_as_usual(backend: Backend, action: str) -> None:
    gov, ledger, mcp = governed(backend)
    handler = answering(action)
    async with Client(mcp, mode="legacy", elicitation_handler=handler) as client:
        await client.call_tool("search", {"q": "a"})
        with pytest.raises(ToolError, match="budget_exceeded:user/day"):
            await client.call_tool("search", {"q": "b"})
    assert len(handler.asked) == 1
    assert await gov.usage("daily", ANA) == 1
    assert [e.approved for e in ledger.entries] == [(), ()]


async def test_answering_no_in_an_accepted_form_refuses(backend: Backend) -> None:
    gov, _, mcp = governed(backend)
    async with Client(mcp, mode="legacy", elicitation_handler=answering("accept", False)) as client:
        await client.call_tool("search", {"q": "a"})
        with pytest.raises(ToolError, match="budget_exceeded"):
            await client.call_tool("search", {"q": "b"})
    assert await gov.usage("daily", ANA) == 1


async def test_an_unanswered_approval_times_out_into_the_refusal(backend: Backend) -> None:
    gov, _, mcp = governed(backend, approval_timeout=0.2)
    async with Client(mcp, mode="legacy", elicitation_handler=answering("hang")) as client:
        await client.call_tool("search", {"q": "a"})
        with pytest.raises(ToolError, match="budget_exceeded"):
            await client.call_tool("search", {"q": "b"})
    assert await gov.usage("daily", ANA) == 1


@pytest.mark.parametrize(
    "connect",
    [
        {"mode": "legacy"},  # no elicitation handler: the client declares no such capability
        {},  # the 2026-07-28 protocol, no handler: the question has nobody to answer it
    ],
    ids=["no-handler", "modern-protocol-no-handler"],
)
async def test_a_client_that_cannot_elicit_gets_the_normal_refusal(
    backend: Backend, connect: dict[str, Any]
) -> None:
    gov, _, mcp = governed(backend)
    async with Client(mcp, **connect) as client:
        await client.call_tool("search", {"q": "a"})
        with pytest.raises(ToolError, match="budget_exceeded:user/day"):
            await client.call_tool("search", {"q": "b"})
    assert await gov.usage("daily", ANA) == 1


async def test_a_modern_client_is_asked_in_the_next_round_and_admitted(backend: Backend) -> None:
    """The 2026-07-28 protocol has no back-channel: the question is the call's
    input_required result (SEP-2322), and the retry carrying the answer is admitted."""
    gov, ledger, mcp = governed(backend)
    handler = answering("accept")
    async with Client(mcp, elicitation_handler=handler) as client:
        await client.call_tool("search", {"q": "a"})
        result = await client.call_tool("search", {"q": "b"})
    assert result.data == "results for b"
    assert len(handler.asked) == 1 and "'daily'" in handler.asked[0]
    assert await gov.usage("daily", ANA) == 2
    assert [(e.type, e.approved) for e in ledger.entries] == [
        (EntryType.ADMITTED, ()),
        (EntryType.REJECTED, ()),  # the refusal that asked
        (EntryType.ADMITTED, ("daily",)),
    ]


@pytest.mark.parametrize("answer", [("decline", True), ("accept", False)])
async def test_a_modern_client_that_declines_is_refused(
    backend: Backend, answer: tuple[str, bool]
) -> None:
    gov, _, mcp = governed(backend)
    handler = answering(*answer)
    async with Client(mcp, elicitation_handler=handler) as client:
        await client.call_tool("search", {"q": "a"})
        with pytest.raises(ToolError, match="budget_exceeded:user/day"):
            await client.call_tool("search", {"q": "b"})
    assert len(handler.asked) == 1
    assert await gov.usage("daily", ANA) == 1


def test_a_breaker_cannot_ask() -> None:
    with pytest.raises(PolicyError, match="on_exceed"):
        Limit("trip", cap=1, window=Window.DAY, breaker=True, on_exceed=OnExceed.ASK)


def test_the_policy_file_accepts_ask() -> None:
    policy = loads(
        '[[limits]]\nname = "daily"\ncap = 5\nwindow = "day"\nscope = "user"\non_exceed = "ask"\n'
    )
    assert policy["daily"].on_exceed is OnExceed.ASK


BOB = Context(user="bob")


def yes_retry(client: Client[Any], question: Any) -> Any:
    """The retry of ``search("b")`` that answers ``question`` yes (SEP-2322)."""
    yes = mt.ElicitResult(action="accept", content={"value": True})
    return client.session.call_tool(
        "search",
        {"q": "b"},
        input_responses={APPROVAL_REQUEST: yes},
        request_state=question.request_state,
        allow_input_required=True,
    )


async def test_an_approval_is_spent_once_and_only_by_its_caller(backend: Backend) -> None:
    """One sealed approval state: another caller presenting it, and its own caller
    using it a second time (at once, and concurrently), get the usual refusal; one
    admission over the cap, one ``approved`` event."""
    caller = {"now": ANA}
    gov, ledger, mcp = governed(backend)
    mcp.middleware.clear()
    mcp.add_middleware(BudgetMiddleware(gov, identify=lambda c: caller["now"]))
    async with Client(mcp, elicitation_handler=answering("decline")) as client:
        await client.call_tool("search", {"q": "a"})  # Ana's one call
        caller["now"] = BOB
        await client.call_tool("search", {"q": "a"})  # Bob's one call
        caller["now"] = ANA
        question = await client.session.call_tool("search", {"q": "b"}, allow_input_required=True)
        assert isinstance(question, mt.InputRequiredResult)
        caller["now"] = BOB  # Bob presents Ana's approval: his own cap refuses
        stolen = await yes_retry(client, question)
        assert isinstance(stolen, mt.CallToolResult) and stolen.is_error
        assert "budget_exceeded:user/day" in str(stolen.content[0])
        caller["now"] = ANA
        first = await yes_retry(client, question)
        assert isinstance(first, mt.CallToolResult) and not first.is_error, first
        again = await asyncio.gather(*(yes_retry(client, question) for _ in range(3)))
        assert all(isinstance(r, mt.CallToolResult) and r.is_error for r in again), again
    assert await gov.usage("daily", ANA) == 2 and await gov.usage("daily", BOB) == 1
    approved = [e for e in ledger.entries if e.approved]
    assert [(e.type, e.approved, e.context.user) for e in approved] == [
        (EntryType.ADMITTED, ("daily",), "ana")
    ]


@pytest.mark.parametrize("backend", ["memory", "redis", "postgres", "cluster"], indirect=True)
async def test_the_governor_spends_an_approval_with_the_admission(backend: Backend) -> None:
    """Concurrent uses of one approval too: one admission (on a cluster the marker's
    slot refuses, and the other slots' charges are taken back)."""
    now = time.time()
    gov, ledger, _ = governed(backend, now)
    ana = Context(user=f"ana-{secrets.token_hex(4)}")  # the cluster is never wiped
    assert (await gov.check(ana)).admitted
    approval = Approval("daily", secrets.token_hex(16), int(now) + 60)
    outcomes = await asyncio.gather(*(gov.check(ana, approved=[approval]) for _ in range(4)))
    assert sorted(d.admitted for d in outcomes) == [False, False, False, True]
    refused = await gov.check(ana, approved=[approval])
    assert not refused.admitted and refused.limit == "daily" and refused.status == 429
    lapsed = Approval("daily", secrets.token_hex(16), int(now))
    assert not (await gov.check(ana, approved=[lapsed])).admitted
    assert await gov.usage("daily", ana) == 2
    assert [e.type for e in ledger.entries].count(EntryType.ADMITTED) == 2
    assert [e.approved for e in ledger.entries if e.approved] == [("daily",)]


def test_an_approval_state_opens_for_its_caller_only_before_it_lapses() -> None:
    state = approval_state("daily", ANA, now=NOW, ttl=60)
    opened = open_approval(state, ANA, now=NOW + 59)
    assert opened == "daily" and opened is not None and opened.until == int(NOW + 60)
    assert open_approval(state, ANA.with_tool("other"), now=NOW) is None
    assert open_approval(state, BOB, now=NOW) is None
    assert open_approval(state, ANA, now=NOW + 60) is None
    for other in ["daily", None, "[", '["mcpbg2"]', '["mcpbg2","daily","x","y",1]']:
        assert open_approval(other, ANA, now=NOW) is None


async def test_an_approval_is_not_spent_where_it_cannot_be_counted() -> None:
    """Counters unreachable: the approval cannot be marked spent, so it admits
    nothing; the call is checked as if unapproved (here the limit's local fallback)."""
    from mcp_budget_governor import RedisBackend

    down = RedisBackend.from_url("redis://127.0.0.1:1/0", timeout=0.2)
    gov, _, _ = governed(down)
    assert (await gov.check(ANA)).admitted  # fail-open: the local fallback counts it
    approval = Approval("daily", secrets.token_hex(16), int(time.time()) + 60)
    refused = await gov.check(ANA, approved=[approval])
    assert not refused.admitted and refused.degraded and refused.limit == "daily"
    await down.aclose()
