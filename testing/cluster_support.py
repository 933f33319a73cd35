"""What the Redis Cluster tests share: a cluster of the test's own, which master owns
a key, a tagged workload, and a stream-worker set-up projecting into the cluster.

A plain module (like ``stream_support.py``): test files import the fixtures and
helpers they use, by name, e.g.::

    from testing.cluster_support import cluster_stream, own_cluster, victim_of

    async def test_x(own_cluster, cluster_stream):
        cluster_stream.start_worker()
        victim = victim_of(own_cluster, keys)
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Unit, Window, usd
from mcp_budget_governor.keys import WATERMARK_KEY
from mcp_budget_governor.projections.counters.cluster import ClusterBackend
from testing.services import (
    KafkaService,
    RedisClusterService,
    RedisUnavailable,
    start_local_redis_cluster,
)
from testing.stream_support import TENANTS, Names, Stream, Worker


@pytest.fixture
def own_cluster() -> Iterator[RedisClusterService]:
    """A cluster of this test's own: it flushes or kills one of its masters."""
    try:
        service = start_local_redis_cluster()
    except RedisUnavailable as exc:
        pytest.skip(str(exc))
    yield service
    service.stop()


@pytest.fixture
async def cluster_stream(
    own_cluster: RedisClusterService,
    kafka: KafkaService,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
) -> AsyncIterator[Stream]:
    """The stream fixtures on ``own_cluster``: its backend marked ready (an intact
    projection, the live path), closed after the test."""
    backend = ClusterBackend.from_url(own_cluster.url, timeout=5.0)
    await backend.mark_ready("test")
    try:
        yield Stream(kafka, own_cluster.url, backend, names, workers, tmp_path)
    finally:
        await backend.aclose()


def slots_of(service: RedisClusterService) -> dict[int, set[int]]:
    """master port -> the slots it serves."""
    out: dict[int, set[int]] = {}
    for start, end, master, *_ in redis.Redis(port=service.masters()[0]).execute_command(
        "CLUSTER SLOTS"
    ):
        out.setdefault(int(master[1]), set()).update(range(start, end + 1))
    return out


def owner(service: RedisClusterService, key: str) -> int:
    """The port of the master serving ``key``'s slot."""
    slot = key_slot(key.encode())
    for port, slots in slots_of(service).items():
        if slot in slots:
            return port
    raise AssertionError(f"slot {slot} unserved")


def victim_of(service: RedisClusterService, keys: Iterable[str]) -> int:
    """A master holding some of ``keys``, not the resume watermark's (whose loss
    would move every partition's resume point)."""
    resume = owner(service, WATERMARK_KEY)
    return next(m for m in sorted({owner(service, k) for k in keys}) if m != resume)


def new_tag() -> str:
    return "cs" + uuid.uuid4().hex[:8]


def tagged_policy(tag: str) -> Policy:
    """Counters of this test only (the tag), spread over the cluster's slots."""
    return Policy.of(
        Limit(f"{tag}_daily", cap=10_000, window=Window.DAY, scope=Scope.USER),
        Limit(f"{tag}_calls", cap=100_000, window=Window.DAY, scope=Scope.TENANT),
        Limit(
            f"{tag}_spend",
            cap=usd(1000),
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
    )


async def tagged_workload(gov: Governor, tag: str, n: int, rng: random.Random) -> None:
    """``n`` checks, priced admissions (the price charged with the admission, two
    events whose counters may lie on different slots) and meters of
    :func:`tagged_policy`'s limits."""
    for _ in range(n):
        ctx = Context(user=f"u{rng.randrange(12)}", tenant=rng.choice(TENANTS))
        draw = rng.random()
        if draw < 0.45:
            await gov.check(ctx)
        elif draw < 0.65:
            async with gov.admitted(ctx, price={f"{tag}_spend": rng.randrange(1, 40_000)}):
                pass
        else:
            await gov.meter(f"{tag}_spend", rng.randrange(1, 40_000), ctx)
