"""Postgres against Redis, in one run: check() latency, throughput, one hot counter.

- Serial latency: ``check()`` with 3 limits on :class:`PostgresBackend` against one
  ``SELECT 1`` round trip through the same pool (median ratio: one round trip per
  check, whatever the number of limits), and the same pair on Redis (``check()``
  against a no-op EVALSHA). Variants are interleaved in chunks, so drift on a busy
  machine hits them alike.
- Throughput at 64 concurrent callers: checks/s on each store, each caller its own
  user (3 limits: per user, per tenant of 8, per tool), and the baseline round trip
  at 64 callers.
- Each Postgres figure twice: durable commits (the default) and ``durable=False``
  (``synchronous_commit=off``), since the WAL flush of each admitted check's commit
  dominates its cost on most disks.
- Lock contention: 64 concurrent callers on one global counter (every check locks
  the same row), as checks/s, and as a ratio against the spread-out run.

Usage::

    python -m benchmarks.bench_postgres [--postgres URL] [--redis URL] [--calls N]
        [--rounds R] [--concurrent-calls N] [--json out.json]

Without ``--postgres`` the run uses the local server (127.0.0.1:5432) or starts one
with initdb, in a scratch database dropped at the end; without ``--redis`` a
throwaway redis-server is started. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from mcp_budget_governor import (
    MAX_AMOUNT,
    Backend,
    Context,
    Governor,
    Limit,
    Policy,
    PostgresBackend,
    RedisBackend,
    Scope,
    Window,
)
from testing import bench
from testing.postgres import find_postgres, scratch_database

CALLERS = 64


def three_limits(rid: str) -> Policy:
    return Policy.of(
        Limit(f"b{rid}_user", cap=MAX_AMOUNT, window=Window.DAY, scope=Scope.USER),
        Limit(f"b{rid}_tenant", cap=MAX_AMOUNT, window=Window.MONTH, scope=Scope.TENANT),
        Limit(f"b{rid}_tool", cap=MAX_AMOUNT, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    )


def one_global(rid: str) -> Policy:
    return Policy.of(Limit(f"b{rid}_global", cap=MAX_AMOUNT, window=Window.DAY))


def ctx(i: int) -> Context:
    return Context(user=f"u{i}", tenant=f"t{i % 8}", tool="search")


async def serial(
    pairs: dict[str, tuple[Callable[[], Awaitable[Any]], Callable[[], Awaitable[Any]]]],
    rounds: int,
    calls: int,
    chunk: int = 50,
) -> dict[str, dict[str, float]]:
    """Median latency of (baseline, check) per store, interleaved; the ratio of medians."""
    samples: dict[str, list[list[int]]] = {f"{s}:{w}": [] for s in pairs for w in ("base", "check")}
    clock = time.perf_counter_ns
    for base, check in pairs.values():  # warm: connections, scripts, plans
        for _ in range(200):
            await base()
            await check()
    for r in range(rounds):
        for name in samples:
            samples[name].append([])
        done = 0
        while done < calls:
            for store, (base, check) in pairs.items():
                for which, call in (("base", base), ("check", check)):
                    into = samples[f"{store}:{which}"][r]
                    for _ in range(chunk):
                        t0 = clock()
                        await call()
                        into.append(clock() - t0)
            done += chunk
        ratios = {
            s: bench.median(samples[f"{s}:check"][r]) / bench.median(samples[f"{s}:base"][r])
            for s in pairs
        }
        shown = ", ".join(f"{s} {x:.2f}x" for s, x in ratios.items())
        bench.progress(f"serial round {r + 1}/{rounds}: {shown}")
    out = {}
    for store in pairs:
        base_all = [x for s in samples[f"{store}:base"] for x in s]
        check_all = [x for s in samples[f"{store}:check"] for x in s]
        out[store] = {
            "baseline_median_us": bench.median(base_all) / 1000,
            "check_median_us": bench.median(check_all) / 1000,
            "ratio_median": bench.median(check_all) / bench.median(base_all),
            "per_round_ratio": [
                bench.median(c) / bench.median(b)
                for c, b in zip(samples[f"{store}:check"], samples[f"{store}:base"], strict=True)
            ],
        }
    return out


async def throughput(call: Callable[[int], Awaitable[Any]], total: int) -> float:
    """Calls/s of ``CALLERS`` concurrent callers making ``total`` calls between them."""
    each = total // CALLERS

    async def caller(i: int) -> None:
        for _ in range(each):
            await call(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(CALLERS)))
    return each * CALLERS / (time.perf_counter() - t0)


@contextlib.contextmanager
def postgres_database(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with find_postgres() as server, scratch_database(server, "mcpbg_bench") as db:
        yield db


async def run(args: argparse.Namespace, pg_url: str, redis_url: str) -> dict[str, Any]:
    rid = bench.run_id()
    pg = PostgresBackend.from_url(pg_url, timeout=30.0, max_connections=CALLERS // 2)
    await pg.migrate()
    # The same, committing without waiting for the WAL flush (durable=False).
    fast = PostgresBackend.from_url(
        pg_url, timeout=30.0, max_connections=CALLERS // 2, durable=False
    )
    await fast.migrate()
    red = RedisBackend.from_url(redis_url, timeout=5.0, max_connections=CALLERS)
    noop = bench.noop(red.client)

    async def select1() -> Any:
        return await pg._call("SELECT 1", ())  # the pool's round trip, nothing else

    async def select1_fast() -> Any:
        return await fast._call("SELECT 1", ())

    stores: dict[str, Backend] = {"postgres": pg, "postgres-async-commit": fast, "redis": red}
    baselines: dict[str, Callable[[], Awaitable[Any]]] = {
        "postgres": select1, "postgres-async-commit": select1_fast, "redis": noop,
    }  # fmt: skip
    govs = {s: Governor(three_limits(rid), b) for s, b in stores.items()}
    hot = {s: Governor(one_global(rid), b) for s, b in stores.items()}
    c0 = ctx(0)
    pairs = {s: (baselines[s], lambda s=s: govs[s].check(c0)) for s in stores}
    results: dict[str, Any] = {"serial": await serial(pairs, args.rounds, args.calls)}
    n = args.concurrent_calls
    conc: dict[str, Any] = {}
    for store in stores:
        base = baselines[store]
        gov, hot_gov = govs[store], hot[store]
        conc[store] = {
            "baseline_per_s": await throughput(lambda i, base=base: base(), n),
            "check_per_s": await throughput(lambda i, gov=gov: gov.check(ctx(i)), n),
            "hot_global_per_s": await throughput(lambda i, g=hot_gov: g.check(ctx(i)), n),
        }
        conc[store]["hot_vs_spread"] = conc[store]["hot_global_per_s"] / conc[store]["check_per_s"]
        bench.progress(f"{CALLERS} callers, {store}: {conc[store]}")
    redis_rate = conc["redis"]["check_per_s"]
    conc["postgres_vs_redis_checks"] = conc["postgres"]["check_per_s"] / redis_rate
    results["concurrent"] = conc
    for gov in (*govs.values(), *hot.values()):
        with contextlib.suppress(Exception):
            await gov.aclose()
    await pg.aclose()
    await fast.aclose()
    await red.aclose()
    bench.cleanup(redis_url, [f"mcpbg:v1:b{rid}_*"])
    return results


def render(results: dict[str, Any]) -> str:
    rows = []
    for store, r in results["serial"].items():
        lo, hi = min(r["per_round_ratio"]), max(r["per_round_ratio"])
        rows.append([
            store, "noop EVALSHA" if store == "redis" else "SELECT 1",
            f"{r['baseline_median_us']:.0f}", f"{r['check_median_us']:.0f}",
            f"{r['ratio_median']:.2f}x", f"{lo:.2f}-{hi:.2f}x",
        ])  # fmt: skip
    serial = bench.table(
        ["store", "baseline", "baseline us", "check() 3 limits us", "ratio (median)", "per round"],
        rows, [False, False, True, True, True, True],
    )  # fmt: skip
    conc = results["concurrent"]
    rows = [
        [
            s, f"{conc[s]['baseline_per_s']:.0f}", f"{conc[s]['check_per_s']:.0f}",
            f"{conc[s]['hot_global_per_s']:.0f}", f"{conc[s]['hot_vs_spread']:.2f}x",
        ]
        for s in ("postgres", "postgres-async-commit", "redis")
    ]  # fmt: skip
    table = bench.table(
        ["store", "baseline/s", "check()/s (64 users)", "check()/s (1 hot global)", "hot/spread"],
        rows, [False, True, True, True, True],
    )  # fmt: skip
    return (
        f"serial latency\n{serial}\n\n{CALLERS} concurrent callers\n{table}\n"
        f"postgres/redis check throughput: {conc['postgres_vs_redis_checks']:.2f}x\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--postgres", default=None, help="postgresql:// URL (default: local)")
    parser.add_argument("--redis", default=None, help="redis:// URL (default: a local one)")
    parser.add_argument("--calls", type=int, default=1000, help="serial calls per variant/round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent-calls", type=int, default=6400)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    with postgres_database(args.postgres) as pg_url, bench.redis_server(args.redis) as server:
        results = asyncio.run(run(args, pg_url, server.url))
        results["environment"] = bench.environment(server.url, server.origin)
    print(render(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
