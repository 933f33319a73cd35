"""Redis killed mid-run: fail modes apply, then enforcement recovers by itself.
Redis answering after the timeout: the charge had landed, its replay counts nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from urllib.parse import urlsplit

import pytest
import redis

from mcp_budget_governor import (
    MAX_AMOUNT,
    Context,
    CounterOverflowError,
    FailMode,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.planning import slot
from testing.services import RedisService

RETRY = 0.3


def policy() -> Policy:
    return Policy.of(
        Limit("per_user", cap=5, window=Window.DAY, scope=Scope.USER, fail_mode=FailMode.OPEN),
        Limit(
            "unguarded",
            cap=1000,
            window=Window.DAY,
            scope=Scope.USER,
            fail_mode=FailMode.OPEN,
            local_fallback=False,
        ),
        Limit(
            "tenant_spend",
            cap=10**9,
            window=Window.DAY,
            scope=Scope.TENANT,
            unit=Unit.USD_MICROS,
            fail_mode=FailMode.CLOSED,
        ),
    )


def replica(url: str) -> Governor:
    return Governor(policy(), RedisBackend.from_url(url, timeout=0.25), retry_interval=RETRY)


async def test_closed_refuses_open_enforces_per_replica_then_recovers(
    own_redis: RedisService,
) -> None:
    a, b = replica(own_redis.url), replica(own_redis.url)
    alice, paying = Context(user="alice"), Context(user="bob", tenant="acme")
    assert (await a.check(alice)).admitted
    assert (await a.check(paying)).admitted

    own_redis.kill()

    # A fail-closed limit refuses with 503 within the timeout.
    started = time.monotonic()
    d = await a.check(paying)
    assert (d.admitted, d.status, d.limit, d.degraded) == (False, 503, "tenant_spend", True)
    assert d.retry_after is not None and d.retry_after >= 1
    assert time.monotonic() - started < 2.0

    # Fail-open limits keep enforcing against a per-replica counter: 5 each, not unlimited.
    admitted_a = [(await a.check(alice)).admitted for _ in range(8)]
    admitted_b = [(await b.check(alice)).admitted for _ in range(8)]
    assert admitted_a == [True] * 5 + [False] * 3
    assert admitted_b == [True] * 5 + [False] * 3
    refusal = await a.check(alice)
    assert (refusal.status, refusal.limit, refusal.degraded) == (429, "per_user", True)

    own_redis.restart()
    await asyncio.sleep(RETRY + 0.1)

    # Enforcement resumes on Redis without a new governor, and the charges
    # made during the outage were replayed into the (empty) restarted Redis.
    d = await a.check(Context(user="carol"))
    assert d.admitted and not d.degraded
    assert await a.usage("per_user", alice) == 5
    assert (await b.check(Context(user="carol"))).admitted
    assert await b.usage("per_user", alice) == 10
    assert not (await a.check(alice)).admitted
    assert (await a.check(paying)).admitted
    await a.aclose()
    await b.aclose()


async def test_meter_during_outage_is_kept_and_replayed(own_redis: RedisService) -> None:
    gov = replica(own_redis.url)
    acme = Context(user="u", tenant="acme")
    await gov.meter("tenant_spend", 100, acme)
    own_redis.kill()
    own_redis.restart()  # comes back empty
    own_redis.kill()
    got = await gov.meter("tenant_spend", 250, acme)
    assert got.charged == 250  # a completed call is always charged
    own_redis.restart()
    await asyncio.sleep(RETRY + 0.1)
    assert await gov.usage("tenant_spend", acme) == 250
    await gov.aclose()


async def test_timeout_bounds_a_hung_redis(own_redis: RedisService) -> None:
    import os
    import signal

    gov = replica(own_redis.url)
    paying = Context(user="bob", tenant="acme")
    assert (await gov.check(paying)).admitted
    assert own_redis.pid is not None
    os.kill(own_redis.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        d = await gov.check(paying)
        elapsed = time.monotonic() - started
        assert (d.admitted, d.status) == (False, 503)
        assert elapsed < 1.5
        # While marked down, further checks do not wait on Redis at all.
        started = time.monotonic()
        assert (await gov.check(paying)).status == 503
        assert time.monotonic() - started < 0.2
    finally:
        os.kill(own_redis.pid, signal.SIGCONT)
    await asyncio.sleep(RETRY + 0.1)
    assert (await gov.check(paying)).admitted
    await gov.aclose()


class SlowReplies:
    """A TCP proxy on loopback in front of Redis that holds each reply back ``delay``
    seconds: commands reach Redis and run at once, their answers come too late."""

    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.delay = 0.0
        self.url = ""
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> SlowReplies:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._links:
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        link = asyncio.gather(
            self._pipe(reader, up_writer, delayed=False),
            self._pipe(up_reader, writer, delayed=True),
        )
        task = asyncio.ensure_future(link)
        self._links.add(task)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        try:
            while data := await src.read(65536):
                if delayed and self.delay:
                    await asyncio.sleep(self.delay)
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.close()


def usage_in(url: str, key: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        c, f = client.hmget(key, "c", "f")
        return int(c or 0) + int(f or 0)
    finally:
        client.close()


async def test_a_reply_after_the_timeout_counts_the_charge_once(redis_url: str) -> None:
    """The script ran, its reply came after the client's timeout: the client retried
    it once, the governor fell back to its fail mode and kept the charge for later,
    and replaying it when Redis answers again changes nothing (operation id)."""
    alice, acme = Context(user="alice"), Context(user="alice", tenant="acme")
    async with SlowReplies(redis_url) as slow:
        gov = Governor(
            policy(), RedisBackend.from_url(slow.url, timeout=0.25), retry_interval=RETRY
        )
        assert (await gov.check(alice)).admitted
        assert (await gov.meter("tenant_spend", 100, acme)).charged == 100
        key = planned_key(gov, "per_user", alice)
        spend_key = planned_key(gov, "tenant_spend", acme)
        assert usage_in(redis_url, key) == 1

        slow.delay = 1.0
        d = await gov.check(alice)
        assert d.admitted and d.degraded  # looked unreachable: the fail mode decided
        slow.delay = 0.0
        await asyncio.sleep(RETRY + 0.1)
        assert (
            await gov.meter("tenant_spend", 250, acme)
        ).charged == 250  # degraded: kept, replayed
        # The late script did land (the timed-out send and redis-py's one retry, under
        # the same operation id): counted once in Redis before any replay.
        assert usage_in(redis_url, key) == 2

        # The next call flushes the outage buffer: the replayed check changes nothing.
        assert (await gov.check(alice)).admitted
        assert await gov.usage("per_user", alice) == 3
        assert usage_in(redis_url, key) == 3
        assert await gov.usage("tenant_spend", acme) == 350
        assert usage_in(redis_url, spend_key) == 350
        await gov.aclose()


async def test_a_late_metered_charge_counts_once(redis_url: str) -> None:
    """The same for meter(): the charge landed, its reply was late, its replay is a no-op."""
    acme = Context(user="u", tenant="acme")
    async with SlowReplies(redis_url) as slow:
        gov = Governor(
            policy(), RedisBackend.from_url(slow.url, timeout=0.25), retry_interval=RETRY
        )
        assert (await gov.meter("tenant_spend", 100, acme)).charged == 100
        slow.delay = 1.0
        assert (await gov.meter("tenant_spend", 40, acme)).charged == 40
        slow.delay = 0.0
        await asyncio.sleep(RETRY + 0.1)
        assert await gov.usage("tenant_spend", acme) == 140  # flushed first: once
        assert usage_in(redis_url, planned_key(gov, "tenant_spend", acme)) == 140
        await gov.aclose()


def planned_key(gov: Governor, limit: str, ctx: Context) -> str:
    s = slot(gov.policy[limit], ctx, time.time(), gov.policy.tz, 0, enforce=False)
    assert s is not None
    return s.key


async def test_an_outage_charge_past_the_exact_range_is_dropped_not_stuck(
    own_redis: RedisService, caplog: pytest.LogCaptureFixture
) -> None:
    """A replayed charge refused as out of the exact range is logged and dropped:
    the charges buffered after it are still replayed."""
    import os
    import signal

    gov = replica(own_redis.url)
    acme = Context(user="u", tenant="acme")
    await gov.meter("tenant_spend", MAX_AMOUNT, acme)
    assert own_redis.pid is not None
    os.kill(own_redis.pid, signal.SIGSTOP)  # hung: sends time out, Redis keeps its data
    try:
        assert (await gov.meter("tenant_spend", 5, acme)).charged == 5
        assert (await gov.meter("per_user", 2, acme)).charged == 2
    finally:
        os.kill(own_redis.pid, signal.SIGCONT)
    await asyncio.sleep(RETRY + 0.1)
    assert await gov.usage("per_user", acme) == 2
    assert await gov.usage("tenant_spend", acme) == MAX_AMOUNT
    assert "outage charge dropped" in caplog.text and "'tenant_spend'" in caplog.text
    with pytest.raises(CounterOverflowError) as info:
        await gov.meter("tenant_spend", 1, acme)
    assert (info.value.limit, info.value.amount) == ("tenant_spend", 1)
    await gov.aclose()


async def test_a_full_connection_pool_is_busy_not_down(redis_url: str) -> None:
    """Busy is not down on Redis too. Only the pool path (``coalesce=False``, one
    connection: non-default on purpose, the coalesced default has no pool queue) can
    wait for a connection; past the wait the check is refused as busy, 503, with no
    fail mode (the OPEN limit would otherwise admit from the replica's counter)."""
    backend = RedisBackend.from_url(redis_url, coalesce=False, max_connections=1)
    gov = Governor(policy(), backend, retry_interval=RETRY)
    alice = Context(user=f"busy-{time.time_ns()}", tenant="acme")
    assert (await gov.check(alice)).admitted
    held = await backend.client.connection_pool.get_connection()  # the only connection
    try:
        d = await gov.check(alice)
    finally:
        await backend.client.connection_pool.release(held)
    assert (d.admitted, d.status, d.degraded, d.reason) == (
        False, 503, False, "budget_unavailable:redis busy",
    )  # fmt: skip
    assert not gov.degraded
    assert (await gov.check(alice)).admitted
    assert await gov.usage("per_user", alice) == 2
    await gov.aclose()
