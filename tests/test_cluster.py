"""Redis Cluster: a check whose counters live on different masters admits exactly."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import multiprocessing
import time
import uuid
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from mcp_budget_governor import Context, Governor, RedisBackend, planning
from mcp_budget_governor.counters import CounterOp
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.projections.counters import cluster
from mcp_budget_governor.projections.counters.cluster import ClusterBackend, parse_cluster_url
from testing.services import RedisClusterService
from testing.workers import cluster_checks, cluster_policy


def _owner(service: RedisClusterService, slot: int) -> int:
    """The port of the master serving ``slot``."""
    host, port = parse_cluster_url(service.url)[0]
    for start, end, master, *_ in redis.Redis(host=host, port=port).execute_command(
        "CLUSTER SLOTS"
    ):
        if start <= slot <= end:
            return int(master[1])
    raise AssertionError(f"slot {slot} unserved")


def _keys(ctx: Context, tag: str) -> dict[str, str]:
    slots = planning.check_slots(cluster_policy(tag), ctx, time.time())
    return {s.limit.name.removesuffix(tag): s.key for s in slots}


def _users_off_the_global_master(service: RedisClusterService, n: int, tag: str) -> list[str]:
    """``n`` users whose counters live on another master than the global counter's."""
    global_master = _owner(service, key_slot(_keys(Context(user="x"), tag)["cl_global"].encode()))
    users = []
    for i in range(10_000):
        user = f"cu{i}"
        slot = key_slot(_keys(Context(user=user), tag)["cl_user"].encode())
        if _owner(service, slot) != global_master:
            users.append(user)
        if len(users) == n:
            return users
    raise AssertionError("no users found")


def test_from_url_connects_to_a_cluster_and_refuses_bad_urls() -> None:
    assert isinstance(RedisBackend.from_url("redis+cluster://127.0.0.1:1"), ClusterBackend)
    with pytest.raises(InvalidInputError, match="redis\\+cluster"):
        parse_cluster_url("redis+cluster://")


@pytest.mark.slow
def test_four_processes_125_checks_user_cap_50_global_cap_80(
    redis_cluster: RedisClusterService,
) -> None:
    tag = uuid.uuid4().hex[:8]
    users = _users_off_the_global_master(redis_cluster, 2, tag)
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 4.0
    with ctx.Pool(4) as pool:
        per_process = pool.starmap(
            cluster_checks, [(redis_cluster.url, tag, users, 125, start_at)] * 4
        )
    per_user = {u: sum(p[u] for p in per_process) for u in users}
    assert sum(per_user.values()) == 80
    assert all(n <= 50 for n in per_user.values())

    async def counters() -> tuple[int, dict[str, int]]:
        policy = cluster_policy(tag)
        gov = Governor(policy, RedisBackend.from_url(redis_cluster.url, timeout=5.0))
        try:
            total = await gov.usage(f"cl_global{tag}")
            mine = {u: await gov.usage(f"cl_user{tag}", Context(user=u)) for u in users}
        finally:
            await gov.aclose()
        return total, mine

    # Refused checks left nothing: every counter equals what was admitted.
    assert asyncio.run(counters()) == (80, per_user)


async def test_a_refusal_on_one_master_takes_back_the_other(
    redis_cluster: RedisClusterService,
) -> None:
    tag = uuid.uuid4().hex[:8]
    (user,) = _users_off_the_global_master(redis_cluster, 1, tag)
    policy = cluster_policy(tag)
    gov = Governor(policy, RedisBackend.from_url(redis_cluster.url, timeout=5.0))
    ctx = Context(user=user)
    keys = _keys(ctx, tag)
    try:
        assert (await gov.check(ctx)).admitted
        # The user's counter is full: the global charge (another master) is taken back.
        full = CounterOp(keys["cl_user"], 49, 50, False, int(time.time()) + 3 * 86_400)
        await gov.backend.charge([full])
        decision = await gov.check(ctx)
        assert not decision.admitted and decision.limit == f"cl_user{tag}"
        assert await gov.usage(f"cl_global{tag}") == 1
        assert await gov.usage(f"cl_user{tag}", ctx) == 50
    finally:
        await gov.aclose()


async def test_a_retry_holds_the_shared_counter_only_once_the_others_admitted(
    redis_cluster: RedisClusterService,
) -> None:
    """A check refused by its user's counter while the global one admitted it is tried
    again in two steps, the global (broadest) counter last: its retries never hold the
    global counter, which would refuse other users' checks meanwhile (the burst's
    under-admission). Only the first attempt, all groups at once, charged it."""
    tag = uuid.uuid4().hex[:8]
    (user,) = _users_off_the_global_master(redis_cluster, 1, tag)
    backend = RedisBackend.from_url(redis_cluster.url)
    assert isinstance(backend, ClusterBackend)
    gov = Governor(cluster_policy(tag), backend)
    ctx = Context(user=user)
    keys = _keys(ctx, tag)
    try:
        full = CounterOp(keys["cl_user"], 50, 50, False, int(time.time()) + 3 * 86_400)
        await backend.charge([full])
        sent: list[str] = []
        real = backend._node.charge_with

        async def recorded(c: Any) -> Any:
            sent.extend(op.key for op in c.ops if op.amount > 0)
            return await real(c)

        backend._node.charge_with = recorded  # type: ignore[method-assign]
        decision = await gov.check(ctx)
        assert not decision.admitted and decision.limit == f"cl_user{tag}"
        assert sent.count(keys["cl_global"]) == 1  # the first attempt's, taken back
        # The retry's first step refused with nothing of it held: no further retry.
        assert sent.count(keys["cl_user"]) == 2
        assert await gov.usage(f"cl_global{tag}") == 0
    finally:
        await gov.aclose()


def test_a_cluster_charge_keeps_the_policys_value_caps_and_plans() -> None:
    from mcp_budget_governor.caps import CapRef
    from mcp_budget_governor.projections.counters.cluster import _policy_capped

    op = CounterOp("mcpbg:v1:l:user=a:d1", 1, 100, True, 0)
    by_value = _policy_capped(dataclasses.replace(op, ref=CapRef("k", "user=a", 7)))
    by_plan = dataclasses.replace(
        op, ref=CapRef("k", "user=a", None, ("user=a",), "pro", (("pro", 30), ("free", 5)))
    )
    assert (by_value.cap, by_value.ref) == (7, None)
    assert _policy_capped(by_plan).cap == 30
    assert _policy_capped(op) is op


async def test_a_burst_past_a_nodes_pool_queues_with_every_default(
    redis_cluster: RedisClusterService,
) -> None:
    """Busy is not down (issue 31): 1,500 concurrent checks in one process, every
    setting at its default, hold far more commands than may be in flight. redis-py
    would refuse those at once (MaxConnectionsError); they wait for a slot instead, so
    Redis decides them: none degraded, none "unavailable", the counter equal to the
    admissions, and exactly the cap when none waited past the queue bound.

    Whether a charge waits past the 5 s bound depends on the machine's speed (a full
    run under coverage on two busy cores did), so a refusal as busy is allowed here,
    with its own reason; test_a_charge_past_the_queue_bound_is_refused_as_busy
    covers that refusal."""
    tag = uuid.uuid4().hex[:8]
    gov = Governor(cluster_policy(tag), RedisBackend.from_url(redis_cluster.url))
    try:
        await gov.usage(f"cl_global{tag}")  # connected before the burst
        decisions = await asyncio.gather(
            *(gov.check(Context(user=f"b{i % 40}")) for i in range(1500))
        )
        assert [d for d in decisions if d.degraded] == []
        refusals = collections.Counter((d.status, d.reason) for d in decisions if not d.admitted)
        busy = refusals.pop((503, "budget_unavailable:redis busy"), 0)
        assert {status for status, _ in refusals} <= {429}, refusals  # the caps refused
        admitted = sum(d.admitted for d in decisions)
        assert await gov.usage(f"cl_global{tag}") == admitted
        assert admitted == 80 if busy == 0 else admitted <= 80
    finally:
        await gov.aclose()


async def test_a_charge_past_the_queue_bound_is_refused_as_busy(
    redis_cluster: RedisClusterService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot charge that cannot get one of the in-flight slots within the queue bound
    is refused with 503 "redis busy" and charges nothing; the fail mode is not applied.
    (The bound is shortened and the slots held, so the wait is certain to outlast it.)"""
    tag = uuid.uuid4().hex[:8]
    backend = RedisBackend.from_url(redis_cluster.url)
    assert isinstance(backend, ClusterBackend)
    gov = Governor(cluster_policy(tag), backend)
    try:
        await gov.usage(f"cl_global{tag}")
        monkeypatch.setattr(cluster, "QUEUE_TIMEOUT", 0.2)
        held = [backend._slot() for _ in range(backend._most)]
        for slot in held:
            await slot.__aenter__()
        try:
            decision = await gov.check(Context(user="waits"))
        finally:
            for slot in held:
                await slot.__aexit__(None, None, None)
        assert (decision.admitted, decision.status, decision.degraded) == (False, 503, False)
        assert decision.reason == "budget_unavailable:redis busy"
        assert await gov.usage(f"cl_global{tag}") == 0
        assert (await gov.check(Context(user="waits"))).admitted  # the slots are free again
    finally:
        await gov.aclose()


async def test_a_close_that_outlasts_its_timeout_is_no_error_of_the_caller(
    redis_cluster: RedisClusterService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After such a burst, redis-py closes each of a node's pooled connections within
    socket_connect_timeout; on a loaded machine some outlast it (seen in a full suite
    run). The sockets are being let go either way: shutdown goes on; any other failure
    of the close is still raised."""
    for error, raised in ((redis.exceptions.TimeoutError("slow close"), False),
                          (RuntimeError("a bug"), True)):  # fmt: skip
        backend = RedisBackend.from_url(redis_cluster.url)
        assert isinstance(backend, ClusterBackend)

        async def failing(error: BaseException = error, real: Any = backend.client.aclose) -> None:
            await real()
            raise error

        monkeypatch.setattr(backend.client, "aclose", failing)
        if raised:
            with pytest.raises(RuntimeError, match="a bug"):
                await backend.aclose()
        else:
            await backend.aclose()
