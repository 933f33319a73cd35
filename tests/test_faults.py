"""Redis killed mid-run: fail modes apply, then enforcement recovers by itself."""

from __future__ import annotations

import asyncio
import time

from services import RedisService

from mcp_budget_governor import (
    Context,
    FailMode,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
)

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
