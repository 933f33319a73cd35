"""Shared fixtures: a real Redis and a real Postgres for the whole run, one suite over
every backend.

Redis is found or started by ``testing.services.start_redis`` (environment URL, then
Docker, then a local binary on a free port). Tests that kill Redis start their
own private server with ``own_redis``. Postgres is found by
``testing.postgres.find_postgres`` (environment URL, Docker, the local server on
127.0.0.1:5432, else initdb from the PATH); the run gets a database of its own,
dropped at the end, and each test starts from empty tables.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from mcp_budget_governor import Backend, MemoryBackend, PostgresBackend, RedisBackend
from mcp_budget_governor.projections.counters.cluster import ClusterBackend
from testing.postgres import find_postgres, scratch_database, truncate_all
from testing.services import RedisClusterService, RedisService, start_redis, start_redis_cluster


@pytest.fixture(scope="session")
def redis_service() -> Iterator[RedisService]:
    """The run's Redis, its database claimed for the run (``RedisService.claimed``): one
    the run started is flushed; an external one (``MCPBG_TEST_REDIS_URL``) must be empty,
    else the run stops before it deletes anything. It is left empty at the end."""
    service = start_redis()
    with service.claimed():
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
    """The run's Redis database, flushed for this test: it is the run's, since
    ``redis_service`` claimed it (an external one only if it found it empty)."""
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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A Postgres server URL for the whole run (never one we did not start is stopped)."""
    with find_postgres() as url:
        yield url


@pytest.fixture(scope="session")
def postgres_database(postgres_server: str) -> Iterator[str]:
    """This run's own database, dropped at the end."""
    with scratch_database(postgres_server) as url:
        yield url


@pytest.fixture
def postgres_url(postgres_database: str) -> str:
    """The run's database, its mcpbg tables emptied for this test."""
    truncate_all(postgres_database)
    return postgres_database


@pytest.fixture(params=["redis", "postgres"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The URL of a shared store (Redis, then Postgres): the operator commands' suites
    (replay, reconcile) run once per store; ``testing/stores.py`` reads and tampers."""
    name = "redis_url" if request.param == "redis" else "postgres_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture(params=["memory", "redis", "postgres"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each test using this runs once per backend: the suite enforces their equivalence.

    ``"cluster"`` is a fourth kind, for suites that name their limits and customers
    per test (the session's cluster is never wiped): they ask for it with
    ``@pytest.mark.parametrize("backend", [..., "cluster"], indirect=True)``. Its
    run-time entries are re-read on every check (``caps_refresh=0``), as the other
    backends read them; the refresh bound is tests/test_cluster_caps.py's.
    """
    if request.param == "memory":
        yield MemoryBackend()
        return
    if request.param == "postgres":
        pg = PostgresBackend.from_url(request.getfixturevalue("postgres_url"), timeout=5.0)
        await pg.migrate()  # connected and migrated: a test's first call is an ordinary one
        yield pg
        await pg.aclose()
        return
    if request.param == "cluster":
        service: RedisClusterService = request.getfixturevalue("redis_cluster")
        cluster = ClusterBackend.from_url(service.url, timeout=5.0, caps_refresh=0)
        yield cluster
        await cluster.aclose()
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
