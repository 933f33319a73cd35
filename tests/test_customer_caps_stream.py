"""Caps per customer through the real pipeline: two governors appending to Kafka, the
stream worker projecting, FLUSHALL + rebuild and ``mcpbg replay``, ``mcpbg reconcile``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis as redis_sync

from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window
from mcp_budget_governor.caps import PLANS_KEY, caps_key
from mcp_budget_governor.cli import main
from mcp_budget_governor.keys import EPOCH_KEY
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from testing.stream_support import (
    PARTITIONS,
    Stream,
    backend,
    engine,
    kafka,
    names,
    stream,
    workers,
)

__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name

RULES = Policy.of(
    Limit("tenant_calls", cap=3, window=Window.DAY, scope=Scope.TENANT, caps={"acme": 5}),
)


def _state(url: str) -> tuple[dict[bytes, bytes], dict[bytes, bytes], list[bytes | None]]:
    """The run-time caps, the assignments and every tenant_calls counter's grant."""
    client = redis_sync.Redis.from_url(url)
    keys = sorted(client.scan_iter(match="mcpbg:v1:tenant_calls:tenant=[ab][ce][mt][ea]:*"))
    out = (
        client.hgetall(caps_key("tenant_calls")),
        client.hgetall(PLANS_KEY),
        [client.hget(k, "g") for k in keys],
    )
    client.close()
    return out


async def _admitted(govs: list[Governor], ctx: Context, each: int) -> int:
    return sum([(await g.check(ctx)).admitted for g in govs for _ in range(each)])


@pytest.mark.slow
async def test_caps_and_grants_through_the_worker_survive_rebuild_and_replay(
    stream: Stream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tmp_path / "archive"
    worker = stream.start_worker("--archive-dir", str(archive))
    ledgers = [
        KafkaLedger(
            stream.kafka.bootstrap,
            topic=stream.topic,
            partitions=PARTITIONS,
            outbox_dir=tmp_path / f"outbox-{i}",
        )
        for i in range(2)
    ]
    govs = [Governor(RULES, stream.backend, ledger=ledger) for ledger in ledgers]
    acme, beta = Context(tenant="acme"), Context(tenant="beta")
    # Two replicas, one Redis: each tenant gets exactly its own cap.
    assert await _admitted(govs, acme, 4) == 5
    assert await _admitted(govs, beta, 4) == 3
    await govs[0].set_cap("tenant_calls", 4, tenant="beta", reason="upgrade", actor="ops")
    await govs[1].grant("tenant_calls", 1, tenant="beta", reason="goodwill", actor="ops")
    for ledger in ledgers:
        assert await ledger.flush(30)
    await stream.caught_up()  # one projection step: every replica enforces both
    assert await _admitted(govs, beta, 3) == 2  # 4 + 1 - 3
    for ledger in ledgers:
        assert await ledger.flush(30)
    await stream.caught_up()
    live = _state(stream.redis_url)
    assert live[0] and live[2] == [None, b"1"]  # acme has no grant, beta one

    # FLUSHALL: the worker rebuilds the caps and the grant from the ledger, once its
    # next batch finds the epoch marker gone.
    sync = redis_sync.Redis.from_url(stream.redis_url)
    sync.flushall()
    await govs[0].check(Context(tenant="zeta"))
    assert await ledgers[0].flush(30)
    await stream.wait_for(lambda: sync.exists(EPOCH_KEY), "rebuild after FLUSHALL", 60)
    await stream.caught_up()
    assert _state(stream.redis_url) == live
    assert await _admitted(govs, beta, 2) == 0
    for ledger in ledgers:
        assert await ledger.flush(30)
    await stream.caught_up()
    assert worker.terminate() == 0

    # `mcpbg replay --source kafka` restores them too.
    sync.flushall()
    argv = ["replay", "--source", "kafka", "--kafka-url", f"kafka://{stream.kafka.bootstrap}"]
    argv += ["--topic", stream.topic, "--all", "--redis-url", stream.redis_url]
    code = await asyncio.to_thread(main, argv)
    assert code == 0, capsys.readouterr()
    assert _state(stream.redis_url) == live

    # The counters equal the ledger: grants are room, not spend, so no drift.
    capsys.readouterr()
    code = await asyncio.to_thread(
        main, ["reconcile", "--archive-dir", str(archive), "--redis-url", stream.redis_url]
    )
    out = capsys.readouterr().out
    assert code == 0 and "no drift" in out, out
    for ledger in ledgers:
        await ledger.aclose()
