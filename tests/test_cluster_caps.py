"""Caps per customer on Redis Cluster: value caps, plans, run-time caps and grants.

The scenarios of tests/test_customer_caps.py, on the real cluster the fixture
starts. That suite's ``backend`` fixture empties its store per test and uses fixed
limit names; a cluster is never wiped, so here every test has limits (and users
in the plans hash) of its own, named with a fresh tag.
"""

from __future__ import annotations

import asyncio
import json
import runpy
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from mcp_budget_governor import Context, Governor, Limit, Plan, Policy, Scope, Window, planning
from mcp_budget_governor.caps import PLANS_KEY, CapRef, Change, ChangeKind
from mcp_budget_governor.counters import CounterOp
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.events import encode
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.counters.cluster import ClusterBackend, parse_cluster_url
from mcp_budget_governor.stream.projector import Projector
from testing.services import RedisClusterService

REFRESH = 0.5


def policy(tag: str) -> Policy:
    return Policy.of(
        Limit(f"tc{tag}", cap=3, window=Window.DAY, scope=Scope.TENANT, caps={"acme": 5}),
        Limit(f"burst{tag}", cap=100, window=Window.DAY, scope=Scope.USER),
        Limit(
            f"tool{tag}",
            cap=10,
            window=Window.DAY,
            scope=(Scope.USER, Scope.TOOL),
            caps={"user=u_1,tool=search": 2},
        ),
        Limit(f"all{tag}", cap=1000, window=Window.DAY),
        plans=[Plan("pro", caps={f"burst{tag}": 4}), Plan("team", caps={f"burst{tag}": 6})],
        assignments={f"user=u_pro{tag}": "pro"},
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


async def test_policy_value_caps_and_plans_on_the_cluster(
    cluster: ClusterBackend, tag: str
) -> None:
    gov = Governor(policy(tag), cluster)
    assert await admitted(gov, Context(tenant="acme", user=f"a{tag}"), 9) == 5  # its value cap
    assert await admitted(gov, Context(tenant="beta", user=f"b{tag}"), 9) == 3  # the default
    assert await admitted(gov, Context(user=f"u_pro{tag}"), 9) == 4  # the policy's plan
    assert await admitted(gov, Context(user="u_1", tool="search"), 9) == 2  # composite value cap
    assert await gov.usage(f"all{tag}") == 14


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


async def test_a_plan_assignment_moves_the_caps(cluster: ClusterBackend, tag: str) -> None:
    gov = Governor(policy(tag), cluster)
    assert await admitted(gov, Context(user=f"u7{tag}"), 3) == 3  # default 100
    await gov.assign_plan("pro", user=f"u7{tag}")
    assert await admitted(gov, Context(user=f"u7{tag}"), 3) == 1  # pro: 4, 3 spent
    await gov.assign_plan("team", user=f"u_pro{tag}")  # the run-time assignment wins
    assert await admitted(gov, Context(user=f"u_pro{tag}"), 9) == 6
    await gov.assign_plan(None, user=f"u_pro{tag}")  # back to the policy's: pro
    assert await admitted(gov, Context(user=f"u_pro{tag}"), 1) == 0
    assert await admitted(gov, Context(user=f"u8{tag}"), 5) == 5  # nobody else moved


async def test_a_grant_adds_room_at_once_and_is_no_spend(cluster: ClusterBackend, tag: str) -> None:
    gov = Governor(policy(tag), cluster)
    beta = Context(tenant="beta", user=f"b{tag}")
    assert await admitted(gov, beta, 5) == 3
    await gov.grant(f"tc{tag}", 2, tenant="beta", reason="goodwill")
    assert await admitted(gov, beta, 5) == 2
    assert await gov.usage(f"tc{tag}", beta) == 5  # a grant is no refund
    await gov.reset(f"tc{tag}", tenant="beta", reason="support")
    assert await admitted(gov, beta, 9) == 3  # the room is the cap again
    row = (await gov.status(beta))[f"tc{tag}"]  # cap 3 + the reset's grant 5
    assert (row["total"], row["cap"], row["exceeded"]) == (8, 8, True)
    assert (await gov.status(Context(tenant="acme")))[f"tc{tag}"]["cap"] == 5


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


async def test_ledger_changes_projected_into_the_cluster_reach_every_replica(
    redis_cluster: RedisClusterService, cluster: ClusterBackend, tag: str
) -> None:
    other = ClusterBackend.from_url(redis_cluster.url, timeout=5.0, caps_refresh=REFRESH)
    ledger = MemoryLedger()
    one = Governor(policy(tag), cluster, ledger=ledger)
    two = Governor(policy(tag), other, ledger=ledger)
    beta = Context(tenant="beta", user=f"b{tag}")
    projector = Projector(cluster, f"caps.{tag}", dlq=lambda letter: None)  # type: ignore[arg-type]
    offset = 0

    async def project() -> None:
        nonlocal offset
        records = [(i, encode(e, "/t")) for i, e in enumerate(ledger.entries)][offset:]
        if records:
            await projector.apply_batch(0, records)
        offset = len(ledger.entries)

    try:
        await project()
        assert await admitted(one, beta, 5) + await admitted(two, beta, 5) == 3
        await project()
        await one.set_cap(f"tc{tag}", 5, tenant="beta", actor="ops", reason="trial")
        await one.grant(f"tc{tag}", 1, tenant="beta", reason="goodwill")
        await project()  # one step, then at most REFRESH: both replicas enforce 5 + 1
        await asyncio.sleep(REFRESH)
        assert await admitted(two, beta, 2) + await admitted(one, beta, 2) == 3
        await project()
        again = [(i, encode(e, "/t")) for i, e in enumerate(ledger.entries)]
        await projector.apply_batch(0, again)  # a redelivery changes nothing
        assert await admitted(one, beta, 1) + await admitted(two, beta, 1) == 0
        (granted,) = [e.change for e in ledger.entries if e.change and e.change.kind == "granted"]
        assert (await cluster.state(granted.key)).grant == 1
    finally:
        await other.aclose()


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


def _golden_caps() -> list[dict[str, Any]]:
    path = Path(__file__).parent / "golden" / "vectors.json"
    cases: list[dict[str, Any]] = json.loads(path.read_text())["caps"]
    return cases


@pytest.mark.parametrize("case", _golden_caps(), ids=lambda c: str(c["source"]))
async def test_the_cluster_resolves_caps_as_the_golden_vectors(
    cluster: ClusterBackend, tag: str, case: dict[str, Any]
) -> None:
    """The client-side rule plus the script's grant (flag 'g') against caps.resolve:
    tests/test_customer_caps.py's golden test, with names of this test's own."""
    golden = runpy.run_path(str(Path(__file__).parent / "golden" / "generate.py"))
    now = time.time()
    limit, field = f"t{tag}", f"tenant=acme{tag},user=u42{tag}"
    caps_hash = f"mcpbg:v1:_caps:{limit}"
    key = f"mcpbg:v1:{limit}:{field}:20991231"
    user, tenant = f"user=u42{tag}", f"tenant=acme{tag}"
    tagged = {"user=u_42": user, "tenant=acme": tenant}
    expire = int(now) + 86_400
    changes = []
    runtime = case["runtime"]
    if runtime is not None:
        until = int(now) + runtime[1] if runtime[1] else 0
        changes.append(Change(ChangeKind.CAP_SET, limit, caps_hash, field, runtime[0], until))
    for f, plan in case["assigned"].items():
        changes.append(Change(ChangeKind.PLAN_ASSIGNED, limit, PLANS_KEY, tagged[f], plan=plan))
    if case["grant"]:
        changes.append(Change(ChangeKind.GRANTED, limit, key, "", int(case["grant"]), expire))
    await cluster.change(changes)
    ref = CapRef(
        caps_hash,
        field,
        case["value_cap"],
        (user, tenant),
        case["file_plan"],
        tuple((str(n), int(c)) for n, c in golden["CAP_PLANS"]),
    )
    result = await cluster.charge([CounterOp(key, 0, golden["CAP_DEFAULT"], True, expire, ref)])
    assert result.caps == (case["room"],)


async def test_is_tripped_and_the_fail_open_fallback_read_the_effective_caps(
    cluster: ClusterBackend, tag: str
) -> None:
    from mcp_budget_governor import FailMode
    from mcp_budget_governor.errors import BackendUnavailableError

    gov = Governor(policy(tag), cluster)
    acme, beta = Context(tenant="acme"), Context(tenant="beta")
    await gov.set_cap(f"tc{tag}", 6, tenant="beta")
    await gov.grant(f"tc{tag}", 2, tenant="beta")
    assert await admitted(gov, beta, 9) == 8
    assert await gov.is_tripped(f"tc{tag}", beta)
    assert await admitted(gov, acme, 4) == 4
    assert not await gov.is_tripped(f"tc{tag}", acme)  # 4 of its 5

    class Outage:
        """The cluster, switchable to unreachable."""

        down = False

        def __getattr__(self, name: str) -> Any:
            attr = getattr(cluster, name)
            if not callable(attr):
                return attr

            async def call(*args: Any, **kwargs: Any) -> Any:
                if self.down:
                    raise BackendUnavailableError("switched off")
                return await attr(*args, **kwargs)

            return call

    pol = Policy.of(
        Limit(f"open{tag}", cap=2, window=Window.DAY, scope=Scope.TENANT, fail_mode=FailMode.OPEN)
    )
    outage = Outage()
    fallback = Governor(pol, outage, retry_interval=3600)  # type: ignore[arg-type]
    await fallback.set_cap(f"open{tag}", 4, tenant="beta")
    assert (await fallback.check(beta)).admitted  # the effective cap (4) seen once
    outage.down = True
    assert await admitted(fallback, beta, 6) == 4  # the fallback counts against 4, not 2
