"""Managed Redis: no script reads Redis' clock, and a node without the scripts is served by EVAL."""

from __future__ import annotations

import re
import time

import redis.asyncio as aioredis

from mcp_budget_governor import RedisBackend
from mcp_budget_governor.caps import CapRef
from mcp_budget_governor.counters import CounterOp
from mcp_budget_governor.lua import SCRIPTS, source

KEY = "mcpbg:v1:calls:user=u1:m202612020000"
FAR = 4_102_444_800  # 2100-01-01


def test_no_script_calls_time() -> None:
    for name in SCRIPTS:
        code = "\n".join(line.split("--")[0] for line in source(name).splitlines())
        assert re.search(r"TIME", code) is None, name


async def test_a_flushed_script_cache_is_served_by_eval(redis_url: str) -> None:
    for coalesce in (True, False):
        backend = RedisBackend.from_url(redis_url, timeout=2.0, coalesce=coalesce)
        admin = aioredis.Redis.from_url(redis_url)
        try:
            op = CounterOp(KEY, 1, 10, True, FAR)
            await admin.script_flush()
            assert (await backend.charge([op])).admitted
            await admin.script_flush()
            assert await backend.usage([KEY]) == [1]
            await admin.script_flush()
            await backend.release(["mcpbg:v1:_lease:p:global"], "l1")
        finally:
            await admin.delete(KEY)
            await admin.aclose()
            await backend.aclose()


async def test_a_run_time_cap_ends_by_the_callers_clock(redis_url: str) -> None:
    """The cap's until is compared with the clock the caller passes, not Redis' own."""
    now = [1_000.0]
    backend = RedisBackend.from_url(redis_url, timeout=2.0, clock=lambda: now[0])
    admin = aioredis.Redis.from_url(redis_url)
    try:
        await admin.hset("mcpbg:v1:_caps:calls", "user=u1", "0 1500 -")
        op = CounterOp(KEY, 1, 10, True, FAR, CapRef("mcpbg:v1:_caps:calls", "user=u1"))
        assert not (await backend.charge([op])).admitted  # cap 0 holds until 1500
        now[0] = 1_500.0
        assert (await backend.charge([op])).admitted  # over by the caller's clock
    finally:
        await admin.delete(KEY, "mcpbg:v1:_caps:calls")
        await admin.aclose()
        await backend.aclose()


async def test_a_lease_expires_by_the_takers_clock(redis_url: str) -> None:
    now = [time.time() - 3600]  # an hour behind Redis' clock: only the caller's counts
    backend = RedisBackend.from_url(redis_url, timeout=2.0, clock=lambda: now[0])
    lease = "mcpbg:v1:_lease:parallel:global"
    try:
        op = CounterOp(lease, 1, 1, True, FAR)
        assert (await backend.charge([op], lease="a", lease_ttl=10)).admitted
        assert not (await backend.charge([op], lease="b", lease_ttl=10)).admitted
        now[0] += 10.001  # the first lease is over by the next caller's clock
        assert (await backend.charge([op], lease="b", lease_ttl=10)).admitted
        assert await backend.in_progress([lease]) == [1]
    finally:
        await backend.client.delete(lease)
        await backend.aclose()


async def test_an_old_argument_list_gets_one_clear_error(redis_url: str) -> None:
    """A client that does not pass its clock is refused, never given a wrong time."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        reply = None
        try:
            await client.eval(source("charge"), 1, KEY, "", "-", "1", "10", "1", str(FAR))
        except Exception as exc:  # the message is the point
            reply = str(exc)
        assert reply is not None and "the last the caller clock" in reply
    finally:
        await client.aclose()
