"""The Postgres backend's own done-when tests, on a real server.

- Atomic admission across processes: 4 processes x 125 concurrent checks against
  a cap of 50 admit exactly 50; a per-user 50 and a global 80 admit exactly 80,
  every counter equal to what was admitted.
- Postgres restarted mid-test (a private server started with initdb, never the
  shared one): CLOSED limits answer 503, OPEN limits fall back to the replica's
  counter, enforcement resumes by itself.
- A reply after the timeout: the charge landed, its replay counts nothing.
- ``mcpbg worker --postgres URL`` projects a 100,000-event ledger, every counter
  equal to its ledger sum (slow).
- ``mcpbg migrate`` applies each migration once; bad input is one line.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from mcp_budget_governor import (
    Context,
    FailMode,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    PostgresBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.planning import slot
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.sql import latest
from testing import stream_support as sw
from testing.postgres import PrivatePostgres, scratch_database, start_private_postgres
from testing.services import KafkaService
from testing.stream_support import PARTITIONS
from testing.stream_support import kafka as kafka  # the broker fixture (module scope)
from testing.workers import (
    burst_policy,
    concurrent_checks,
    outage_checks,
    outage_policies,
    user_and_global_checks,
    user_and_global_policy,
)

CLI = (sys.executable, "-m", "mcp_budget_governor.cli")


@pytest.mark.slow
def test_four_processes_125_concurrent_checks_cap_50_admit_exactly_50(postgres_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 4.0  # every process is connected and waiting by then
    with ctx.Pool(4) as pool:
        admitted = pool.starmap(concurrent_checks, [(postgres_url, 50, 125, start_at)] * 4)
    assert sum(admitted) == 50

    async def usage() -> tuple[int, int]:
        gov = Governor(burst_policy(50), PostgresBackend.from_url(postgres_url))
        c = Context(user="shared", tenant="t")
        result = (await gov.usage("burst", c), await gov.usage("daily", c))
        await gov.aclose()
        return result

    # Rejected calls charged nothing: the daily counter saw exactly the admitted 50.
    assert asyncio.run(usage()) == (50, 50)


@pytest.mark.slow
def test_per_user_50_and_global_80_admit_exactly_80(postgres_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 4.0
    users = [f"user-{i}" for i in range(4)]
    with ctx.Pool(4) as pool:
        admitted = pool.starmap(
            user_and_global_checks, [(postgres_url, u, 125, start_at) for u in users]
        )
    assert sum(admitted) == 80
    assert all(a <= 50 for a in admitted)

    async def counters() -> list[int]:
        gov = Governor(user_and_global_policy(50, 80), PostgresBackend.from_url(postgres_url))
        got = [await gov.usage("per_user", Context(user=u)) for u in users]
        got.append(await gov.usage("global"))
        await gov.aclose()
        return got

    # Every counter is what was admitted: per user its own, the global their sum.
    assert asyncio.run(counters()) == [*admitted, 80]


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A server of this test's own (initdb on a free port): it may be killed."""
    try:
        server = start_private_postgres()
    except Exception as exc:  # no initdb/postgres binaries, or no postgres user
        pytest.skip(f"cannot start a private Postgres: {exc}")
    yield server
    server.stop()


RETRY = 0.3


@pytest.fixture
def postgres_100() -> Iterator[PrivatePostgres]:
    """A server of this test's own with Postgres' default max_connections (100)."""
    try:
        server = start_private_postgres(max_connections=100)
    except Exception as exc:  # no initdb/postgres binaries, or no postgres user
        pytest.skip(f"cannot start a private Postgres: {exc}")
    yield server
    server.stop()


@pytest.mark.slow
def test_eight_processes_125_checks_with_defaults_under_max_connections_100_admit_50(
    postgres_100: PrivatePostgres,
) -> None:
    """Eight replicas, every setting at its default (5 connections each), on a server
    allowing 100: exactly 50 admitted, every check decided by Postgres (the helper
    asserts none degraded and none refused as busy)."""
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 6.0
    with ctx.Pool(8) as pool:
        admitted = pool.starmap(concurrent_checks, [(postgres_100.url, 50, 125, start_at)] * 8)
    assert sum(admitted) == 50


@pytest.mark.slow
def test_a_server_stopped_mid_run_closed_refuses_open_falls_back_then_enforcement_resumes(
    postgres_100: PrivatePostgres,
) -> None:
    """Eight replicas x 16 callers checking a fail-open and a fail-closed limit, with
    defaults; Postgres is killed mid-run and started again. While it is down: the
    CLOSED limit answers 503 (degraded), the OPEN one admits from the replica's
    counter. After: enforcement resumes on Postgres in every replica, and each
    admitted fail-open check is counted once (the outage charges were replayed)."""
    url = postgres_100.url
    pctx = multiprocessing.get_context("spawn")
    names = [f"r{i}" for i in range(8)]
    with pctx.Manager() as manager, pctx.Pool(8) as pool:
        ready, go = manager.Queue(), manager.Event()
        runs = pool.starmap_async(outage_checks, [(url, n, ready, go, 16.0) for n in names])
        for _ in names:
            ready.get(timeout=120)  # every replica connected
        go.set()
        kill_at = time.time() + 3.0
        time.sleep(3.0)
        postgres_100.kill()
        back_at = time.time() + 4.0
        time.sleep(4.0)
        postgres_100.start()
        results = runs.get(timeout=120)
    for seen in results:
        before = [s for s in seen if s[0] < kill_at - 0.2]
        assert before and all(s[2] and not s[3] for s in before)  # Postgres decided
        down = [s for s in seen if kill_at + 1.0 < s[0] < back_at - 0.2]
        closed = {(a, d, st) for _, w, a, d, st in down if w == "closed"}
        opened = {(a, d, st) for _, w, a, d, st in down if w == "open"}
        assert closed == {(False, True, 503)}
        assert opened == {(True, True, 200)}
        last = max(s[0] for s in seen)
        after = [s for s in seen if s[0] > last - 2.0]
        assert after and all(s[2] and not s[3] for s in after)  # enforcement resumed

    async def counted() -> list[int]:
        gov = Governor(outage_policies()[0], PostgresBackend.from_url(url))
        got = [await gov.usage("o_user", Context(user=n)) for n in names]
        await gov.aclose()
        return got

    admitted = [sum(1 for s in seen if s[1] == "open" and s[2]) for seen in results]
    assert asyncio.run(counted()) == admitted


def policy() -> Policy:
    """The fault tests' policy (tests/test_faults.py): OPEN per user, CLOSED per tenant."""
    return Policy.of(
        Limit("per_user", cap=5, window=Window.DAY, scope=Scope.USER, fail_mode=FailMode.OPEN),
        Limit(
            "tenant_spend",
            cap=10**9,
            window=Window.DAY,
            scope=Scope.TENANT,
            unit=Unit.USD_MICROS,
            fail_mode=FailMode.CLOSED,
        ),
    )


async def test_postgres_restarted_closed_refuses_open_falls_back_then_recovers(
    private_postgres: PrivatePostgres,
) -> None:
    url = private_postgres.url

    def replica() -> Governor:
        return Governor(policy(), PostgresBackend.from_url(url, timeout=0.5), retry_interval=RETRY)

    a, b = replica(), replica()
    alice, paying = Context(user="alice"), Context(user="bob", tenant="acme")
    assert (await a.check(alice)).admitted
    assert (await a.check(paying)).admitted
    assert (await b.check(Context(user="dave"))).admitted

    private_postgres.kill()

    # A fail-closed limit refuses with 503 within the timeout.
    started = time.monotonic()
    d = await a.check(paying)
    assert (d.admitted, d.status, d.limit, d.degraded) == (False, 503, "tenant_spend", True)
    assert d.retry_after is not None and d.retry_after >= 1
    assert time.monotonic() - started < 3.0

    # Fail-open limits keep enforcing against a per-replica counter: 5 each, not unlimited.
    assert [(await a.check(alice)).admitted for _ in range(7)] == [True] * 5 + [False] * 2
    assert [(await b.check(alice)).admitted for _ in range(7)] == [True] * 5 + [False] * 2

    private_postgres.start()  # the same data folder: the counters survived
    # Enforcement resumes on Postgres without a new governor (its pool reconnects).
    deadline = time.monotonic() + 30.0
    while True:
        await asyncio.sleep(RETRY + 0.1)
        d = await a.check(Context(user="carol"))
        if d.admitted and not d.degraded:
            break
        assert time.monotonic() < deadline, "enforcement did not resume within 30 s"
    # The outage's admitted checks were replayed once: alice's 1 before, 5 from a.
    assert await a.usage("per_user", alice) == 6
    while (d := await b.check(Context(user="carol"))).degraded:
        assert time.monotonic() < deadline
        await asyncio.sleep(RETRY + 0.1)
    assert await b.usage("per_user", alice) == 11
    assert not (await a.check(alice)).admitted
    assert (await a.check(paying)).admitted
    await a.aclose()
    await b.aclose()


async def test_a_reply_after_the_timeout_counts_the_charge_once(postgres_url: str) -> None:
    """The function ran and committed, its reply came after the client's timeout: the
    governor fell back to its fail mode and kept the charge for later, and replaying
    it when Postgres answers in time again changes nothing (operation id)."""
    from test_faults import SlowReplies  # the Redis fault tests' TCP proxy

    alice = Context(user="alice")
    async with SlowReplies(postgres_url) as slow:
        proxied = postgres_url.replace(
            f":{psycopg.conninfo.conninfo_to_dict(postgres_url)['port']}/",
            f":{slow.url.rsplit(':', 1)[1].split('/')[0]}/",
        )
        gov = Governor(
            policy(), PostgresBackend.from_url(proxied, timeout=0.5), retry_interval=RETRY
        )
        direct = PostgresBackend.from_url(postgres_url, timeout=5.0)
        key = planned_key(gov, "per_user", alice)
        assert (await gov.check(alice)).admitted
        assert await direct.usage([key]) == [1]

        slow.delay = 1.5
        d = await gov.check(alice)
        assert d.admitted and d.degraded  # looked unreachable: the fail mode decided
        await asyncio.sleep(1.6)  # the late reply arrives; the charge had landed
        assert await direct.usage([key]) == [2]
        slow.delay = 0.0
        await asyncio.sleep(RETRY + 0.1)
        # The next call flushes the outage buffer: the replayed check changes nothing.
        deadline = time.monotonic() + 30.0
        while (d := await gov.check(alice)).degraded:
            assert time.monotonic() < deadline
            await asyncio.sleep(RETRY + 0.1)
        assert d.admitted
        assert await direct.usage([key]) == [3]
        await gov.aclose()
        await direct.aclose()


def planned_key(gov: Governor, limit: str, ctx: Context) -> str:
    s = slot(gov.policy[limit], ctx, time.time(), gov.policy.tz, 0, enforce=False)
    assert s is not None
    return s.key


def test_mcpbg_migrate_applies_each_migration_once(postgres_server: str) -> None:
    with scratch_database(postgres_server, "mcpbg_migrate") as url:
        first = subprocess.run([*CLI, "migrate", "--postgres", url], capture_output=True, text=True)
        assert first.returncode == 0, first.stderr
        applied = ", ".join(str(v) for v in range(1, latest() + 1))
        assert f"schema version {latest()} (applied: {applied})" in first.stdout
        again = subprocess.run([*CLI, "migrate", "--postgres", url], capture_output=True, text=True)
        assert again.returncode == 0 and "(applied: none needed)" in again.stdout
        with psycopg.connect(url) as conn:
            rows = conn.execute("SELECT version FROM mcpbg_migrations ORDER BY 1").fetchall()
        assert [r[0] for r in rows] == list(range(1, latest() + 1))


def test_mcpbg_migrate_bad_url_is_one_line() -> None:
    run = subprocess.run(
        [*CLI, "migrate", "--postgres", "redis://localhost:6379/0"], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "mcpbg migrate: --postgres: expected postgresql://user@host:port/database "
        "(got 'redis://localhost:6379/0')"
    ]


def test_a_bad_url_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="url: expected postgresql://"):
        PostgresBackend.from_url("mysql://x/y")


async def test_concurrent_checks_over_shared_keys_never_deadlock(postgres_url: str) -> None:
    """Checks over overlapping key sets, in every order of their limits' keys: the
    locks are taken in one fixed order, so none waits on another forever."""
    gov = Governor(burst_policy(10_000), PostgresBackend.from_url(postgres_url))
    rng = random.Random(4)
    ctxs = [Context(user=f"u{rng.randrange(3)}", tenant=f"t{rng.randrange(3)}") for _ in range(300)]
    decisions = await asyncio.gather(*(gov.check(c) for c in ctxs))
    assert all(d.admitted and not d.degraded for d in decisions)
    for t in ("t0", "t1", "t2"):
        want = sum(1 for c in ctxs if c.tenant == t)
        assert await gov.usage("tenant", Context(user="any", tenant=t)) == want
    await gov.aclose()


EVENTS = 100_000


@pytest.mark.slow
async def test_the_worker_projects_a_100000_event_ledger_into_postgres(
    kafka: KafkaService, postgres_url: str, tmp_path: Path
) -> None:
    """``mcpbg worker --postgres URL`` (no Redis anywhere): every counter equals the
    sum of its ledger charges, nothing in flight, no counter the ledger does not explain."""
    topic, group = f"ledger-pg-{uuid.uuid4().hex[:8]}", f"projector-pg-{uuid.uuid4().hex[:8]}"
    ledger = KafkaLedger(
        kafka.bootstrap, topic=topic, partitions=PARTITIONS, outbox_dir=tmp_path / "outbox"
    )
    gov = Governor(sw.policy(), MemoryBackend(), ledger=ledger)
    rng = random.Random(14)
    while ledger.stats.appended < EVENTS:
        await sw.workload(gov, 200, rng)
    assert await ledger.flush(120.0), "the ledger did not ship every event"
    await ledger.aclose()

    env = sw.worker_env(tmp_path)
    env.update(MCPBG_KAFKA_URL=f"kafka://{kafka.bootstrap}", MCPBG_POSTGRES_URL=postgres_url)
    argv = sw.worker_argv(topic, group, "--batch-size", "1000", "--topic-wait", "20")
    worker = sw.Worker("pg", tmp_path / "worker.log", argv, env)
    backend = PostgresBackend.from_url(postgres_url, timeout=10.0)
    try:
        records = await sw.read_ledger(kafka, topic)
        last: dict[int, int] = {}
        for r in records:
            last[r.partition] = max(last.get(r.partition, -1), r.offset)
        deadline = time.monotonic() + 600.0
        while True:
            marks = await backend.watermarks()
            if all(marks.get(f"{topic}:{p}", -1) >= want for p, want in last.items()):
                break
            assert worker.proc.poll() is None, worker.tail()
            assert time.monotonic() < deadline, f"not caught up: {marks}\n{worker.tail()}"
            await asyncio.sleep(0.5)
        assert worker.terminate() == 0
        events = sw.unique_events(records)
        assert len(events) >= EVENTS
        totals = sw.charge_totals(events)
        ends = {c.key: c.expire_at for e in events for c in e.data.charges}
        # No counter the ledger does not explain; each live one is its ledger sum (a
        # minute bucket that ended during the run has expired, as on Redis).
        assert set(await backend.counter_keys(10**7)) <= set(totals)
        live = {k: v for k, v in totals.items() if ends[k] > time.time() + 5}
        assert len(live) >= 30  # the workload's users, tenants and their limits
        for key, total in live.items():
            state = await backend.state(key)
            assert (key, state.committed, state.in_flight, state.pending) == (key, total, 0, {})
    finally:
        worker.kill()
        await backend.aclose()


async def test_rewrite_sets_counters_drops_in_flight_and_refuses_a_moved_projection(
    postgres_url: str,
) -> None:
    """The write half of rebuild and reconcile (lua/rewrite.lua's contract)."""
    from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, CounterOp

    backend = PostgresBackend.from_url(postgres_url, timeout=10.0)
    key, end = "mcpbg:v1:calls:user=u:20990101", int(time.time()) + 3600
    await backend.charge([CounterOp(key, 4, 100, True, end)], event_id="e1")
    await backend.apply("t:0", [AppliedEvent(0, "e0", time.time(), (AppliedCharge(key, 2, end),))])
    assert (await backend.state(key)).pending == {"e1": 4}
    marks = await backend.watermarks()
    assert marks == {"t:0": 0}
    # The projection moved since the caller read it: nothing is written.
    assert await backend.rewrite([(key, 99, 0, ["e1"])], expected={"t:0": 5}) == -1
    assert await backend.rewrite([(key, 10, 0, ["e1"])], expected=marks, marks={"t:0": 7}) == 1
    state = await backend.state(key)
    assert (state.committed, state.in_flight, state.pending) == (10, 0, {})
    assert await backend.watermark("t:0") == 7
    assert await backend.rewrite([(key, 5, 0, [])], add=True) == 1
    assert await backend.usage([key]) == [15]
    await backend.aclose()


async def test_a_lock_queue_is_busy_not_down(postgres_url: str) -> None:
    """A live server that cannot hand out a lock within the check's bound (the default
    2 s) is busy: 503 ``postgres busy``, not the fail mode (the OPEN limit would
    otherwise admit from its local counter), nothing charged, nothing kept for later."""
    gov = Governor(policy(), PostgresBackend.from_url(postgres_url))
    alice = Context(user="alice", tenant="acme")
    assert (await gov.check(alice)).admitted
    holder = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    async with holder, holder.transaction():
        # The store lock, exclusive, as a whole-store rewrite holds it (sql/0003).
        await holder.execute("SELECT pg_advisory_xact_lock(1835233380, 0)")
        decisions = await asyncio.gather(*(gov.check(alice) for _ in range(8)))
    assert {(d.admitted, d.status, d.degraded, d.reason) for d in decisions} == {
        (False, 503, False, "budget_unavailable:postgres busy")
    }
    assert decisions[0].retry_after is not None and decisions[0].retry_after >= 1
    assert not gov.degraded and gov.pending_charges == 0
    assert (await gov.check(alice)).admitted  # the lock is free again
    assert await gov.usage("per_user", alice) == 2
    await gov.aclose()


async def test_checks_queued_in_the_process_past_queue_timeout_are_refused_as_busy(
    postgres_url: str,
) -> None:
    """The in-process queue has its bound too. One connection and a short queue bound
    (non-default, so the queue fills at once and the test is quick; the default is the
    lock test's above): with the only call stuck behind a held lock, the checks queued
    behind it are refused as busy after ``queue_timeout``, never sent, never degraded."""
    backend = PostgresBackend.from_url(postgres_url, max_connections=1, queue_timeout=0.3)
    gov = Governor(policy(), backend)
    alice = Context(user="alice", tenant="acme")
    assert (await gov.check(alice)).admitted
    holder = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    async with holder, holder.transaction():
        await holder.execute("SELECT pg_advisory_xact_lock(1835233380, 0)")
        started = time.monotonic()
        first = asyncio.ensure_future(gov.check(alice))  # sent: waits for the lock
        await asyncio.sleep(0.05)
        queued = await asyncio.gather(*(gov.check(alice) for _ in range(5)))
        waited = time.monotonic() - started
    assert {(d.admitted, d.status, d.degraded) for d in queued} == {(False, 503, False)}
    assert waited < 1.5  # refused at the queue bound, not at the server's 2 s
    d = await first  # sent before: the lock came free within its bound, Postgres decided
    assert (d.admitted, d.degraded) == (True, False)
    assert await gov.usage("per_user", alice) == 2
    await gov.aclose()


async def test_a_server_that_refuses_connections_is_down_not_busy() -> None:
    """Nothing listens on the port: the fail modes decide (CLOSED 503 degraded, OPEN
    admitted from the replica's counter), never a busy refusal."""
    from testing.services import free_port

    url = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    gov = Governor(policy(), PostgresBackend.from_url(url), retry_interval=RETRY)
    d = await gov.check(Context(user="alice", tenant="acme"))
    assert (d.admitted, d.status, d.degraded, d.limit) == (False, 503, True, "tenant_spend")
    d = await gov.check(Context(user="alice"))
    assert (d.admitted, d.degraded) == (True, True)
    await gov.aclose()


async def test_the_startup_log_says_how_many_replicas_the_server_allows(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mcp_budget_governor.projections.counters.postgres")
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(
            "SELECT current_setting('max_connections')::int, "
            "current_setting('superuser_reserved_connections')::int"
        ).fetchone()
    assert row is not None
    backend = PostgresBackend.from_url(postgres_url)
    await backend.migrate()
    await backend.aclose()
    fit = (row[0] - row[1]) // 5
    assert f"max_connections={row[0]} ({row[1]} reserved)" in caplog.text
    assert f"a pool of 5 per replica lets {fit} replicas share it" in caplog.text


async def test_a_batch_whose_first_counter_is_not_written_keeps_expiries_in_step(
    postgres_url: str,
) -> None:
    """A check whose first op charges nothing, and a coalesced call whose first check
    is refused, write each counter with its own expiry (sql/0005 once shifted the
    expiries and the call failed on NOT NULL)."""
    from mcp_budget_governor.counters import CounterOp

    backend = PostgresBackend.from_url(postgres_url)
    end = time.time() + 3600
    tag = uuid.uuid4().hex[:8]
    a, b, c, d = (f"mcpbg:v1:t{tag}:user={u}:1" for u in "abcd")
    assert (
        await backend.charge([CounterOp(a, 0, 10, True, end), CounterOp(b, 1, 10, True, end)])
    ).admitted
    # Three at once: the first goes alone, the other two in one call, the refused first.
    first, refused, admitted = await asyncio.gather(
        backend.charge([CounterOp(c, 1, 10, True, end)]),
        backend.charge([CounterOp(a, 1, 0, True, end)]),
        backend.charge([CounterOp(d, 2, 10, True, end + 60)]),
    )
    assert (first.admitted, refused.admitted, admitted.admitted) == (True, False, True)
    assert await backend.usage([a, b, c, d]) == [0, 1, 1, 2]
    rows = dict(await backend._rows(
        "SELECT key, expire_at FROM mcpbg_counter WHERE key = ANY(%s)", ([b, c, d],)
    ))  # fmt: skip
    assert rows == {b: pytest.approx(end), c: pytest.approx(end), d: pytest.approx(end + 60)}
    await backend.aclose()
