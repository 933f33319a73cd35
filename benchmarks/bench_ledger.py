"""What the crash-safe Kafka ledger costs the hot path: check() with KafkaLedger vs none.

Both governors share one Redis (started here unless --redis) and one policy of
3 gated limits; the ledger governor commits every event to its outbox (one
write() before check() returns, fsync'd in group commits by a thread) and
ships it to a real Kafka-protocol broker (the tansu binary, started here
unless --kafka) from the same event loop, so its encoding, writing and
shipping CPU is inside the measured time. Variants run interleaved in
chunks, medians compared in the same run. Then the broker is killed and the
same comparison runs during the outage (events wait in the outbox), and
finally the outbox drains once the broker is back. The group-commit window
(the fsync interval, and how long the fsyncs took) is reported: it bounds
what a machine crash can lose.

    python -m benchmarks.bench_ledger [--calls 2000] [--rounds 5] [--ladder] [--json out.json]

``--ladder`` adds an outbox that never ships: the commit point's share alone.

Targets (DESIGN): at most 1.15x with the ledger, at most 2x during an outage.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Window
from mcp_budget_governor.events import encode
from mcp_budget_governor.money import MAX_AMOUNT
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.producers.record_log import Flusher, RecordLog
from testing import services
from testing.bench import median, percentile, progress, redis_server, table

CTX = Context(user="bench-user", tenant="bench-tenant", tool="search")


class NullLedger:
    """Takes every entry and keeps nothing: ledger mode's cost without a ledger's."""

    async def append(self, entry: Any) -> None:
        return None

    async def aclose(self) -> None:
        return None


class OutboxOnlyLedger:
    """The commit point alone: each entry encoded and written to a record log, fsync'd in
    group commits by a Flusher, as KafkaLedger's outbox does, and never shipped."""

    def __init__(self, directory: str, batch_interval: float) -> None:
        self.log = RecordLog(directory, prefix="outbox", batch_interval=batch_interval, mapped=True)
        self.flusher = Flusher(self.log)

        self.ahead: tuple[Any, bytes] | None = None

    def prepare(self, entry: Any) -> None:  # as KafkaLedger: encoded during the round trip
        self.ahead = (entry, encode(entry, "/mcpbg/bench"))

    async def append(self, entry: Any) -> None:
        held, self.ahead = self.ahead, None
        raw = held[1] if held is not None and held[0] is entry else encode(entry, "/mcpbg/bench")
        self.log.append_line(raw)
        self.flusher.notify()

    async def aclose(self) -> None:
        await self.flusher.aclose()
        self.log.close()


def policy() -> Policy:
    return Policy.of(
        Limit("bl_user", cap=MAX_AMOUNT, window=Window.DAY, scope=Scope.USER),
        Limit("bl_user_tool", cap=MAX_AMOUNT, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
        Limit("bl_tenant", cap=MAX_AMOUNT, window=Window.MONTH, scope=Scope.TENANT),
    )


async def timed(gov: Governor, n: int, into: list[float]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        decision = await gov.check(CTX)
        into.append((clock() - t0) / 1000)
        if not decision.admitted:
            raise SystemExit(f"benchmark invalid: a check was refused ({decision.reason})")


async def compare(
    govs: dict[str, Governor], calls: int, rounds: int, chunk: int, phase: str
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in govs}
    for gov in govs.values():  # warm-up: connections, scripts, plan caches
        await timed(gov, 200, [])
    for r in range(rounds):
        order = list(govs)
        done = 0
        while done < calls:
            for name in order:
                await timed(govs[name], chunk, samples[name])
            order.reverse()
            done += chunk
        meds = {n: median(v[-calls:]) for n, v in samples.items()}
        progress(
            f"{phase}: round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {m:.1f} us" for n, m in meds.items())
        )
    return samples


def rows(samples: dict[str, list[float]], base: str) -> list[list[str]]:
    b = median(samples[base])
    out = []
    for name, values in samples.items():
        m = median(values)
        out.append([name, f"{m:.1f}", f"{percentile(values, 99):.1f}", f"{m / b:.2f}x"])
    return out


async def run(
    redis_url: str, bootstrap: str, kafka: Any, args: argparse.Namespace
) -> dict[str, Any]:
    outbox = tempfile.mkdtemp(prefix="mcpbg-bench-outbox-")
    plain = Governor(policy(), RedisBackend.from_url(redis_url, timeout=5.0))
    ledger = KafkaLedger(
        bootstrap,
        topic="bench.ledger",
        outbox_dir=outbox,
        partitions=3,
        linger_ms=args.linger_ms,
        batch_interval=args.batch_interval_ms / 1000,
    )
    with_ledger = Governor(policy(), RedisBackend.from_url(redis_url, timeout=5.0), ledger=ledger)
    # The governor's own share of ledger mode (in-flight charges, an event id and an
    # entry per call) with a ledger that keeps nothing: what no ledger can go below.
    null = Governor(policy(), RedisBackend.from_url(redis_url, timeout=5.0), ledger=NullLedger())
    govs = {"ledger=None": plain, "no-op ledger": null, "KafkaLedger": with_ledger}
    if args.baseline:  # the previous commit path, side by side in the same run
        before = KafkaLedger(
            bootstrap,
            topic="bench.ledger.before",
            outbox_dir=tempfile.mkdtemp(prefix="mcpbg-bench-before-"),
            partitions=3,
            linger_ms=args.linger_ms,
            batch_interval=args.batch_interval_ms / 1000,
            outbox_mapped=False,
        )
        setattr(before, "prepare", None)  # noqa: B010 - no encoding during the round trip
        govs["KafkaLedger, before"] = Governor(
            policy(), RedisBackend.from_url(redis_url, timeout=5.0), ledger=before
        )
    if args.ladder:  # the commit point without the shipping: KafkaLedger's two shares
        only = OutboxOnlyLedger(
            tempfile.mkdtemp(prefix="mcpbg-bench-log-"), ledger._flusher.interval
        )
        govs["outbox only"] = Governor(
            policy(), RedisBackend.from_url(redis_url, timeout=5.0), ledger=only
        )
    up = await compare(govs, args.calls, args.rounds, args.chunk, "broker up")
    await ledger.flush(60)
    result: dict[str, Any] = {"up": up}
    if kafka is not None:
        kafka.kill()
        progress("broker killed: events now spill to the outbox")
        down = await compare(
            {"ledger=None": plain, "KafkaLedger, broker down": with_ledger},
            args.calls,
            args.rounds,
            args.chunk,
            "broker down",
        )
        result["down"] = down
        spilled = ledger.snapshot().spilled
        kafka.restart()
        renice(kafka, args.broker_nice)
        t0 = time.perf_counter()
        drained = await ledger.flush(120)
        result["drain"] = {"spilled": spilled, "seconds": time.perf_counter() - t0, "ok": drained}
        progress(f"broker back: outbox drained={drained} in {result['drain']['seconds']:.1f} s")
    result["stats"] = dataclasses.asdict(ledger.snapshot())
    flusher = ledger._flusher
    result["group_commit"] = {
        "interval_ms": flusher.interval * 1000,
        "fsyncs": flusher.fsyncs,
        "mean_fsync_ms": 1000 * flusher.fsync_seconds / max(flusher.fsyncs, 1),
        "longest_fsync_ms": 1000 * flusher.longest_fsync,
    }
    await with_ledger.aclose()
    await null.aclose()
    await plain.aclose()
    for name in ("outbox only", "KafkaLedger, before"):
        if name in govs:
            await govs[name].aclose()
    return result


def renice(kafka: Any, niceness: int) -> None:
    """Lower the local broker's priority, to approximate a broker on another machine."""
    if kafka is not None and niceness and kafka.pid is not None:
        os.setpriority(os.PRIO_PROCESS, kafka.pid, niceness)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="use this Redis instead of starting one")
    parser.add_argument("--kafka", help="use this bootstrap (host:port); skips the outage phase")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--json", help="write raw results here")
    parser.add_argument("--linger-ms", type=int, default=20, help="KafkaLedger linger_ms")
    parser.add_argument(
        "--batch-interval-ms",
        type=float,
        default=5.0,
        help="KafkaLedger batch_interval: the group-commit window (default 5 ms, the default)",
    )
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="add an 'outbox only' variant: the commit point (encode, write, group "
        "commit) without shipping, to split KafkaLedger's cost in two",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="add 'KafkaLedger, before': the previous commit path (a write() per event, "
        "encoded after the counters' reply), to compare in the same run",
    )
    parser.add_argument(
        "--broker-nice",
        type=int,
        default=0,
        help="renice the local broker (e.g. 19): on a 2-core machine its CPU otherwise "
        "competes with Redis and this process, which a remote broker would not",
    )
    args = parser.parse_args()
    # Memory storage: the benchmark needs no data to survive the restart, and a
    # durable broker here would add its S3 stand-in's CPU to these 2 cores.
    kafka = None if args.kafka else services.start_kafka(prefer_local=True, durable=False)
    renice(kafka, args.broker_nice)
    bootstrap = args.kafka or kafka.bootstrap
    try:
        with redis_server(args.redis) as server:
            result = asyncio.run(run(server.url, bootstrap, kafka, args))
    finally:
        if kafka is not None:
            kafka.stop()
    headers = ["variant", "median us", "p99 us", "ratio (median)"]
    print(f"check() with 3 gated limits, {args.rounds} rounds x {args.calls} calls, interleaved\n")
    print(table(headers, rows(result["up"], "ledger=None"), [False, True, True, True]))
    up = median(result["up"]["KafkaLedger"]) / median(result["up"]["ledger=None"])
    verdict = "MET" if up <= 1.15 else "MISSED"
    print(f"\nTarget: KafkaLedger <= 1.15x ledger=None: {up:.2f}x -> {verdict}")
    null = median(result["up"]["no-op ledger"]) / median(result["up"]["ledger=None"])
    print(f"(ledger mode with a no-op ledger alone: {null:.2f}x)")
    if "KafkaLedger, before" in result["up"]:
        before = median(result["up"]["KafkaLedger, before"]) / median(result["up"]["ledger=None"])
        print(f"(the previous commit path, a write() per event, same run: {before:.2f}x)")
    if "outbox only" in result["up"]:
        only = median(result["up"]["outbox only"]) / median(result["up"]["ledger=None"])
        print(f"(the commit point alone, an outbox that never ships: {only:.2f}x)")
    code = 0 if up <= 1.15 else 1
    g = result["group_commit"]
    print(
        f"Group commit: one fsync at most every {g['interval_ms']:g} ms ({g['fsyncs']} fsyncs, "
        f"mean {g['mean_fsync_ms']:.1f} ms, longest {g['longest_fsync_ms']:.1f} ms): a machine "
        f"crash loses at most the last ~{g['interval_ms'] + g['longest_fsync_ms']:.0f} ms of "
        "events; a killed process loses none"
    )
    if "down" in result:
        print("\nDuring a broker outage (events wait in the outbox)\n")
        print(table(headers, rows(result["down"], "ledger=None"), [False, True, True, True]))
        down = median(result["down"]["KafkaLedger, broker down"]) / median(
            result["down"]["ledger=None"]
        )
        print(
            f"\nTarget: <= 2x during the outage: {down:.2f}x -> {'MET' if down <= 2 else 'MISSED'}"
        )
        d = result["drain"]
        print(
            f"Outbox after the broker came back: {d['spilled']} spilled events shipped in "
            f"{d['seconds']:.1f} s (drained: {d['ok']})"
        )
        code = code or (0 if down <= 2 and d["ok"] else 1)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh)
    return code


if __name__ == "__main__":
    sys.exit(main())
