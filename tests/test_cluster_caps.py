"""Caps per customer on Redis Cluster: what only the cluster has.

The scenarios every backend shares (value caps, plans, run-time caps, grants,
resets, the golden vectors, the fail-open fallback) are tests/test_customer_caps.py's,
which runs them on the cluster too. Here: how stale another process's copy of the
run-time entries may be (``caps_refresh``), and a check whose counters live on
several masters. A cluster is never wiped, so every test has limits (and users in
the plans hash) of its own, named with a fresh tag.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis
from redis.crc import key_slot

from mcp_budget_governor import Context, Governor, Limit, Plan, Policy, Scope, Window, planning
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.projections.counters.cluster import ClusterBackend, parse_cluster_url
from testing.services import RedisClusterService

REFRESH = 0.5


def policy(tag: str) -> Policy:
    return Policy.of(
        Limit(f"tc{tag}", cap=3, window=Window.DAY, scope=Scope.TENANT, caps={"acme": 5}),
        Limit(f"burst{tag}", cap=100, window=Window.DAY, scope=Scope.USER),
        plans=[Plan("pro", caps={f"burst{tag}": 4})],
    )


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
async def cluster(redis_cluster: RedisClusterService) -> AsyncIterator[ClusterBackend]:
    b = ClusterBackend.from_url(redis_cluster.url, timeout=5.0, caps_refresh=REFRESH)
    yield b
    await b.aclose()


async def admitted(gov: Governor, ctx: Context, tries: int) -> int:
    return sum([(await gov.check(ctx)).admitted for _ in range(tries)])


async def test_a_run_time_cap_reaches_another_process_within_the_refresh(
    redis_cluster: RedisClusterService, cluster: ClusterBackend, tag: str
) -> None:
    other = ClusterBackend.from_url(redis_cluster.url, timeout=5.0, caps_refresh=REFRESH)
    writer, reader = Governor(policy(tag), cluster), Governor(policy(tag), other)
    beta, gamma = Context(tenant="beta", user=f"b{tag}"), Context(tenant="gamma", user=f"g{tag}")
    try:
        assert await admitted(reader, beta, 4) == 3  # the reader has read beta's entries
        await writer.set_cap(f"tc{tag}", 6, tenant="beta", reason="upgrade", actor="ops")
        assert await admitted(writer, beta, 1) == 1  # the writer's own copy was dropped
        changed_at = time.time()
        while not (await reader.check(beta)).admitted:  # within the refresh bound
            assert time.time() - changed_at < REFRESH + 1.0
            await asyncio.sleep(0.05)
        assert await admitted(reader, beta, 5) == 1  # 6 in all: 3 + 1 + 1 + 1
        assert await admitted(reader, gamma, 5) == 3  # another tenant keeps the default
        decision = await reader.check(beta)
        assert not decision.admitted and decision.limit == f"tc{tag}"
        await writer.unset_cap(f"tc{tag}", tenant="beta")
        assert await admitted(writer, beta, 1) == 0
    finally:
        await other.aclose()


async def test_a_run_time_cap_until_a_date_ends_without_a_refresh(
    redis_cluster: RedisClusterService, tag: str
) -> None:
    backend = ClusterBackend.from_url(redis_cluster.url, timeout=5.0, caps_refresh=3600)
    gov = Governor(policy(tag), backend)
    beta = Context(tenant="beta", user=f"b{tag}")
    try:
        change = await gov.set_cap(f"tc{tag}", 1, tenant="beta", until=time.time() + 1.0)
        assert await admitted(gov, beta, 3) == 1
        await asyncio.sleep(change.until - time.time() + 0.05)  # whole seconds
        assert await admitted(gov, beta, 3) == 2  # the default 3 again
    finally:
        await backend.aclose()


def _master(service: RedisClusterService, key: str) -> int:
    host, port = parse_cluster_url(service.url)[0]
    slot = key_slot(key.encode())
    for start, end, master, *_ in redis.Redis(host=host, port=port).execute_command(
        "CLUSTER SLOTS"
    ):
        if start <= slot <= end:
            return int(master[1])
    raise AssertionError(f"slot {slot} unserved")


async def test_a_check_over_several_masters_uses_each_counters_effective_cap(
    redis_cluster: RedisClusterService, cluster: ClusterBackend, tag: str
) -> None:
    """A tenant's run-time cap on one master, a user's plan on another: each group
    of the split charge compares with its own effective cap and grant."""
    pol = policy(tag)
    for i in range(1000):
        ctx = Context(tenant=f"t{i}", user=f"m{i}{tag}")
        keys = {s.limit.name: s.key for s in planning.check_slots(pol, ctx, time.time())}
        if _master(redis_cluster, keys[f"tc{tag}"]) != _master(redis_cluster, keys[f"burst{tag}"]):
            break
    else:
        raise AssertionError("no context spread over two masters")
    gov = Governor(pol, cluster)
    await gov.set_cap(f"tc{tag}", 8, tenant=ctx.tenant or "")
    await gov.assign_plan("pro", user=ctx.user)
    await gov.grant(f"burst{tag}", 1, user=ctx.user or "")
    decisions = [await gov.check(ctx) for _ in range(7)]
    assert sum(d.admitted for d in decisions) == 5  # pro's 4 + the grant's 1
    assert decisions[-1].limit == f"burst{tag}"
    assert await gov.usage(f"tc{tag}", ctx) == 5  # refused checks were taken back
    await gov.assign_plan(None, user=ctx.user)  # default 100 again: the tenant cap decides
    assert await admitted(gov, ctx, 5) == 3
    assert (await gov.check(ctx)).limit == f"tc{tag}"


def test_caps_refresh_is_checked(redis_cluster: RedisClusterService) -> None:
    from mcp_budget_governor import RedisBackend

    backend = RedisBackend.from_url(redis_cluster.url, caps_refresh=0.25)
    assert isinstance(backend, ClusterBackend) and backend._runtime.refresh == 0.25
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidInputError, match="caps_refresh"):
            ClusterBackend.from_url(redis_cluster.url, caps_refresh=bad)  # type: ignore[arg-type]
