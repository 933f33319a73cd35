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
    sync.flushdb()  # the test's db only (FLUSHALL would empty a shared server)
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
    sync.flushdb()
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


GOVERNOR_PROCESS = """
import asyncio, json, sys
from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Window
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger

async def main():
    redis_url, bootstrap, topic, partitions, outbox = sys.argv[1:6]
    rules = Policy.of(
        Limit("tenant_calls", cap=3, window=Window.DAY, scope=Scope.TENANT, caps={"acme": 5}),
    )
    ledger = KafkaLedger(bootstrap, topic=topic, partitions=int(partitions), outbox_dir=outbox)
    gov = Governor(rules, RedisBackend.from_url(redis_url, timeout=5.0), ledger=ledger)
    loop = asyncio.get_running_loop()
    print(json.dumps("ready"), flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        ctx = Context(tenant=cmd.get("tenant"))
        if cmd["op"] == "check":
            out = sum([(await gov.check(ctx)).admitted for _ in range(cmd["n"])])
        elif cmd["op"] == "set_cap":
            out = (await gov.set_cap("tenant_calls", cmd["cap"], tenant=cmd["tenant"],
                                     reason="upgrade", actor="ops")).amount
        elif cmd["op"] == "grant":
            out = (await gov.grant("tenant_calls", cmd["amount"], tenant=cmd["tenant"],
                                   reason="goodwill", actor="ops")).amount
        else:
            out = await ledger.flush(30)
        print(json.dumps(out), flush=True)
    await gov.aclose()

asyncio.run(main())
"""


class GovernorProcess:
    """A governor in its own process, appending to the topic, driven line by line."""

    def __init__(self, stream: Stream, outbox: Path) -> None:
        import subprocess
        import sys

        argv = [sys.executable, "-c", GOVERNOR_PROCESS, stream.redis_url, stream.kafka.bootstrap]
        argv += [stream.topic, str(PARTITIONS), str(outbox)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, **cmd: object) -> None:
        import json

        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    async def answer(self) -> object:
        import json

        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        assert line, f"governor process exited ({self.proc.poll()})"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


async def _both(procs: list[GovernorProcess], **cmd: object) -> list[object]:
    """The same command to every process at once (they race), then their answers."""
    for p in procs:
        p.send(**cmd)
    return [await p.answer() for p in procs]


@pytest.mark.slow
async def test_two_tenants_through_the_worker_with_two_governor_processes(
    stream: Stream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 11's Done-when through the real pipeline: two governor processes, one
    Redis, the stream worker projecting; caps and grants made at run time reach both
    within one projection step, and `mcpbg replay` (its default source, the archive)
    restores them after FLUSHALL with no drift for `mcpbg reconcile`."""
    archive = tmp_path / "archive"
    worker = stream.start_worker("--archive-dir", str(archive))
    procs = [GovernorProcess(stream, tmp_path / f"outbox-{i}") for i in range(2)]
    try:
        assert [await p.answer() for p in procs] == ["ready", "ready"]
        # Racing from two processes, each tenant gets exactly its own cap.
        assert sum(await _both(procs, op="check", tenant="acme", n=4)) == 5  # type: ignore[arg-type]
        assert sum(await _both(procs, op="check", tenant="beta", n=4)) == 3  # type: ignore[arg-type]
        procs[0].send(op="set_cap", tenant="beta", cap=4)
        procs[1].send(op="grant", tenant="beta", amount=1)
        assert [await p.answer() for p in procs] == [4, 1]
        assert await _both(procs, op="flush") == [True, True]
        await stream.caught_up()  # one projection step: both processes enforce both
        assert sum(await _both(procs, op="check", tenant="beta", n=3)) == 2  # type: ignore[arg-type]
        assert sum(await _both(procs, op="check", tenant="acme", n=1)) == 0  # type: ignore[arg-type]
        assert await _both(procs, op="flush") == [True, True]
        await stream.caught_up()
        live = _state(stream.redis_url)
        assert live[0] and live[2] == [None, b"1"]
        assert worker.terminate() == 0

        sync = redis_sync.Redis.from_url(stream.redis_url)
        sync.flushdb()
        code = await asyncio.to_thread(
            main, ["replay", "--archive-dir", str(archive), "--redis-url", stream.redis_url]
        )
        out = capsys.readouterr().out
        assert code == 0 and "2 run-time changes" in out, out
        assert _state(stream.redis_url) == live
        code = await asyncio.to_thread(
            main, ["reconcile", "--archive-dir", str(archive), "--redis-url", stream.redis_url]
        )
        out = capsys.readouterr().out
        assert code == 0 and "no drift" in out, out
        # Still enforced after the replay: beta's room (4 + 1) is spent.
        assert sum(await _both(procs, op="check", tenant="beta", n=1)) == 0  # type: ignore[arg-type]
        sync.close()
    finally:
        for p in procs:
            p.close()
