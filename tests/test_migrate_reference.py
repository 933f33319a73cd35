"""``mcpbg migrate --from-reference``: a user switching mid-day keeps today's counters.

The reference's counters are written here as it wrote them (a plain string at its
key, with a TTL to the bucket's end), on a real Redis.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Window
from mcp_budget_governor.cli import main
from mcp_budget_governor.keys import counter_key, ttl_seconds
from mcp_budget_governor.projections.counters.from_reference import (
    move_reference_counters,
    op_id,
)
from mcp_budget_governor.reference_keys import parse_reference_key

POLICY_TOML = """
[[limits]]
name = "per_user_calls"
cap = 5
window = "day"
scope = "user"

[[limits]]
name = "burst"
cap = 100
window = "minute"
scope = ["user", "tool"]
"""

CALLS = Limit("per_user_calls", cap=5, window=Window.DAY, scope=Scope.USER)


def policy() -> Policy:
    return Policy.of(
        CALLS, Limit("burst", cap=100, window=Window.MINUTE, scope=(Scope.USER, Scope.TOOL))
    )


def write_reference(client: redis.Redis, limit: Limit, values: dict[Scope, str], n: int,
                    moment: datetime) -> str:  # fmt: skip
    key = counter_key(limit, values, moment)
    client.set(key, n, ex=ttl_seconds(limit.window, moment))
    return key


def test_todays_counts_move_and_the_governor_enforces_them(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis.Redis.from_url(redis_url)
    now = datetime.now(UTC)
    today = write_reference(client, CALLS, {Scope.USER: "u:1"}, 4, now)  # a colon in the id
    yesterday = write_reference(client, CALLS, {Scope.USER: "u:1"}, 9, now - timedelta(days=1))
    client.set("mcpbg:gone_limit:user=u:20260101", 3)  # a limit the policy no longer has
    path = tmp_path / "policy.toml"
    path.write_text(POLICY_TOML)

    args = ["migrate", "--from-reference", "--redis-url", redis_url, "--policy", str(path)]
    assert main([*args, "--dry-run"]) == 0
    assert "would move 1 counter(s); left 1 whose period ended and 1 of no policy limit" in (
        capsys.readouterr().out
    )
    assert int(client.get(today) or 0) == 4  # a dry run moves nothing
    assert main(args) == 0
    assert "moved 1 counter(s)" in capsys.readouterr().out
    assert int(client.get(today) or 0) == 0 and int(client.get(yesterday) or 0) == 9

    u1 = Context(user="u:1")

    async def calls() -> tuple[int, list[bool]]:
        async with Governor(policy(), RedisBackend.from_url(redis_url)) as gov:
            used = await gov.usage("per_user_calls", u1)
            return used, [(await gov.check(u1)).allowed for _ in range(2)]

    assert asyncio.run(calls()) == (4, [True, False])  # 4 moved + 1 = the cap
    # Run again: nothing left to move, nothing counted twice.
    assert main(args) == 0
    assert "moved 0 counter(s)" in capsys.readouterr().out
    assert asyncio.run(calls())[0] == 5
    client.close()


async def test_a_run_that_died_after_the_charge_counts_it_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    now = datetime.now(UTC)
    key = write_reference(client, CALLS, {Scope.USER: "u_2"}, 3, now)
    backend = RedisBackend.from_url(redis_url)
    counter = parse_reference_key(key, policy())
    assert counter is not None
    # The first run charged our counter, then died before taking it off the old key.
    first = await move_reference_counters(backend, policy(), now=time.time(), dry_run=True)
    ((_, ours, amount),) = first.moved
    from mcp_budget_governor.counters import CounterOp

    expire = int(time.time()) + 3600
    await backend.charge([CounterOp(ours, amount, 5, False, expire)], op_id=op_id(counter, 3))
    await move_reference_counters(backend, policy(), now=time.time())
    assert await backend.usage([ours]) == [3]
    assert int(client.get(key) or 0) == 0
    # A reference replica still running adds 2 more: the next run moves those only.
    client.incrby(key, 2)
    done = await move_reference_counters(backend, policy(), now=time.time())
    assert [m[2] for m in done.moved] == [2] and await backend.usage([ours]) == [5]
    await backend.aclose()
    client.close()


def test_keys_that_are_not_a_policy_limits_counter_are_left_alone() -> None:
    p = policy()
    assert parse_reference_key("mcpbg:v1:per_user_calls:user=u:20260805", p) is None
    assert parse_reference_key("mcpbg:per_user_calls:user=u:2026080514", p) is None  # hour
    assert parse_reference_key("mcpbg:per_user_calls:tenant=t:20260805", p) is None
    assert parse_reference_key("mcpbg:per_user_calls:global:20260805", p) is None
    assert parse_reference_key("mcpbg:per_user_calls:user=u:2026zz05", p) is None
    burst = parse_reference_key("mcpbg:burst:tool=a=b:user=u:202608051430", p)
    assert burst is not None and (burst.ctx.user, burst.ctx.tool) == ("u", "a=b")


def test_a_reference_key_lists_the_scope_in_its_declared_order() -> None:
    """The reference wrote (TOOL, USER) as tool=...:user=...; ours count both orders on
    one counter, and a migration reads the key back whichever order it has."""
    moment = datetime(2026, 8, 5, 14, 30, tzinfo=UTC)
    values = {Scope.USER: "u", Scope.TOOL: "search"}
    tool_first = Limit("burst", cap=9, window=Window.MINUTE, scope=(Scope.TOOL, Scope.USER))
    user_first = Limit("burst", cap=9, window=Window.MINUTE, scope=("user", "tool"))
    key = counter_key(tool_first, values, moment)
    assert key == "mcpbg:burst:tool=search:user=u:202608051430"
    assert counter_key(user_first, values, moment) == "mcpbg:burst:user=u:tool=search:202608051430"
    assert tool_first == user_first and tool_first.scope == user_first.scope
    counter = parse_reference_key(key, Policy.of(user_first))
    assert counter is not None and (counter.ctx.user, counter.ctx.tool) == ("u", "search")


async def test_a_policy_in_another_time_zone_is_refused(redis_url: str) -> None:
    from mcp_budget_governor.errors import InvalidInputError

    zoned = Policy.of(CALLS, timezone="Europe/Paris")
    backend = RedisBackend.from_url(redis_url)
    with pytest.raises(InvalidInputError, match=r"policy\.timezone"):
        await move_reference_counters(backend, zoned, now=time.time())
    await backend.aclose()
