"""Projection throughput and lag of one stream worker (``mcpbg worker``).

Starts its own Redis and tansu broker (memory storage) through ``testing.services``.
**Throughput**: a 6-partition topic pre-filled with ``--events`` ledger events
(cloned from a governed run) is projected, each phase into a fresh Redis database
whose epoch marker is set first, by ``mcpbg worker`` (and with ``--archive-dir``),
by the same ``Projector`` under a plain aiokafka loop, by the ``Projector`` alone,
and over a no-op backend (fast decoder, then the full pydantic parse). **Lag**:
``KafkaLedger`` fed ``--rate`` events/s for ``--seconds`` while one worker runs;
an event's lag is append time to the first watermark poll that covers it.
Both engines run in the same run: ``mcpbg worker`` (aiokafka, the default) and
``mcpbg worker --engine faust``, for throughput and for lag (``--no-faust`` skips
the faust phases). ``--profile`` adds cProfile runs. Method and figures:
benchmarks/README.md.

    python -m benchmarks.bench_worker [--events 200000] [--rate 5000] [--seconds 20]
                                      [--json out.json] [--profile] [--no-diagnostics]

Targets (DESIGN): at least 20,000 events/s for one worker; lag p99 at most
250 ms at 5,000 events/s; the faust engine at least 0.5x the default engine's
events/s, and its lag p99 at most 250 ms too. Exit status 1 when one is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import io
import json
import os
import pstats
import random
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from mcp_budget_governor import (
    MAX_AMOUNT,
    Context,
    Governor,
    Limit,
    LimitExceeded,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.counters import AppliedEvent
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import LedgerEntry, new_id, partition_key, partition_of
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.counters.memory import MemoryBackend
from mcp_budget_governor.stream.projector import DeadLetter, Projector
from testing import services
from testing.bench import (
    BUILTINS,
    IDLE,
    CpuMeter,
    loadavg,
    percentile,
    profile_summary,
    progress,
    short_path,
    table,
)
from testing.stream_support import (
    CLI,
    Worker,
    create_topic,
    tenants_per_partition,
    watermarks,
    worker_argv,
    worker_env,
)

PARTITIONS = 6
SOURCE = "/mcpbg/bench-worker"
THROUGHPUT_TARGET = 20_000.0
LAG_P99_TARGET_MS = 250.0
#: The faust engine's events/s over the default engine's, in the same run, at least.
FAUST_RATIO_TARGET = 0.5
FAUST = ("--engine", "faust")
#: Seconds a worker under cProfile may take to catch up (cProfile slows faust ~3x).
PROFILE_CATCH_UP = 600.0
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


async def template_entries(ops: int, seed: int = 7) -> list[LedgerEntry]:
    """Ledger entries of ``ops`` governed operations (one or two entries each)."""
    rng = random.Random(seed)
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=ledger)
    names = tenants_per_partition(PARTITIONS, 4, "tenant-")
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
            with contextlib.suppress(LimitExceeded):
                async with gov.reserved("bw_spend", 25_000, ctx) as r:
                    r.actual = rng.randrange(0, 50_000)
    await gov.aclose()
    return ledger.entries


def clone_records(templates: Sequence[LedgerEntry], n: int) -> list[tuple[int, bytes, bytes]]:
    """``n`` (partition, key, value) records: the templates encoded, each with a fresh id,
    keyed and partitioned as ``KafkaLedger`` sends them."""
    keys = [partition_key(e.context.tenant, e.context.user) for e in templates]
    encoded = [
        (partition_of(key, PARTITIONS), key, encode(e, SOURCE), e.id.encode())
        for key, e in zip(keys, templates, strict=True)
    ]
    out = []
    for i in range(n):
        partition, key, raw, old = encoded[i % len(encoded)]
        out.append((partition, key, raw.replace(old, new_id().encode(), 1)))
    return out


# -- services -------------------------------------------------------------------


class Services:
    """The local Redis and tansu this run starts, and their pids for CPU accounting."""

    def __init__(self) -> None:
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

    def meter(self, **pids: int) -> CpuMeter:
        """CPU seconds of Redis, tansu and ``pids`` (and this process)."""
        return CpuMeter({"redis": self.redis.pid, "tansu": self.kafka.pid, **pids})

    def worker(
        self, url: str, topic: str, tmp: Path, log: str, *extra: str, python: Sequence[str] = CLI
    ) -> Worker:
        """``mcpbg worker`` as the worker tests start it, on database ``url``, in a new group."""
        argv = worker_argv(
            topic, f"bench-{log}-{uuid.uuid4().hex[:8]}",
            "--kafka-url", f"kafka://{self.bootstrap}",
            "--redis-url", url,
            "--progress-interval", "1",
            *extra,
            python=python,
        )  # fmt: skip
        return Worker(log, tmp / f"{log}.log", argv, worker_env(tmp))

    def stop(self) -> None:
        try:
            self.kafka.stop()
        finally:
            self.redis.stop()


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


async def wait_until(
    backend: RedisBackend,
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
        marks = await watermarks(backend, topic)
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
    backend = await ready(svc.url(db))
    spawned = time.time()
    worker = svc.worker(svc.url(db), topic, tmp, f"worker-throughput-{db}", *extra)
    meter = svc.meter(worker=worker.proc.pid)
    load = loadavg()
    try:
        # CPU over the same span as events/s: from the first applied batch on.
        first, first_applied, done = await wait_until(
            backend,
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
        code = worker.terminate()
        await backend.aclose()
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


def in_process(
    n: int, seconds: float, projector: Projector, cpu: dict[str, float], load: Any
) -> dict[str, Any]:
    """The result of a phase timed in this process, from the first record to the last."""
    return {
        "events": n,
        "seconds": seconds,
        "events_per_s": n / seconds,
        "events_timed": n,
        "applied": projector.applied,
        "cpu_seconds": cpu,
        "loadavg": [load, loadavg()],
    }


def no_dead_letters(letter: DeadLetter) -> None:
    raise SystemExit(f"benchmark invalid: a dead letter ({letter.reason})")


def make_projector(backend: Any, topic: str, *, full_parse: bool = False) -> Projector:
    """A Projector as the worker builds it (requiring the epoch marker where supported).

    ``full_parse``: every record through the pydantic parse (what an archive
    handler makes the Projector do), the fast decoder's baseline.
    """
    archive = (lambda partition, records: None) if full_parse else None
    return Projector(backend, topic, dlq=no_dead_letters, require_epoch=True, archive=archive)


async def ready(url: str, **options: Any) -> RedisBackend:
    """A backend on a fresh database, its epoch marker set: counters complete.

    Without the marker a worker would rebuild from the topic at its assignment
    instead of consuming it live.
    """
    backend = RedisBackend.from_url(url, timeout=5.0, **options)
    await backend.mark_ready(f"bench-{uuid.uuid4().hex[:8]}")
    return backend


async def run_aiokafka_loop(
    svc: Services, topic: str, last: dict[int, int], n: int, db: int, batch: int
) -> dict[str, Any]:
    backend = await ready(svc.url(db), max_connections=4)
    projector = make_projector(backend, topic)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=svc.bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    meter = svc.meter()
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
    return in_process(n, seconds, projector, cpu, load)


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
    backend: Any = NullBackend() if svc is None else await ready(svc.url(db), max_connections=4)
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
    return in_process(n, seconds, projector, cpu, load)


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
    await create_topic(svc.bootstrap, topic, PARTITIONS)
    backend = await ready(svc.url(db))
    wait = () if fetch_wait_ms is None else ("--fetch-max-wait-ms", str(fetch_wait_ms))
    worker = svc.worker(svc.url(db), topic, tmp, f"worker-lag-{db}", *extra, *wait)
    ledger = KafkaLedger(
        svc.bootstrap, topic=topic, partitions=PARTITIONS, outbox_dir=tmp / f"outbox-{db}"
    )
    polls: list[tuple[float, dict[int, int]]] = []
    appended: dict[str, float] = {}
    meter = svc.meter(worker=worker.proc.pid)
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
                marks = await watermarks(backend, topic)
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
        code = worker.terminate()
        await ledger.aclose()
        await backend.aclose()
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


PARSE = "events.parse (pydantic validate_json)"

_GROUPS = [
    ("site-packages/pydantic", PARSE),
    ("mcp_budget_governor/events.py", PARSE),
    ("stream/fastdecode.py", "fastdecode.decode (orjson + checks)"),
    ("stream/projector.py", "Projector (to_applied, batch loop)"),
    ("projections/counters/redis.py", "RedisBackend.apply (Lua arguments)"),
    ("mcp_budget_governor/counters.py", "Projector (to_applied, batch loop)"),
    ("site-packages/redis/", "redis-py (pack_command, encode, reply)"),
    ("site-packages/aiokafka/", "aiokafka (fetch, decode records)"),
    ("site-packages/orjson", "fastdecode.decode (orjson + checks)"),
    ("stream/worker.py", "stream/worker.py (consume loop)"),
    ("stream/faust_app.py", "stream/faust_app.py (the agent)"),
    ("stream/projection.py", "stream/projection.py (apply_all, accounting)"),
    ("site-packages/faust/", "faust (consumer, conductor, streams, acks)"),
    ("site-packages/mode/", "mode (services, wait_first, signals)"),
    ("benchmarks/bench_worker.py", "the benchmark's consume loop"),
    ("/asyncio/", "asyncio event loop (tasks, futures, callbacks)"),
    ("/selectors.py", "asyncio event loop (tasks, futures, callbacks)"),
    ("/threading.py", "threads (locks, queues)"),
    ("/queue.py", "threads (locks, queues)"),
    ("/concurrent/", "threads (locks, queues)"),
]

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
    return "other: " + short_path(filename).split("/")[0]


async def profile_aiokafka_loop(
    svc: Services, topic: str, last: dict[int, int], n: int, db: int, batch: int
) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    result = await run_aiokafka_loop(svc, topic, last, n, db, batch)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    return [
        f"{result['events_per_s']:,.0f} events/s under cProfile",
        *profile_summary(stats, n, _group),
    ]


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
    svc: Services,
    topic: str,
    last: dict[int, int],
    n: int,
    db: int,
    tmp: Path,
    poll: float,
    extra: Sequence[str] = (),
    name: str = "worker",
) -> list[str]:
    backend = await ready(svc.url(db))
    out = tmp / f"{name}.prof"
    python = (sys.executable, "-c", _PROFILED_WORKER, str(out))
    worker = svc.worker(svc.url(db), topic, tmp, f"{name}-prof", *extra, python=python)
    try:
        first, first_applied, done = await wait_until(
            backend,
            topic,
            last,
            poll,
            alive=lambda: worker.proc.poll() is None,
            within=PROFILE_CATCH_UP,
        )
    finally:
        worker.terminate(60)
        await backend.aclose()
    assert first is not None
    rate = (n - first_applied) / max(done - first, 1e-9)
    lines = [f"{rate:,.0f} events/s under cProfile (main thread profiled from its first batch on)"]
    return lines + thread_profiles(tmp, n, name)


def thread_profiles(tmp: Path, n: int, name: str = "worker") -> list[str]:
    lines = []
    for f in sorted(tmp.glob(f"{name}.prof.*")):
        stats = pstats.Stats(str(f), stream=io.StringIO())
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        if sum(v[2] for v in raw.values()) < 0.05:
            continue  # an idle helper thread
        lines.append(f"[{f.name.split('.', 2)[-1]}]")
        lines.extend(profile_summary(stats, n, _group))
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
    await create_topic(svc.bootstrap, topic, PARTITIONS)
    t = time.perf_counter()
    last = await fill_topic(svc.bootstrap, topic, records)
    result["fill_seconds"] = time.perf_counter() - t
    progress(f"topic {topic} filled in {result['fill_seconds']:.1f} s; last offsets {last}")
    del records

    poll = args.poll_ms / 1000
    archive = ("--archive-dir", str(tmp / "archive"))
    phases: list[tuple[str, str, Callable[[], Awaitable[dict[str, Any]]]]] = [
        ("worker", "mcpbg worker (subprocess)",
         lambda: run_worker_throughput(svc, topic, last, args.events, 1, tmp, poll)),
        ("worker_faust", "mcpbg worker --engine faust (subprocess)",
         lambda: run_worker_throughput(svc, topic, last, args.events, 9, tmp, poll, FAUST)),
        ("worker_archive", "mcpbg worker --archive-dir (subprocess)",
         lambda: run_worker_throughput(svc, topic, last, args.events, 8, tmp, poll, archive)),
        ("aiokafka", "aiokafka consumer + Projector (in process)",
         lambda: run_aiokafka_loop(svc, topic, last, args.events, 2, args.batch)),
        ("projector", "Projector alone, records in memory",
         lambda: run_projector_alone(svc, topic, by_partition, 3, args.batch)),
        ("parse_only", "Projector over a no-op backend (parse only)",
         lambda: run_projector_alone(None, topic, by_partition, 0, args.batch)),
        ("parse_full", "the same, every record through the pydantic parse",
         lambda: run_projector_alone(None, topic, by_partition, 0, args.batch, full_parse=True)),
    ]  # fmt: skip
    for key, what, phase in phases:
        if (key == "worker_archive" and args.no_archive) or (
            key == "worker_faust" and args.no_faust
        ):
            continue
        progress(f"throughput: {what} ...")
        result[key] = await phase()
        progress(f"  {result[key]['events_per_s']:,.0f} events/s")
    by_partition.clear()

    progress(f"lag: {args.rate:,.0f} events/s for {args.seconds:g} s through KafkaLedger ...")
    result["lag"] = await run_lag(svc, templates, args.rate, args.seconds, 4, tmp, poll)
    lag = result["lag"]["lag_ms"]
    progress(f"  lag p50 {lag['p50']:.0f} ms, p99 {lag['p99']:.0f} ms, max {lag['max']:.0f} ms")
    if not args.no_faust:
        progress("lag: the same, mcpbg worker --engine faust ...")
        result["lag_faust"] = await run_lag(
            svc, templates, args.rate, args.seconds, 10, tmp, poll, extra=FAUST
        )
        lag = result["lag_faust"]["lag_ms"]
        progress(f"  lag p50 {lag['p50']:.0f} ms, p99 {lag['p99']:.0f} ms")
    if not args.no_diagnostics:
        progress(f"lag, diagnostic: the same with fetch_max_wait_ms={args.diag_fetch_wait_ms} ...")
        result["lag_fetch_wait"] = await run_lag(
            svc, templates, args.rate, args.seconds, 7, tmp, poll, args.diag_fetch_wait_ms
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
        result["profile_worker"] = await profile_worker(svc, topic, last, args.events, 6, tmp, poll)
        if not args.no_faust:
            progress("profile: mcpbg worker --engine faust under cProfile (every thread) ...")
            result["profile_worker_faust"] = await profile_worker(
                svc, topic, last, args.events, 11, tmp, poll, FAUST, "faust"
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
            await create_topic(svc.bootstrap, topic, PARTITIONS)
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


THROUGHPUT_ROWS = [
    ("worker", "mcpbg worker, subprocess"),
    ("worker_faust", "mcpbg worker --engine faust, subprocess"),
    ("worker_archive", "mcpbg worker --archive-dir, subprocess"),
    ("aiokafka", "aiokafka getmany + Projector, in process"),
    ("projector", "Projector alone, records in memory"),
    ("parse_only", "Projector, no-op backend (decode only)"),
    ("parse_full", "same, full pydantic parse (no fast decoder)"),
]


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
    for key, label in THROUGHPUT_ROWS:
        if key not in result:
            continue
        r = result[key]
        cpu = r["cpu_seconds"]
        own = cpu.get("worker", cpu.get("this process", float("nan")))
        nan = float("nan")
        rows.append([
            label, f"{r['events_per_s']:,.0f}", f"{r['seconds']:.2f}", f"{own:.1f}",
            f"{own * 1e6 / r['events_timed']:.0f}", f"{cpu.get('redis', nan):.1f}",
            f"{cpu.get('tansu', nan):.1f}", _load1(r["loadavg"]),
        ])  # fmt: skip
    headers = [
        "projection, one consumer", "events/s", "seconds", "cpu s", "cpu us/event",
        "redis cpu s", "tansu cpu s", "load (1 min)",
    ]  # fmt: skip
    print(table(headers, rows, [False, *([True] * 7)]))
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
    if "worker_faust" in result:
        f = result["worker_faust"]
        ratio = f["events_per_s"] / w["events_per_s"]
        ok = ok and ratio >= FAUST_RATIO_TARGET
        print(
            f"mcpbg worker --engine faust: {f['startup_seconds']:.1f} s from spawn to the first "
            f"applied batch, exit code {f['exit_code']}; {f['stopped_line']}\n"
            f"Target: faust engine >= {FAUST_RATIO_TARGET}x the default engine's events/s: "
            f"{f['events_per_s']:,.0f} / {w['events_per_s']:,.0f} = {ratio:.2f}x -> "
            f"{'MET' if ratio >= FAUST_RATIO_TARGET else 'MISSED'}"
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
        ("lag_faust", "mcpbg worker --engine faust"),
        ("lag_fetch_wait", "same, --fetch-max-wait-ms {}"),
    ):
        if key in result:
            r = result[key]
            cpu = r["cpu_seconds"]
            lag_rows.append([
                label.format(r["fetch_max_wait_ms"]),
                *(f"{r['lag_ms'][k]:.0f}" for k in ("p50", "p90", "p99", "max", "mean")),
                f"{r['rate_achieved']:,.0f}",
                *(f"{cpu[k]:.1f}" for k in ("worker", "this process", "redis", "tansu")),
                _load1(r["loadavg"]),
            ])  # fmt: skip
    headers = [
        "lag (append -> watermark seen)", "p50 ms", "p90 ms", "p99 ms", "max ms", "mean ms",
        "events/s", "worker cpu s", "producer cpu s", "redis cpu s", "tansu cpu s",
        "load (1 min)",
    ]  # fmt: skip
    print(table(headers, lag_rows, [False, *([True] * 11)]))
    lag_ok = ms["p99"] <= LAG_P99_TARGET_MS
    print(
        f"Target: lag p99 <= {LAG_P99_TARGET_MS:.0f} ms at {lag['rate_target']:,.0f} events/s "
        f"(default settings): {ms['p99']:.0f} ms -> {'MET' if lag_ok else 'MISSED'}"
    )
    if "lag_faust" in result:
        p99 = result["lag_faust"]["lag_ms"]["p99"]
        faust_ok = p99 <= LAG_P99_TARGET_MS
        lag_ok = lag_ok and faust_ok
        print(
            f"Target: faust engine lag p99 <= {LAG_P99_TARGET_MS:.0f} ms: {p99:.0f} ms -> "
            f"{'MET' if faust_ok else 'MISSED'}"
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
        ("profile_worker_faust", "cProfile: mcpbg worker --engine faust, subprocess"),
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
    parser.add_argument(
        "--no-faust", action="store_true", help="skip the faust engine's throughput and lag runs"
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
    try:
        import faust

        with_faust = f"faust-streaming {faust.__version__}, "
    except ImportError:
        with_faust = ""
    env = (
        f"Python {sys.version.split()[0]}, {with_faust}aiokafka "
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
