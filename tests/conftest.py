"""Shared fixtures: a real Redis for the whole run, and one suite over both backends.

Redis is found or started by ``testing.services.start_redis`` (environment URL, then
Docker, then a local binary on a free port). Tests that kill Redis start their
own private server with ``own_redis``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from mcp_budget_governor import Backend, MemoryBackend, RedisBackend
from testing.services import RedisClusterService, RedisService, start_redis, start_redis_cluster


@pytest.fixture(scope="session")
def redis_service() -> Iterator[RedisService]:
    service = start_redis()
    yield service
    service.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterService]:
    """A real Redis Cluster (3 masters, 3 replicas), started once per session."""
    service = start_redis_cluster()
    yield service
    service.stop()


@pytest.fixture
def redis_url(redis_service: RedisService) -> str:
    client = redis.Redis.from_url(redis_service.url)
    client.flushdb()
    client.close()
    return redis_service.url


@pytest.fixture
def own_redis() -> Iterator[RedisService]:
    """A private local Redis the test may kill and restart."""
    service = start_redis(prefer_local=True)
    yield service
    service.stop()


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each test using this runs once per backend: the suite enforces their equivalence."""
    if request.param == "memory":
        yield MemoryBackend()
        return
    url = request.getfixturevalue("redis_url")
    b = RedisBackend.from_url(url, timeout=2.0)
    yield b
    await b.aclose()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def run(coro: object) -> object:
    """Run a coroutine from sync code (subprocess workers)."""
    return asyncio.run(coro)  # type: ignore[arg-type]
