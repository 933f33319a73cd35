"""Projection throughput and lag of one stream worker (``mcpbg worker``).

Starts its own Redis and tansu broker (memory storage) through
``testing/services.py``; each phase projects into its own fresh Redis database,
whose epoch marker is set first (counters complete: the worker projects live
instead of rebuilding from the topic).

1. **Throughput.** A 6-partition topic is pre-filled with ``--events``
   (200,000) ledger events: CloudEvents encoded with ``events.encode`` from
   the entries of a Governor + MemoryBackend + MemoryLedger run (checks,
   metered costs, reservations over many users and tenants), cloned with
   fresh UUIDv7 ids and keyed by tenant as ``KafkaLedger`` keys them. The
   same records are then projected, each way timed until every partition's
   Redis watermark reaches its last offset:

   - ``mcpbg worker``: the worker as a subprocess, default settings, timed
     from its first applied batch (start-up reported apart); then the same
     with ``--archive-dir`` (every record parsed fully, Parquet written
     before each apply);
   - the same ``Projector`` driven by a plain aiokafka consumer in this
     process (manual assignment, ``getmany``, ``apply_batch`` per partition):
     the worker without its group membership, listener and side outputs;
   - the ``Projector`` alone, records already in memory;
   - the ``Projector`` over a backend whose ``apply`` does nothing (decoding
     and argument building only), with its fast decoder and with the full
     pydantic parse for every record (the decoder's baseline).

2. **Lag at a steady rate.** While one worker runs, ``KafkaLedger`` (default
   settings) is fed ``--rate`` (5,000) events/s for ``--seconds`` (20 s). The
   append time of every event is recorded; every ``--poll-ms`` (20 ms) the
   watermarks of all partitions are read; afterwards the topic is read back
   for each event's (partition, offset). An event's lag is the time of the
   first poll that saw its partition's watermark at or past its offset, minus
   its append time. Diagnostics (skip with ``--no-diagnostics``): the same run
   with ``--fetch-max-wait-ms 1500`` (the faust worker's fixed value), and a
   probe of the broker's delivery latency with a plain consumer.

``--profile`` adds cProfile runs of the aiokafka loop and of the worker,
own time grouped by layer.

    python -m benchmarks.bench_worker [--events 200000] [--rate 5000] [--seconds 20]
                                      [--json out.json] [--profile] [--no-diagnostics]

Targets (DESIGN): at least 20,000 events/s for one worker; lag p99 at most
250 ms at 5,000 events/s. Exit status 1 when either is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import importlib
import inspect
import io
import json
import os
import pstats
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
from _common import REPO, TESTS, loadavg, percentile, progress, table
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mcp_budget_governor import (
    MAX_AMOUNT,
    BudgetExceeded,
    Context,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.counters import AppliedEvent
from mcp_budget_governor.events import encode
from mcp_budget_governor.keys import WATERMARK_KEY
from mcp_budget_governor.ledger import LedgerEntry, new_id, partition_key
from mcp_budget_governor.ledger import partition_of as partition_index
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.memory_counters import MemoryBackend
from mcp_budget_governor.stream.projector import DeadLetter, Projector

PARTITIONS = 6
SOURCE = "/mcpbg/bench-worker"
THROUGHPUT_TARGET = 20_000.0
LAG_P99_TARGET_MS = 250.0
# Group membership as the worker tests use it: tansu is slow to rejoin a group.
GROUP_OPTS = ["--session-timeout-ms", "6000", "--heartbeat-interval-ms", "500"]
#: The worker's --fetch-max-wait-ms default (stream.worker.WorkerConfig).
DEFAULT_FETCH_WAIT_MS = 50
CATCH_UP = 120.0  # seconds a phase may take before the run is declared broken


# -- the events -----------------------------------------------------------------


def policy() -> Policy:
    """Three gated call limits and one metered spend limit, as a typical deployment."""
    return Policy.of(
        Limit("bw_user_day", cap=MAX_AMOUNT, window=Window.DAY, scope=Scope.USER),
        Limit("bw_user_tool", cap=MAX_AMOUNT, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
        Limit("bw_tenant", cap=MAX_AMOUNT, window=Window.MONTH, scope=Scope.TENANT),
        Limit(
            "bw_spend",
            cap=MAX_AMOUNT,
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
    )


def tenants(per_partition: int = 4) -> list[str]:
    """Tenant names spread evenly over the partitions (the ledger keys by tenant)."""
    buckets: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    i = 0
    while any(len(b) < per_partition for b in buckets.values()):
        name = f"tenant-{i}"
        bucket = buckets[partition_index(partition_key(name, None), PARTITIONS)]
        if len(bucket) < per_partition:
            bucket.append(name)
        i += 1
    return [name for b in buckets.values() for name in b]


async def template_entries(ops: int, seed: int = 7) -> list[LedgerEntry]:
    """Ledger entries of ``ops`` governed operations (one or two entries each)."""
    rng = random.Random(seed)
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=ledger)
    names = tenants()
    tools = ["search", "fetch", "summarize", "translate", "code"]
    for _ in range(ops):
        ctx = Context(
            user=f"user-{rng.randrange(400)}", tenant=rng.choice(names), tool=rng.choice(tools)
        )
        op = rng.random()
        if op < 0.6:
            await gov.check(ctx)
        elif op < 0.85:
            await gov.meter("bw_spend", rng.randrange(1, 40_000), ctx)
        else:
            with contextlib.suppress(BudgetExceeded):
                async with gov.reserved("bw_spend", 25_000, ctx) as r:
                    r.actual = rng.randrange(0, 50_000)
    await gov.aclose()
    return ledger.entries


def partition_of(entry: LedgerEntry) -> int:
    """The partition ``KafkaLedger`` sends an entry to (CRC-32 of tenant, else user)."""
    return partition_index(partition_key(entry.context.tenant, entry.context.user), PARTITIONS)


def key_of(entry: LedgerEntry) -> bytes:
    ctx = entry.context
    scope = ctx.tenant if ctx.tenant is not None else ctx.user
    return b"-" if scope is None else scope.encode()


def clone_records(templates: Sequence[LedgerEntry], n: int) -> list[tuple[int, bytes, bytes]]:
    """``n`` (partition, key, value) records: the templates encoded, each with a fresh id."""
    encoded = [(partition_of(e), key_of(e), encode(e, SOURCE), e.id.encode()) for e in templates]
    out = []
    for i in range(n):
        partition, key, raw, old = encoded[i % len(encoded)]
        out.append((partition, key, raw.replace(old, new_id().encode(), 1)))
    return out


# -- services -------------------------------------------------------------------


class Services:
    """The local Redis and tansu this run starts, and their pids for CPU accounting."""

    def __init__(self) -> None:
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        services = importlib.import_module("services")
        self.redis = services.start_redis(prefer_local=True)
        try:
            self.kafka = services.start_kafka(prefer_local=True, durable=False)
        except BaseException:
            self.redis.stop()
            raise

    def url(self, db: int) -> str:
        return self.redis.url.rsplit("/", 1)[0] + f"/{db}"

    @property
    def bootstrap(self) -> str:
        return str(self.kafka.bootstrap)

    def stop(self) -> None:
        try:
            self.kafka.stop()
        finally:
            self.redis.stop()


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process (all its threads) so far, from /proc."""
    if pid is None:
        return float("nan")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent by named processes between start() and stop()."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.start_at: dict[str, float] = {}
        self.used: dict[str, float] = {}

    def start(self) -> None:
        self.start_at = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self.start_at["this process"] = time.process_time()

    def stop(self) -> dict[str, float]:
        self.used = {
            name: cpu_seconds(pid) - self.start_at[name] for name, pid in self.pids.items()
        }
        self.used["this process"] = time.process_time() - self.start_at["this process"]
        return self.used


async def create_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()


async def fill_topic(
    bootstrap: str, topic: str, records: Sequence[tuple[int, bytes, bytes]]
) -> dict[int, int]:
    """Send every record, one record batch per partition at a time; the last offset of each."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        enable_idempotence=False,
        acks="all",
        max_batch_size=1 << 20,
        linger_ms=5,
    )
    await producer.start()
    last: dict[int, int] = {}
    counts: dict[int, int] = dict.fromkeys(range(PARTITIONS), 0)
    try:
        builders: dict[int, Any] = {}
        futures: list[tuple[int, int, Any]] = []  # (partition, records in batch, future)

        async def ship(partition: int) -> None:
            builder = builders.pop(partition)
            futures.append(
                (
                    partition,
                    builder.record_count(),
                    await producer.send_batch(builder, topic, partition=partition),
                )
            )
            if len(futures) >= 24:
                await settle()

        async def settle() -> None:
            for partition, n, fut in futures:
                meta = await fut
                last[partition] = max(last.get(partition, -1), meta.offset + n - 1)
            futures.clear()

        for partition, key, value in records:
            builder = builders.get(partition)
            if builder is None:
                builder = builders[partition] = producer.create_batch()
            if builder.append(timestamp=None, key=key, value=value) is None:
                await ship(partition)
                builder = builders[partition] = producer.create_batch()
                builder.append(timestamp=None, key=key, value=value)
            counts[partition] += 1
        for partition in list(builders):
            await ship(partition)
        await settle()
    finally:
        await producer.stop()
    # A fresh topic numbers each partition's records from 0, in the order sent.
    expected = {p: n - 1 for p, n in counts.items() if n}
    if last != expected:
        progress(f"note: broker reported last offsets {last}, counted {expected}; using counts")
    return expected


async def watermarks(client: Any, topic: str) -> dict[int, int]:
    raw = await client.hgetall(WATERMARK_KEY)
    prefix = f"{topic}:".encode()
    return {int(k[len(prefix) :]): int(v) for k, v in raw.items() if k.startswith(prefix)}


# -- the worker subprocess --------------------------------------------------------


class WorkerProcess:
    """One ``python -m mcp_budget_governor.cli worker`` and its log, like the worker tests."""

    def __init__(
        self,
        bootstrap: str,
        redis_url: str,
        topic: str,
        group: str,
        log: Path,
        extra: Sequence[str] = (),
        python: Sequence[str] = (),
    ) -> None:
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        argv = [
            *(python or [sys.executable, "-m", "mcp_budget_governor.cli"]),
            "worker",
            "--kafka-url", f"kafka://{bootstrap}",
            "--redis-url", redis_url,
            "--topic", topic,
            "--group", group,
            "--progress-interval", "1",
            *GROUP_OPTS,
            *extra,
        ]  # fmt: skip
        self.argv = argv
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def assigned(self) -> bool:
        return re.search(r"projector: assigned \d", self.text()) is not None

    def stop(self, within: float = 30.0) -> int:
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9


async def wait_until(
    client: Any,
    topic: str,
    last: dict[int, int],
    poll: float,
    on_first: Callable[[], None] | None = None,
    alive: Callable[[], bool] = lambda: True,
    within: float = CATCH_UP,
) -> tuple[float | None, int, float]:
    """Poll watermarks until each partition is at ``last``.

    Returns (wall time of the first poll that saw progress, events applied by
    then, wall time of the poll that saw every partition done).
    """
    first: float | None = None
    first_applied = 0
    deadline = time.monotonic() + within
    while True:
        marks = await watermarks(client, topic)
        now = time.time()
        applied = sum(marks.get(p, -1) + 1 for p in last)
        if first is None and applied:
            first, first_applied = now, applied
            if on_first is not None:
                on_first()
        if all(marks.get(p, -1) >= off for p, off in last.items()):
            return first, first_applied, now
        if time.monotonic() > deadline or not alive():
            raise RuntimeError(f"not caught up: watermarks {marks}, want {last}")
        await asyncio.sleep(poll)


async def run_worker_throughput(
    svc: Services,
    topic: str,
    last: dict[int, int],
    n: int,
    db: int,
    tmp: Path,
    poll: float,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    url = svc.url(db)
    await mark_ready(url)
    client = redis.asyncio.Redis.from_url(url)
    meter = CpuMeter({"redis": svc.redis.pid, "tansu": svc.kafka.pid})
    spawned = time.time()
    worker = WorkerProcess(
        svc.bootstrap,
        url,
        topic,
        f"bench-worker-{uuid.uuid4().hex[:8]}",
        tmp / f"worker-throughput-{db}.log",
        extra=extra,
    )
    meter.pids["worker"] = worker.pid
    load = loadavg()
    try:
        # CPU over the same span as events/s: from the first applied batch on.
        first, first_applied, done = await wait_until(
            client,
            topic,
            last,
            poll,
            on_first=meter.start,
            alive=lambda: worker.proc.poll() is None,
        )
        cpu = meter.stop()
    except RuntimeError as exc:
        raise SystemExit(f"mcpbg worker did not catch up: {exc}\n{worker.tail()}") from None
    finally:
        code = worker.stop()
        await client.aclose()
    text = worker.text()
    stopped = re.search(r"stopped after (\d+) records, (\d+) applied, (\d+) dead", text)
    assert first is not None
    rate = (n - first_applied) / max(done - first, 1e-9)
    rates = [float(x) for x in re.findall(r"projector: (\d+) events/s", text)]
    return {
        "events": n,
        "seconds_from_spawn": done - spawned,
        "startup_seconds": first - spawned,
        "seconds": done - first,
        "events_per_s": rate,
        "events_timed": n - first_applied,
        "cpu_seconds": cpu,
        "loadavg": [load, loadavg()],
        "exit_code": code,
        "stopped_line": stopped.group(0) if stopped else None,
        "worker_progress_rates": rates,
    }


# -- aiokafka + Projector in this process ---------------------------------------------


def no_dead_letters(letter: DeadLetter) -> None:
    raise SystemExit(f"benchmark invalid: a dead letter ({letter.reason})")


def make_projector(backend: Any, topic: str, *, full_parse: bool = False) -> Projector:
    """A Projector as the worker builds it (requiring the epoch marker where supported).

    ``full_parse``: every record through the pydantic parse (what an archive
    handler makes the Projector do), the fast decoder's baseline.
    """
    options: dict[str, Any] = {}
    if "require_epoch" in inspect.signature(Projector).parameters:
        options["require_epoch"] = True
    if full_parse:
        options["archive"] = lambda partition, records: None
    return Projector(backend, topic, dlq=no_dead_letters, **options)


async def mark_ready(url: str) -> None:
    """Set the epoch marker of a fresh database: counters complete, project live.

    Without it a worker that checks the marker would rebuild from the topic at
    its assignment instead of consuming it live.
    """
    backend = RedisBackend.from_url(url, timeout=5.0)
    try:
        await backend.mark_ready(f"bench-{uuid.uuid4().hex[:8]}")
    finally:
        await backend.aclose()


async def run_aiokafka_loop(
    svc: Services, topic: str, last: dict[int, int], n: int, db: int, batch: int
) -> dict[str, Any]:
    backend = RedisBackend.from_url(svc.url(db), timeout=5.0, max_connections=4)
    await mark_ready(svc.url(db))
    projector = make_projector(backend, topic)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=svc.bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    meter = CpuMeter({"redis": svc.redis.pid, "tansu": svc.kafka.pid})
    try:
        tps = [TopicPartition(topic, p) for p in sorted(last)]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, await projector.resume_offset(tp.partition))
        done_at: dict[int, int] = dict.fromkeys(last, -1)
        load = loadavg()
        meter.start()
        t0 = time.perf_counter()
        while any(done_at[p] < off for p, off in last.items()):
            if time.perf_counter() - t0 > CATCH_UP:
                raise SystemExit(f"aiokafka loop did not catch up: {done_at}, want {last}")
            batches = await consumer.getmany(timeout_ms=200, max_records=batch)
            for tp, messages in batches.items():
                records = [(m.offset, m.value) for m in messages]
                result = await projector.apply_batch(tp.partition, records)
                done_at[tp.partition] = result.last_offset
        seconds = time.perf_counter() - t0
        cpu = meter.stop()
    finally:
        await consumer.stop()
        await backend.aclose()
    return {
        "events": n,
        "seconds": seconds,
        "events_per_s": n / seconds,
        "events_timed": n,
        "applied": projector.applied,
        "cpu_seconds": cpu,
        "loadavg": [load, loadavg()],
    }


class NullBackend:
    """A backend whose apply does nothing: what is left is the Projector's own Python."""

    async def apply(self, partition: str, events: Sequence[AppliedEvent], **_: Any) -> int:
        return len(events)

    async def watermark(self, partition: str) -> int:
        return -1


async def run_projector_alone(
    svc: Services | None,
    topic: str,
    by_partition: dict[int, list[tuple[int, bytes]]],
    db: int,
    batch: int,
    *,
    full_parse: bool = False,
) -> dict[str, Any]:
    """apply_batch over records already in memory, partitions in turn, ``batch`` at a time."""
    backend: Any = (
        NullBackend()
        if svc is None
        else RedisBackend.from_url(svc.url(db), timeout=5.0, max_connections=4)
    )
    if svc is not None:
        await mark_ready(svc.url(db))
    projector = make_projector(backend, topic, full_parse=full_parse)
    chunks = [
        (p, records[i : i + batch])
        for i in range(0, max(len(r) for r in by_partition.values()), batch)
        for p, records in sorted(by_partition.items())
        if records[i : i + batch]
    ]
    n = sum(len(r) for r in by_partition.values())
    meter = CpuMeter({} if svc is None else {"redis": svc.redis.pid})
    load = loadavg()
    meter.start()
    t0 = time.perf_counter()
    for partition, records in chunks:
        await projector.apply_batch(partition, records)
    seconds = time.perf_counter() - t0
    cpu = meter.stop()
    if svc is not None:
        await backend.aclose()
    return {
        "events": n,
        "seconds": seconds,
        "events_per_s": n / seconds,
        "events_timed": n,
        "applied": projector.applied,
        "cpu_seconds": cpu,
        "loadavg": [load, loadavg()],
    }


# -- lag at a steady rate ---------------------------------------------------------


async def run_lag(
    svc: Services,
    templates: Sequence[LedgerEntry],
    rate: float,
    seconds: float,
    db: int,
    tmp: Path,
    poll: float,
    fetch_wait_ms: int | None = None,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    topic = f"bench.worker.lag.{uuid.uuid4().hex[:8]}"
    await create_topic(svc.bootstrap, topic)
    url = svc.url(db)
    await mark_ready(url)
    client = redis.asyncio.Redis.from_url(url)
    worker = WorkerProcess(
        svc.bootstrap,
        url,
        topic,
        f"bench-lag-{uuid.uuid4().hex[:8]}",
        tmp / f"worker-lag-{db}.log",
        extra=[
            *extra,
            *(() if fetch_wait_ms is None else ("--fetch-max-wait-ms", str(fetch_wait_ms))),
        ],
    )
    ledger = KafkaLedger(
        svc.bootstrap, topic=topic, partitions=PARTITIONS, outbox_dir=tmp / f"outbox-{db}"
    )
    polls: list[tuple[float, dict[int, int]]] = []
    appended: dict[str, float] = {}
    meter = CpuMeter({"redis": svc.redis.pid, "tansu": svc.kafka.pid, "worker": worker.pid})
    try:
        t_wait = time.monotonic()
        while not worker.assigned():
            if worker.proc.poll() is not None or time.monotonic() - t_wait > 60:
                raise SystemExit(f"lag: the worker did not get its partitions\n{worker.tail()}")
            await asyncio.sleep(0.05)
        progress(f"lag: worker assigned after {time.monotonic() - t_wait:.1f} s; producing")
        await ledger.start()
        stop_polling = asyncio.Event()

        async def poller() -> None:
            while not stop_polling.is_set():
                marks = await watermarks(client, topic)
                polls.append((time.time(), marks))
                await asyncio.sleep(poll)

        poll_task = asyncio.create_task(poller())
        load = loadavg()
        meter.start()
        behind = 0.0
        start = time.monotonic()
        sent = 0
        i = 0
        total = int(rate * seconds)
        next_report = start + 5
        while sent < total:
            now = time.monotonic()
            due = min(total, int((now - start) * rate))
            behind = max(behind, (due - sent) / rate)
            while sent < due:
                template = templates[i % len(templates)]
                i += 1
                t = time.time()
                entry = dataclasses.replace(template, id=new_id(), time=t)
                appended[entry.id] = t
                await ledger.append(entry)
                sent += 1
            if now >= next_report:
                progress(f"lag: {sent} events appended, {len(polls)} polls")
                next_report += 5
            await asyncio.sleep(0.002)
        produce_seconds = time.monotonic() - start
        if not await ledger.flush(30):
            raise SystemExit("lag: the ledger did not ship every event within 30 s")
        located = await locate(svc.bootstrap, topic, appended)
        last: dict[int, int] = {}
        for p, offset in located.values():
            last[p] = max(last.get(p, -1), offset)
        while not polls or not all(polls[-1][1].get(p, -1) >= o for p, o in last.items()):
            if worker.proc.poll() is not None:
                raise SystemExit(f"lag: the worker exited\n{worker.tail()}")
            await asyncio.sleep(poll)
        cpu = meter.stop()
        stop_polling.set()
        await poll_task
    finally:
        code = worker.stop()
        await ledger.aclose()
        await client.aclose()
    lags = lag_per_event(appended, located, polls)
    return {
        "fetch_max_wait_ms": DEFAULT_FETCH_WAIT_MS if fetch_wait_ms is None else fetch_wait_ms,
        "worker_options": list(extra),
        "events": len(appended),
        "rate_target": rate,
        "rate_achieved": len(appended) / produce_seconds,
        "produce_seconds": produce_seconds,
        "producer_max_behind_ms": behind * 1000,
        "polls": len(polls),
        "poll_ms": poll * 1000,
        "lag_ms": {
            "p50": percentile(lags, 50),
            "p90": percentile(lags, 90),
            "p99": percentile(lags, 99),
            "max": max(lags),
            "mean": sum(lags) / len(lags),
        },
        "cpu_seconds": cpu,
        "loadavg": [load, loadavg()],
        "exit_code": code,
        "worker_progress_rates": [
            float(x) for x in re.findall(r"projector: (\d+) events/s", worker.text())
        ],
        "ledger": dataclasses.asdict(ledger.snapshot()),
    }


async def locate(
    bootstrap: str, topic: str, wanted: dict[str, float]
) -> dict[str, tuple[int, int]]:
    """Read the topic back: (partition, offset) of each event id in ``wanted``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    found: dict[str, tuple[int, int]] = {}
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 60
        while len(found) < len(wanted):
            if time.monotonic() > deadline:
                raise SystemExit(f"lag: found {len(found)} of {len(wanted)} events on the topic")
            batches = await consumer.getmany(timeout_ms=500, max_records=5000)
            for tp, messages in batches.items():
                for m in messages:
                    event_id = _event_id(m.value)
                    if event_id in wanted and event_id not in found:
                        found[event_id] = (tp.partition, m.offset)
    finally:
        await consumer.stop()
    return found


def _event_id(raw: bytes | None) -> str | None:
    # The id is the second field encode() writes; slicing avoids a JSON parse per event.
    if not raw:
        return None
    start = raw.find(b'"id":"')
    return None if start < 0 else raw[start + 6 : start + 42].decode()


def lag_per_event(
    appended: dict[str, float],
    located: dict[str, tuple[int, int]],
    polls: Sequence[tuple[float, dict[int, int]]],
) -> list[float]:
    """Milliseconds from append to the first poll whose watermark covered the event."""
    per_partition: dict[int, list[tuple[int, float]]] = {}
    for event_id, (p, offset) in located.items():
        per_partition.setdefault(p, []).append((offset, appended[event_id]))
    lags: list[float] = []
    for p, events in per_partition.items():
        events.sort()
        k = 0
        for offset, t_append in events:
            while k < len(polls) and polls[k][1].get(p, -1) < offset:
                k += 1
            if k == len(polls):
                raise SystemExit(f"lag: partition {p} offset {offset} never seen applied")
            lags.append((polls[k][0] - t_append) * 1000)
    return lags


# -- profile ------------------------------------------------------------------------


def profile_summary(stats: pstats.Stats, total_events: int, top: int = 14) -> list[str]:
    """Own time grouped by package, then the top functions by own time."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    groups: dict[str, float] = {}
    total = idle = 0.0
    rows = []
    for (filename, line, name), (_cc, _nc, tt, _ct, callers) in raw.items():
        group = _group(filename, name)
        if group == IDLE:
            idle += tt
            continue
        total += tt
        rows.append((tt, f"{_short(filename)}:{line}({name})"))
        if filename == "~" and group == BUILTINS and callers:
            # A builtin (isinstance, len, bytes.join...) counts for whoever called it.
            for (cfile, _cline, cname), caller_stats in callers.items():
                g = _group(cfile, cname)
                groups[g] = groups.get(g, 0.0) + caller_stats[2]
            continue
        groups[group] = groups.get(group, 0.0) + tt
    out = [
        f"busy {total:.2f} s ({total * 1e6 / max(total_events, 1):.1f} us/event), "
        f"waiting (epoll, locks) {idle:.2f} s; shares of the busy time:"
    ]
    for group, tt in sorted(groups.items(), key=lambda x: -x[1]):
        if tt / total >= 0.01:
            out.append(f"  {tt / total * 100:5.1f}%  {group}")
    out.append("  top functions (own time):")
    for tt, where in sorted(rows, reverse=True)[:top]:
        out.append(f"  {tt / total * 100:5.1f}%  {where}")
    return out


def _short(filename: str) -> str:
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    stdlib = re.sub(r"^.*/lib/python3\.\d+/", "", filename)
    return stdlib if stdlib != filename else filename.replace(str(REPO) + "/", "")


IDLE = "idle"
PARSE = "events.parse (pydantic validate_json)"

_GROUPS = [
    ("site-packages/pydantic", PARSE),
    ("mcp_budget_governor/events.py", PARSE),
    ("stream/fastdecode.py", "fastdecode.decode (orjson + checks)"),
    ("stream/projector.py", "Projector (to_applied, batch loop)"),
    ("projections/redis_counters.py", "RedisBackend.apply (Lua arguments)"),
    ("mcp_budget_governor/counters.py", "Projector (to_applied, batch loop)"),
    ("site-packages/redis/", "redis-py (pack_command, encode, reply)"),
    ("site-packages/aiokafka/", "aiokafka (fetch, decode records)"),
    ("site-packages/orjson", "fastdecode.decode (orjson + checks)"),
    ("stream/worker.py", "stream/worker.py (consume loop)"),
    ("benchmarks/bench_worker.py", "the benchmark's consume loop"),
    ("/asyncio/", "asyncio event loop (tasks, futures, callbacks)"),
    ("/selectors.py", "asyncio event loop (tasks, futures, callbacks)"),
    ("/threading.py", "threads (locks, queues)"),
    ("/queue.py", "threads (locks, queues)"),
    ("/concurrent/", "threads (locks, queues)"),
]

BUILTINS = "builtins, caller unknown"

_BUILTINS = [
    ("'poll' of 'select.epoll", IDLE),
    ("select.select", IDLE),
    ("validate_json", PARSE),
    ("_pydantic_core", PARSE),
    ("orjson.loads", "fastdecode.decode (orjson + checks)"),
    ("acquire' of '_thread", IDLE),
]


def _group(filename: str, name: str) -> str:
    for marker, group in _GROUPS:
        if marker in filename:
            return group
    if filename == "~":
        for marker, group in _BUILTINS:
            if marker in name:
                return group
        return BUILTINS
    if re.search(r"/lib/python3\.\d+/", filename) and "site-packages" not in filename:
        return "stdlib (other)"
    return "other: " + _short(filename).split("/")[0]


async def profile_aiokafka_loop(
    svc: Services, topic: str, last: dict[int, int], n: int, db: int, batch: int
) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    result = await run_aiokafka_loop(svc, topic, last, n, db, batch)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    return [f"{result['events_per_s']:,.0f} events/s under cProfile", *profile_summary(stats, n)]


# Runs the worker with a profiler in every thread (the worker itself has one
# thread; helper threads, e.g. the archive's, show up when they are busy).
_PROFILED_WORKER = """
import cProfile, sys, threading
out = sys.argv.pop(1)
original = threading.Thread._bootstrap_inner
def bootstrap_inner(self):
    prof = cProfile.Profile()
    prof.enable()
    try:
        original(self)
    finally:
        prof.disable()
        prof.dump_stats(f"{out}.thread-{self.name}")
threading.Thread._bootstrap_inner = bootstrap_inner
# The main thread is profiled from its first batch on: start-up is not the subject.
from mcp_budget_governor.stream.projector import Projector
prof = cProfile.Profile()
apply_batch = Projector.apply_batch
async def first_apply_batch(self, *args, **kwargs):
    Projector.apply_batch = apply_batch
    prof.enable()
    return await apply_batch(self, *args, **kwargs)
Projector.apply_batch = first_apply_batch
from mcp_budget_governor.cli import main
try:
    code = main(sys.argv[1:])
finally:
    prof.disable()
    prof.dump_stats(f"{out}.main")
sys.exit(code)
"""


async def profile_worker(
    svc: Services, topic: str, last: dict[int, int], n: int, db: int, tmp: Path, poll: float
) -> list[str]:
    url = svc.url(db)
    await mark_ready(url)
    client = redis.asyncio.Redis.from_url(url)
    out = tmp / "worker.prof"
    worker = WorkerProcess(
        svc.bootstrap,
        url,
        topic,
        f"bench-prof-{uuid.uuid4().hex[:8]}",
        tmp / "worker-prof.log",
        python=[sys.executable, "-c", _PROFILED_WORKER, str(out)],
    )
    try:
        first, first_applied, done = await wait_until(
            client, topic, last, poll, alive=lambda: worker.proc.poll() is None
        )
    finally:
        worker.stop(60)
        await client.aclose()
    assert first is not None
    rate = (n - first_applied) / max(done - first, 1e-9)
    lines = [f"{rate:,.0f} events/s under cProfile (main thread profiled from its first batch on)"]
    return lines + thread_profiles(tmp, n)


def thread_profiles(tmp: Path, n: int) -> list[str]:
    lines = []
    for f in sorted(tmp.glob("worker.prof.*")):
        stats = pstats.Stats(str(f), stream=io.StringIO())
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        if sum(v[2] for v in raw.values()) < 0.05:
            continue  # an idle helper thread
        lines.append(f"[{f.name.split('.', 2)[-1]}]")
        lines.extend(profile_summary(stats, n))
    return lines


# -- main ---------------------------------------------------------------------------


async def run(args: argparse.Namespace, svc: Services, tmp: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"settings": vars(args).copy()}
    t = time.perf_counter()
    templates = await template_entries(args.template_ops)
    records = clone_records(templates, args.events)
    by_partition: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(PARTITIONS)}
    for partition, _key, value in records:
        part = by_partition[partition]
        part.append((len(part), value))
    sizes = [len(v) for _p, _k, v in records]
    result["events"] = {
        "templates": len(templates),
        "from_ops": args.template_ops,
        "mean_bytes": sum(sizes) / len(sizes),
        "charges_per_event": sum(len(e.charges) for e in templates) / len(templates),
        "per_partition": {p: len(r) for p, r in by_partition.items()},
        "build_seconds": time.perf_counter() - t,
    }
    progress(
        f"built {len(records)} events ({len(templates)} templates, "
        f"{result['events']['mean_bytes']:.0f} bytes mean) in {time.perf_counter() - t:.1f} s"
    )
    topic = f"bench.worker.{uuid.uuid4().hex[:8]}"
    await create_topic(svc.bootstrap, topic)
    t = time.perf_counter()
    last = await fill_topic(svc.bootstrap, topic, records)
    result["fill_seconds"] = time.perf_counter() - t
    progress(f"topic {topic} filled in {result['fill_seconds']:.1f} s; last offsets {last}")
    del records

    progress("throughput: mcpbg worker (subprocess) ...")
    result["worker"] = await run_worker_throughput(
        svc, topic, last, args.events, 1, tmp, args.poll_ms / 1000
    )
    progress(f"  {result['worker']['events_per_s']:,.0f} events/s")
    if not args.no_archive:
        progress("throughput: mcpbg worker --archive-dir (subprocess) ...")
        result["worker_archive"] = await run_worker_throughput(
            svc,
            topic,
            last,
            args.events,
            8,
            tmp,
            args.poll_ms / 1000,
            extra=["--archive-dir", str(tmp / "archive")],
        )
        progress(f"  {result['worker_archive']['events_per_s']:,.0f} events/s")
    progress("throughput: aiokafka consumer + Projector (in process) ...")
    result["aiokafka"] = await run_aiokafka_loop(svc, topic, last, args.events, 2, args.batch)
    progress(f"  {result['aiokafka']['events_per_s']:,.0f} events/s")
    progress("throughput: Projector alone, records in memory ...")
    result["projector"] = await run_projector_alone(svc, topic, by_partition, 3, args.batch)
    progress(f"  {result['projector']['events_per_s']:,.0f} events/s")
    progress("throughput: Projector over a no-op backend (parse only) ...")
    result["parse_only"] = await run_projector_alone(None, topic, by_partition, 0, args.batch)
    progress(f"  {result['parse_only']['events_per_s']:,.0f} events/s")
    progress("throughput: the same, every record through the pydantic parse ...")
    result["parse_full"] = await run_projector_alone(
        None, topic, by_partition, 0, args.batch, full_parse=True
    )
    progress(f"  {result['parse_full']['events_per_s']:,.0f} events/s")
    del by_partition

    progress(f"lag: {args.rate:,.0f} events/s for {args.seconds:g} s through KafkaLedger ...")
    result["lag"] = await run_lag(
        svc, templates, args.rate, args.seconds, 4, tmp, args.poll_ms / 1000
    )
    lag = result["lag"]["lag_ms"]
    progress(f"  lag p50 {lag['p50']:.0f} ms, p99 {lag['p99']:.0f} ms, max {lag['max']:.0f} ms")
    if not args.no_diagnostics:
        progress(f"lag, diagnostic: the same with fetch_max_wait_ms={args.diag_fetch_wait_ms} ...")
        result["lag_fetch_wait"] = await run_lag(
            svc,
            templates,
            args.rate,
            args.seconds,
            7,
            tmp,
            args.poll_ms / 1000,
            fetch_wait_ms=args.diag_fetch_wait_ms,
        )
        lag = result["lag_fetch_wait"]["lag_ms"]
        progress(f"  lag p50 {lag['p50']:.0f} ms, p99 {lag['p99']:.0f} ms")
        progress("broker probe: delivery latency of a plain aiokafka consumer ...")
        result["broker_probe"] = await probe_broker(
            svc, (DEFAULT_FETCH_WAIT_MS, args.diag_fetch_wait_ms)
        )

    if args.profile:
        progress("profile: aiokafka consumer + Projector under cProfile ...")
        result["profile_aiokafka"] = await profile_aiokafka_loop(
            svc, topic, last, args.events, 5, args.batch
        )
        progress("profile: mcpbg worker under cProfile (every thread) ...")
        result["profile_worker"] = await profile_worker(
            svc, topic, last, args.events, 6, tmp, args.poll_ms / 1000
        )
    return result


async def probe_broker(svc: Services, waits: Sequence[int], records: int = 150) -> dict[str, Any]:
    """Send-to-receive latency of a plain aiokafka consumer at 100 records/s, per fetch wait.

    Isolates the broker's long-poll: Kafka answers a held fetch as soon as
    ``fetch_min_bytes`` (1) has arrived, so the wait should not matter.
    """
    producer = AIOKafkaProducer(bootstrap_servers=svc.bootstrap, enable_idempotence=False)
    await producer.start()
    out: dict[str, Any] = {}
    try:
        for wait in waits:
            topic = f"bench.worker.probe.{uuid.uuid4().hex[:8]}"
            await create_topic(svc.bootstrap, topic)
            consumer = AIOKafkaConsumer(
                bootstrap_servers=svc.bootstrap,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                fetch_max_wait_ms=wait,
            )
            await consumer.start()
            try:
                consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
                await consumer.getmany(timeout_ms=500)
                sent: dict[bytes, float] = {}
                latency: list[float] = []

                async def receive(
                    c: AIOKafkaConsumer = consumer,
                    s: dict[bytes, float] = sent,
                    into: list[float] = latency,
                ) -> None:
                    while len(into) < records:
                        m = await c.getone()
                        into.append((time.perf_counter() - s[m.value]) * 1000)

                task = asyncio.create_task(receive())
                for i in range(records):
                    value = str(i).encode()
                    sent[value] = time.perf_counter()
                    await producer.send(topic, value, partition=i % PARTITIONS)
                    await asyncio.sleep(0.01)
                await asyncio.wait_for(task, 10)
            finally:
                await consumer.stop()
            out[str(wait)] = {
                "p50": percentile(latency, 50),
                "p90": percentile(latency, 90),
                "max": max(latency),
            }
    finally:
        await producer.stop()
    return out


def report(result: dict[str, Any], args: argparse.Namespace, env: str) -> bool:
    ev = result["events"]
    print(env)
    print(
        f"{args.events:,} events on {PARTITIONS} partitions ({ev['mean_bytes']:.0f} bytes, "
        f"{ev['charges_per_event']:.2f} charges per event on average; cloned from "
        f"{ev['templates']} entries of {ev['from_ops']} governed operations); topic filled "
        f"in {result['fill_seconds']:.1f} s\n"
    )
    rows = []
    names = [
        ("worker", "mcpbg worker, subprocess"),
        ("worker_archive", "mcpbg worker --archive-dir, subprocess"),
        ("aiokafka", "aiokafka getmany + Projector, in process"),
        ("projector", "Projector alone, records in memory"),
        ("parse_only", "Projector, no-op backend (decode only)"),
        ("parse_full", "same, full pydantic parse (no fast decoder)"),
    ]
    for key, label in names:
        if key not in result:
            continue
        r = result[key]
        cpu = r["cpu_seconds"]
        own = cpu.get("worker", cpu.get("this process", float("nan")))
        rows.append(
            [
                label,
                f"{r['events_per_s']:,.0f}",
                f"{r['seconds']:.2f}",
                f"{own:.1f}",
                f"{own * 1e6 / r['events_timed']:.0f}",
                f"{cpu.get('redis', float('nan')):.1f}",
                f"{cpu.get('tansu', float('nan')):.1f}",
                _load1(r["loadavg"]),
            ]
        )
    print(
        table(
            [
                "projection, one consumer",
                "events/s",
                "seconds",
                "cpu s",
                "cpu us/event",
                "redis cpu s",
                "tansu cpu s",
                "load (1 min)",
            ],
            rows,
            [False, *([True] * 7)],
        )
    )
    print(
        "cpu s: of the process that projects (the worker, else this one) over the timed "
        "span; cpu us/event is that over the events timed, which other load on the machine "
        "moves less than events/s"
    )
    w = result["worker"]
    print(
        f"\nmcpbg worker: {w['startup_seconds']:.1f} s from spawn to the first applied batch "
        f"(not in events/s), {w['seconds_from_spawn']:.1f} s from spawn to caught up; "
        f"Exit code {w['exit_code']}; {w['stopped_line']}"
    )
    ok = w["events_per_s"] >= THROUGHPUT_TARGET
    print(
        f"Target: one worker >= {THROUGHPUT_TARGET:,.0f} events/s: "
        f"{w['events_per_s']:,.0f} -> {'MET' if ok else 'MISSED'}"
    )
    lag = result["lag"]
    ms = lag["lag_ms"]
    print(
        f"\nLag: {lag['events']:,} events appended through KafkaLedger (default settings) at "
        f"{lag['rate_achieved']:,.0f}/s for {lag['produce_seconds']:.1f} s (at most "
        f"{lag['producer_max_behind_ms']:.1f} ms behind schedule); one mcpbg worker; "
        f"watermarks polled every {lag['poll_ms']:.0f} ms ({lag['polls']} polls), so each lag "
        f"is late by up to one poll interval\n"
    )
    lag_rows = []
    for key, label in (
        ("lag", "mcpbg worker, default settings"),
        ("lag_fetch_wait", "same, --fetch-max-wait-ms {}"),
    ):
        if key in result:
            r = result[key]
            cpu = r["cpu_seconds"]
            lag_rows.append(
                [
                    label.format(r["fetch_max_wait_ms"]),
                    *(f"{r['lag_ms'][k]:.0f}" for k in ("p50", "p90", "p99", "max", "mean")),
                    f"{r['rate_achieved']:,.0f}",
                    f"{cpu['worker']:.1f}",
                    f"{cpu['this process']:.1f}",
                    f"{cpu['redis']:.1f}",
                    f"{cpu['tansu']:.1f}",
                    _load1(r["loadavg"]),
                ]
            )
    print(
        table(
            [
                "lag (append -> watermark seen)",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
                "mean ms",
                "events/s",
                "worker cpu s",
                "producer cpu s",
                "redis cpu s",
                "tansu cpu s",
                "load (1 min)",
            ],
            lag_rows,
            [False, *([True] * 11)],
        )
    )
    lag_ok = ms["p99"] <= LAG_P99_TARGET_MS
    print(
        f"Target: lag p99 <= {LAG_P99_TARGET_MS:.0f} ms at {lag['rate_target']:,.0f} events/s "
        f"(default settings): {ms['p99']:.0f} ms -> {'MET' if lag_ok else 'MISSED'}"
    )
    if "broker_probe" in result:
        probe = result["broker_probe"]
        print(
            "Broker probe (plain aiokafka consumer, 6 partitions, 100 records/s, send -> "
            "receive): "
            + "; ".join(
                f"fetch_max_wait_ms={w}: p50 {v['p50']:.0f} ms, p90 {v['p90']:.0f} ms, "
                f"max {v['max']:.0f} ms"
                for w, v in probe.items()
            )
        )
    for key, title in (
        ("profile_aiokafka", "cProfile: aiokafka getmany + Projector, in process"),
        ("profile_worker", "cProfile: mcpbg worker, subprocess"),
    ):
        if key in result:
            print(f"\n{title}")
            print("\n".join(result[key]))
    return ok and lag_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="events for throughput")
    parser.add_argument("--template-ops", type=int, default=4000, help="governed ops cloned")
    parser.add_argument("--batch", type=int, default=500, help="records per getmany/apply")
    parser.add_argument("--rate", type=float, default=5000.0, help="events/s for the lag phase")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the lag phase")
    parser.add_argument("--poll-ms", type=float, default=20.0, help="watermark poll interval")
    parser.add_argument(
        "--no-diagnostics",
        action="store_true",
        help="skip the lag run with a shorter fetch wait and the broker probe",
    )
    parser.add_argument(
        "--diag-fetch-wait-ms",
        type=int,
        default=1500,
        help="--fetch-max-wait-ms of the diagnostic lag run (the faust worker's fixed 1500)",
    )
    parser.add_argument(
        "--no-archive", action="store_true", help="skip the worker run with --archive-dir"
    )
    parser.add_argument("--profile", action="store_true", help="add cProfile runs (~+60 s)")
    parser.add_argument("--json", help="write raw results here")
    args = parser.parse_args()
    started = time.perf_counter()
    load_before = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="mcpbg-bench-worker-"))
    svc = Services()
    try:
        result = asyncio.run(run(args, svc, tmp))
        info = redis.Redis.from_url(svc.url(0)).info("server")
    finally:
        svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = loadavg()
    import aiokafka

    try:
        import hiredis  # redis-py packs and parses in C when it is installed

        with_hiredis = f"hiredis {hiredis.__version__}"
    except ImportError:
        with_hiredis = "no hiredis"
    env = (
        f"Python {sys.version.split()[0]}, aiokafka "
        f"{aiokafka.__version__}, redis-py {redis.__version__} ({with_hiredis}); "
        f"Redis {info.get('redis_version')}"
        f" and tansu (memory storage) started by the benchmark on loopback; {os.cpu_count()} "
        f"CPUs; load avg {_load(load_before)} -> {_load(load_after)}"
    )
    result["environment"] = env
    result["wall_seconds"] = time.perf_counter() - started
    met = report(result, args, env)
    print(f"\nwhole run: {result['wall_seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0 if met else 1


def _load1(pair: Sequence[tuple[float, float, float] | None]) -> str:
    """The 1-minute load average at the start and end of a phase."""
    return " -> ".join("?" if v is None else f"{v[0]:.1f}" for v in pair)


def _load(values: tuple[float, float, float] | None) -> str:
    return "?" if values is None else "/".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
