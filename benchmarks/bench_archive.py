"""The archive a live worker leaves, read by ``mcpbg costs`` and the FOCUS export, vs one file.

Starts its own Redis and tansu broker (``testing.services``), a 6-partition
topic and two ``mcpbg worker`` processes with ``--archive-dir`` on default
settings, except the compaction age, compressed with the clock: a Governor fed
at a steady ``--rate`` (checks and metered costs) writes ``--events`` events whose
times span ``--sim-hours`` simulated hours (starting at the next UTC midnight,
so one date folder), and ``--archive-segment-age`` is one simulated hour in
real seconds. Halfway, both workers are SIGKILLed and replaced (the issue-38
scenario). Once every event is applied, the workers are stopped (SIGTERM).

Then, in one run, rounds interleaved, medians reported: ``mcpbg costs
--period <day>`` and ``mcpbg export focus --period <day>`` (subprocesses, as
a user runs them) over the worker's archive and over the same rows copied into
one Parquet file. Reported: the ratios (target DESIGN: <= 1.2), file counts,
files per partition per simulated hour (target <= 1), bytes per event. Both
readers must agree on events and USD (else exit 1).

    .venv/bin/python -m benchmarks.bench_archive                   # 20,000 events, 250/s
    .venv/bin/python -m benchmarks.bench_archive --real-time --rate 220   # issue 38 as filed
    .venv/bin/python -m benchmarks.bench_archive --events 1000000 --rate 3000   # heavy
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from mcp_budget_governor import Context, Governor, RedisBackend
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import (
    EntryType,
    LedgerEntry,
    new_id,
    partition_key,
    partition_of,
)
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.counters.memory import MemoryBackend
from testing.bench import loadavg, progress, table
from testing.stream_support import (
    CLI,
    Worker,
    create_topic,
    tenants_per_partition,
    watermarks,
    worker_argv,
    worker_env,
)

from .bench_worker import PARTITIONS, Services, policy

TARGET = 1.2


async def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    return {tp.partition: off for tp, off in ends.items()}


async def feed(
    gov: Governor, clock: list[float], args: argparse.Namespace, halfway: asyncio.Event
) -> None:
    """``args.events`` operations at ``args.rate`` per second; the clock moves with them."""
    rng = random.Random(38)
    tenants = tenants_per_partition(PARTITIONS, 1, "t")  # every partition gets events
    start = clock[0]
    step = args.sim_hours * 3600 / args.events
    began = time.monotonic()
    for i in range(args.events):
        due = began + i / args.rate
        if (wait := due - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        clock[0] = time.time() if args.real_time else start + i * step
        user = rng.randrange(20)  # 20 users, each in one tenant
        ctx = Context(user=f"u{user}", tenant=tenants[user % PARTITIONS], tool="search")
        if i % 2:
            await gov.check(ctx)
        else:
            await gov.meter("bw_spend", rng.randrange(1, 40_000), ctx)
        if i == args.events // 2:
            halfway.set()
        if i and i % 5000 == 0:
            progress(f"  {i:,} events fed")


async def hour_templates(begin: float, ops: int, seed: int) -> list[tuple[int, bytes, LedgerEntry]]:
    """(partition, key, entry) of ``ops`` governed checks and costs within the hour at ``begin``."""
    rng = random.Random(seed)
    now = [begin]

    def clock() -> float:
        now[0] += 3000 / ops  # within the hour
        return now[0]

    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(clock=clock), ledger=ledger, clock=clock)
    tenants = tenants_per_partition(PARTITIONS, 1, "t")
    for _ in range(ops):
        user = rng.randrange(20)
        ctx = Context(user=f"u{user}", tenant=tenants[user % PARTITIONS], tool="search")
        if rng.random() < 0.5:
            await gov.check(ctx)
        else:
            await gov.meter("bw_spend", rng.randrange(1, 40_000), ctx)
    await gov.aclose()
    return [
        (partition_of(key, PARTITIONS), key, e)
        for e in ledger.entries
        if e.type in (EntryType.ADMITTED, EntryType.METERED)
        for key in [partition_key(e.context.tenant, e.context.user)]
    ]


async def direct_feed(
    bootstrap: str, topic: str, start: float, args: argparse.Namespace, halfway: asyncio.Event
) -> None:
    """``--direct``: ledger events straight to the topic at ``args.rate`` per second.

    Cloned, each with a fresh id, from governed runs of each simulated hour
    (checks and metered costs; a clone keeps its template's time, which its
    buckets must hold), keyed and partitioned as ``KafkaLedger`` sends them.
    For runs the Governor cannot feed fast enough on this machine.
    """
    hours = max(1, math.ceil(args.sim_hours))
    hourly = [await hour_templates(start + h * 3600, 400, h) for h in range(hours)]
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=False, linger_ms=5
    )
    await producer.start()
    try:
        began = time.monotonic()
        pending: list[asyncio.Future[Any]] = []
        for i in range(args.events):
            if i % 200 == 0:
                if (wait := began + i / args.rate - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if len(pending) > 5000:
                    await asyncio.gather(*pending)
                    pending.clear()
            templates = hourly[i * hours // args.events]
            partition, key, e = templates[i % len(templates)]
            entry = dataclasses.replace(e, id=new_id())
            pending.append(
                await producer.send(
                    topic, encode(entry, "/mcpbg/bench-archive"), key=key, partition=partition
                )
            )
            if i == args.events // 2:
                halfway.set()
            if i and i % 100_000 == 0:
                progress(f"  {i:,} events sent")
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


def start(
    svc: Services, url: str, topic: str, group: str, tmp: Path, name: str, age: float | None
) -> Worker:
    argv = worker_argv(
        topic, group,
        "--kafka-url", f"kafka://{svc.bootstrap}",
        "--redis-url", url,
        "--archive-dir", str(tmp / "archive"),
        *(() if age is None else ("--archive-segment-age", f"{age:g}")),
        "--progress-interval", "5",
        python=CLI,
    )  # fmt: skip
    return Worker(name, tmp / f"{name}.log", argv, worker_env(tmp))


async def live_run(svc: Services, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    topic, group = f"bench-archive-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await create_topic(svc.bootstrap, topic, PARTITIONS)
    url = svc.url(5)
    RedisBackend.from_url(url)  # checks the URL
    import redis

    redis.Redis.from_url(url).flushdb()
    real_seconds = args.events / args.rate
    # One simulated hour; --real-time: the default (an hour), events at the real time.
    age = None if args.real_time else real_seconds / args.sim_hours
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    day = midnight if args.real_time else midnight + timedelta(days=1)
    clock = [day.timestamp()]
    workers = [start(svc, url, topic, group, tmp, f"w{i}", age) for i in range(2)]
    backend = RedisBackend.from_url(url)
    ledger = KafkaLedger(
        svc.bootstrap, topic=topic, partitions=PARTITIONS, outbox_dir=tmp / "outbox"
    )
    gov = Governor(policy(), backend, ledger=ledger, clock=lambda: clock[0])
    halfway = asyncio.Event()
    deadline = time.monotonic() + 120
    while set().union(*(w.assigned() or set() for w in workers)) != set(range(PARTITIONS)):
        if time.monotonic() > deadline:
            raise RuntimeError("the workers were not assigned every partition within 120 s")
        await asyncio.sleep(0.2)
    progress(f"feeding {args.events:,} events at {args.rate:,}/s ({real_seconds:.0f} s), "
             f"segment age {'default' if age is None else f'{age:.2f} s'}")  # fmt: skip
    feed_started = time.monotonic()
    task = asyncio.create_task(
        direct_feed(svc.bootstrap, topic, clock[0], args, halfway)
        if args.direct
        else feed(gov, clock, args, halfway)
    )
    await halfway.wait()
    for w in workers:
        w.kill()
    progress("  both workers SIGKILLed halfway; replaced")
    workers += [start(svc, url, topic, group, tmp, f"w{i}", age) for i in (2, 3)]
    await task
    fed = time.monotonic() - feed_started
    progress(f"  fed in {fed:.0f} s ({args.events / fed:,.0f} events/s)")
    assert await ledger.flush(60.0), "the ledger did not ship every event"
    await ledger.aclose()
    ends = await end_offsets(svc.bootstrap, topic)
    deadline = time.monotonic() + 600
    while True:
        marks = await watermarks(backend, topic)
        if all(marks.get(p, -1) >= end - 1 for p, end in ends.items()):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"not caught up: {marks} vs {ends}")
        await asyncio.sleep(0.5)
    for w in workers[2:]:
        w.terminate(120)
    await backend.aclose()
    return {
        "day": day.date().isoformat(),
        "records": sum(ends.values()),
        "age": age,
        "fed_seconds": fed,
    }


def one_file_copy(archive: Path, out: Path, day: str) -> None:
    folder = out / f"date={day}"
    folder.mkdir(parents=True)
    duckdb.sql(
        f"COPY (SELECT * EXCLUDE (date) FROM read_parquet('{archive}/**/*.parquet', "
        f'hive_partitioning = true, union_by_name = true) ORDER BY "partition", "offset") '
        f"TO '{folder / 'all.parquet'}' (FORMAT parquet, COMPRESSION zstd)"
    )


def cli(*argv: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, check=False)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"mcpbg {' '.join(argv)}: {done.stderr.strip()}")
    return took, done.stdout


def reader_totals(folder: Path) -> tuple[int, int]:
    from mcp_budget_governor.projections.ledger_view import open_ledger

    con = open_ledger(archive_dir=folder)
    try:
        ((events, usd),) = con.sql("SELECT count(*), sum(usd_micros)::BIGINT FROM costs").fetchall()
    finally:
        con.close()
    return int(events), int(usd)


def shape(folder: Path, sim_hours: float) -> dict[str, Any]:
    files = list(folder.rglob("*.parquet"))
    size = sum(p.stat().st_size for p in files)
    partitions = len({p.name.split("-p")[-1].split("-")[0] for p in files}) or 1
    return {
        "files": len(files),
        "bytes": size,
        "files_per_partition_hour": len(files) / partitions / sim_hours,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rate", type=int, default=250, help="events fed per second")
    parser.add_argument("--sim-hours", type=float, default=24.0)
    parser.add_argument(
        "--direct",
        action="store_true",
        help="send cloned events straight to the topic (no Governor): for --events 1000000",
    )
    parser.add_argument(
        "--real-time",
        action="store_true",
        help="no time compression: events at the real time, default segment age (the issue's "
        "20,000 events over ~90 s)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    svc = Services()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-archive-") as name:
            tmp = Path(name)
            run = asyncio.run(live_run(svc, tmp, args))
            archive, one = tmp / "archive", tmp / "one"
            one_file_copy(archive, one, run["day"])
            truth = reader_totals(archive)
            if truth[0] != args.events:
                progress(f"FAIL: the archive holds {truth[0]:,} events, {args.events:,} were fed")
                return 1
            if reader_totals(one) != truth:
                progress(f"FAIL: the archive and the one-file copy disagree: {truth}")
                return 1
            hours = math.ceil(args.events / args.rate / 3600) if args.real_time else args.sim_hours
            shapes = {"archive": shape(archive, hours), "one": shape(one, hours)}
            times: dict[str, dict[str, list[float]]] = {
                label: {"costs": [], "focus": []} for label in shapes
            }
            for r in range(args.rounds):
                progress(f"round {r + 1} of {args.rounds}")
                for label, folder in (("archive", archive), ("one", one)):
                    period = ("--archive-dir", str(folder), "--period", run["day"])
                    times[label]["costs"].append(cli("costs", *period)[0])
                    out = tmp / f"focus-{label}-{r}.parquet"
                    times[label]["focus"].append(
                        cli("export", "focus", *period, "--out", str(out))[0]
                    )
    finally:
        svc.stop()
    return report(args, run, truth, shapes, times)


def report(
    args: argparse.Namespace,
    run: dict[str, Any],
    truth: tuple[int, int],
    shapes: dict[str, dict[str, Any]],
    times: dict[str, dict[str, list[float]]],
) -> int:
    events = truth[0]
    med = {k: {q: statistics.median(v) for q, v in t.items()} for k, t in times.items()}
    ratios = {q: med["archive"][q] / med["one"][q] for q in ("costs", "focus")}
    rows = [
        [
            label,
            f"{shapes[label]['files']:,}",
            f"{shapes[label]['files_per_partition_hour']:.2f}" if label == "archive" else "-",
            f"{shapes[label]['bytes']:,}",
            f"{shapes[label]['bytes'] / events:.1f}",
            f"{med[label]['costs']:.2f}",
            f"{med[label]['focus']:.2f}",
        ]
        for label in ("archive", "one")
    ]
    span = "real time" if args.real_time else f"{args.sim_hours:g} simulated hours"
    age = "default" if run["age"] is None else f"{run['age']:.2f} s"
    print(
        f"\n{events:,} events ({run['records']:,} records) over {span}, fed at {args.rate:,}/s, "
        f"two workers SIGKILLed halfway and replaced; segment age {age}; load {loadavg()}"
    )
    print(
        table(
            [
                "archive",
                "files",
                "files/partition/hour",
                "bytes",
                "bytes/event",
                "costs s",
                "FOCUS s",
            ],
            rows,
            [False] + [True] * 6,
        )
    )
    met_files = shapes["archive"]["files_per_partition_hour"] <= 1.0
    met = {q: r <= TARGET for q, r in ratios.items()}
    for q, r in ratios.items():
        print(
            f"{q}: archive / one file = {r:.2f}x "
            f"(target <= {TARGET}x: {'met' if met[q] else 'MISSED'})"
        )
    print(f"files per partition per simulated hour <= 1: {'met' if met_files else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "run": run,
                    "events": events,
                    "usd_micros": truth[1],
                    "shapes": shapes,
                    "times": times,
                    "ratios": ratios,
                },
                indent=2,
            )
        )
    return 0 if met_files and all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
