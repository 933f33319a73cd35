"""The loop guard: a cap on identical calls (same tool, same arguments) per session or user."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastmcp import Client, FastMCP

from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window
from mcp_budget_governor.errors import InvalidInputError, PolicyError
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware
from mcp_budget_governor.policy_file import loads
from mcp_budget_governor.repeats import call_hash, canonical_json, counts_calls

REPEAT_TEXT = "You are repeating yourself"


def _server(policy: Policy, backend: object = None) -> tuple[FastMCP, list[str]]:
    seen: list[str] = []
    mcp = FastMCP("loop")

    @mcp.tool
    def search(q: str) -> str:
        seen.append(q)
        return q

    @mcp.tool
    def fetch(url: str) -> str:
        seen.append(url)
        return url

    governor = Governor(policy, backend)  # type: ignore[arg-type]
    mcp.add_middleware(
        BudgetMiddleware(governor, identify=lambda c: Context(user="u_1", session="s-1"))
    )
    return mcp, seen


async def _calls(mcp: FastMCP, calls: list[tuple[str, dict[str, str]]]) -> list[str | None]:
    """Each call's refusal text, or None when it was admitted."""
    out: list[str | None] = []
    async with Client(mcp) as c:
        for tool, args in calls:
            r = await c.call_tool(tool, args, raise_on_error=False)
            out.append(r.content[0].text if r.is_error else None)  # type: ignore[union-attr]
    return out


# The default (embedded, in-memory) counters; test_repeats_on_redis covers a shared store.
POLICY = """
[[limits]]
name = "repeats"
cap = 3
window = "minute"
scope = ["session", "call"]
"""


def test_ten_identical_calls_admit_three_and_refuse_seven() -> None:
    mcp, seen = _server(loads(POLICY))
    results = asyncio.run(
        _calls(mcp, [("search", {"q": "same"})] * 10 + [("search", {"q": "other"})])
    )
    assert results[:3] == [None] * 3
    for text in results[3:10]:
        assert text is not None and text.startswith("budget_exceeded:session+call/minute")
        assert REPEAT_TEXT in text and "change your approach" in text
    assert results[10] is None  # other arguments are another call
    assert seen == ["same"] * 3 + ["other"]


def test_repeats_on_redis(redis_url: str) -> None:
    from mcp_budget_governor import RedisBackend

    mcp, seen = _server(loads(POLICY), RedisBackend.from_url(redis_url))
    results = asyncio.run(_calls(mcp, [("search", {"q": "same"})] * 10))
    assert results.count(None) == 3 and len(seen) == 3


def test_a_guard_per_tool_by_name_or_glob() -> None:
    policy = loads(POLICY + 'tools = ["sea*"]\n')
    mcp, _ = _server(policy)
    results = asyncio.run(_calls(mcp, [("search", {"q": "x"})] * 5 + [("fetch", {"url": "u"})] * 5))
    assert results.count(None) == 3 + 5  # fetch is not guarded
    assert policy["repeats"].tools == ("sea*",)
    assert not policy["repeats"].applies_to(None)


def test_other_limits_see_no_call_hash_without_a_guard() -> None:
    per_user = Policy.of(Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER))
    assert not counts_calls(per_user)
    assert counts_calls(loads(POLICY))


def test_the_hash_is_canonical() -> None:
    assert call_hash("search", {"q": "a", "n": 1}) == call_hash("search", {"n": 1.0, "q": "a"})
    assert call_hash("search", {"q": "a"}) != call_hash("fetch", {"q": "a"})
    assert call_hash("search", None) == call_hash("search", {})
    assert len(call_hash("t", {})) == 32
    assert canonical_json({"é": [True, None, 0.5]}) == '{"é":[true,null,0.5]}'
    with pytest.raises(InvalidInputError):
        canonical_json({"x": float("nan")})
    with pytest.raises(InvalidInputError):
        canonical_json({"x": {1, 2}})


def test_bad_tools_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as err:
        Limit("r", cap=3, window=Window.MINUTE, tools=("",))
    assert err.value.field == "Limit('r').tools"
    assert Limit("r", cap=3, window=Window.MINUTE, tools="a_*").tools == ("a_*",)  # type: ignore[arg-type]
