"""Concurrency demonstration: 500 concurrent calls against a cap of 50.

Every path gets the same burst (``asyncio.gather`` of ``--calls`` checks from
one process, a fresh counter per burst):

- **lua**: ``Governor.check`` (one EVALSHA of ``charge.lua`` per call). It
  must admit exactly ``--cap``, whatever the pool size.
- **naive**: GET, compare in Python, then INCRBY + EXPIRE, each awaited, so
  other tasks run between the read and the write. Every task that read the
  counter before the first writes landed sees room and is admitted.

Each path runs on the governor's pool (``RedisBackend.from_url`` default: 64
connections, blocking; at most 64 reads are in flight, which bounds the naive
damage at about 64 per process) and on a pool as large as the burst (every
read goes out at once, as it would from many replicas).

Usage::

    python -m benchmarks.bench_concurrency [--redis URL] [--calls 500] [--cap 50]
        [--price 0.05] [--trials 5] [--json out.json]

Without ``--redis`` a throwaway local redis-server is started and stopped.
``bench_check.py`` runs this too, after the latency benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Window
from testing import bench

PATHS = {
    "lua_pool64": "Lua: Governor.check, governor's pool (64, blocking)",
    "lua_wide": "Lua: Governor.check, pool as large as the burst",
    "naive_pool64": "naive GET/INCR, governor's pool (64, blocking)",
    "naive_wide": "naive GET/INCR, pool as large as the burst",
}


async def _lua_burst(gov: Governor, ctx: Context, calls: int) -> dict[str, int]:
    decisions = await asyncio.gather(*(gov.check(ctx) for _ in range(calls)))
    (limit,) = gov.policy.limits
    return {
        "admitted": sum(1 for d in decisions if d.admitted),
        "degraded": sum(1 for d in decisions if d.degraded),
        "counter": await gov.usage(limit.name, ctx),
    }


async def _naive_burst(client: Any, policy: Policy, ctx: Context, calls: int) -> dict[str, int]:
    from mcp_budget_governor import planning

    now = time.time()
    results = await asyncio.gather(
        *(bench.naive_check(client, policy, ctx, now) for _ in range(calls))
    )
    (s,) = planning.check_slots(policy, ctx, now)
    return {"admitted": sum(results), "degraded": 0, "counter": int(await client.get(s.key) or 0)}


async def _trial(url: str, rid: str, trial: int, calls: int, cap: int) -> dict[str, dict[str, int]]:
    def policy(path: str) -> Policy:
        name = f"bench_{rid}_cc_{path.replace('_', '')}"
        return Policy.of(Limit(name, cap=cap, window=Window.DAY, scope=Scope.USER))

    ctx = Context(user=f"burst{trial}")
    wide = max(calls, 64)
    # The governor's default pool: 64 connections, callers queue for one.
    narrow = RedisBackend.from_url(url, timeout=5.0)
    # A pool as large as the burst: every call's first command goes out at once,
    # as it would from many replicas. (redis-py's own default async pool holds
    # 100 connections and raises MaxConnectionsError beyond that.)
    broad = RedisBackend.from_url(url, timeout=5.0, max_connections=wide)
    govs = {
        "lua_pool64": Governor(policy("lua_pool64"), narrow),
        "lua_wide": Governor(policy("lua_wide"), broad),
    }
    out: dict[str, dict[str, int]] = {}
    try:
        for backend in (narrow, broad):  # connect before the start line
            noop = bench.noop(backend.client)
            await asyncio.gather(*(noop() for _ in range(64)))
        for path, gov in govs.items():
            out[path] = await _lua_burst(gov, ctx, calls)
        out["naive_pool64"] = await _naive_burst(narrow.client, policy("naive64"), ctx, calls)
        out["naive_wide"] = await _naive_burst(broad.client, policy("naivewide"), ctx, calls)
    finally:
        await narrow.aclose()
        await broad.aclose()
    return out


async def run(
    url: str, rid: str, *, calls: int, cap: int, trials: int
) -> list[dict[str, dict[str, int]]]:
    return [await _trial(url, rid, t, calls, cap) for t in range(trials)]


def _span(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values)}


def summarize(
    trials: list[dict[str, dict[str, int]]], *, calls: int, cap: int, price: float
) -> dict[str, Any]:
    expected = min(calls, cap)
    out: dict[str, Any] = {
        "calls": calls,
        "cap": cap,
        "price_per_call_usd": price,
        "budget_usd": cap * price,
        "trials": trials,
        "lua_exact": all(
            t[p]["admitted"] == expected == t[p]["counter"] and not t[p]["degraded"]
            for t in trials
            for p in PATHS
            if p.startswith("lua")
        ),
        "paths": {},
    }
    for path, label in PATHS.items():
        admitted = [t[path]["admitted"] for t in trials]
        out["paths"][path] = {
            "label": label,
            "admitted": _span(admitted),
            "spend_usd": _span([a * price for a in admitted]),
            "overspend_usd": _span([max(0, a - cap) * price for a in admitted]),
        }
    return out


def _range(span: dict[str, float], fmt: str) -> str:
    lo, hi = fmt.format(span["min"]), fmt.format(span["max"])
    return lo if lo == hi else f"{lo}-{hi}"


def report(summary: dict[str, Any]) -> str:
    calls, cap, price = summary["calls"], summary["cap"], summary["price_per_call_usd"]
    headers = ["path", "admitted", "spend", "over budget", "worst x cap"]
    rows = [
        [
            p["label"],
            _range(p["admitted"], "{:.0f}"),
            _range(p["spend_usd"], "${:,.2f}"),
            _range(p["overspend_usd"], "${:,.2f}"),
            f"{p['admitted']['max'] / cap:.1f}x",
        ]
        for p in summary["paths"].values()
    ]
    trials = len(summary["trials"])
    verdict = "YES" if summary["lua_exact"] else "NO  <-- invariant broken"
    return "\n".join(
        [
            f"Concurrency: {calls} concurrent calls (asyncio.gather, one process), cap {cap}, "
            f"${price:.2f}/call, budget ${cap * price:,.2f}; {trials} bursts per path "
            "(ranges are min-max over bursts)",
            bench.table(headers, rows, [False, True, True, True, True]),
            f"Lua admitted exactly {min(calls, cap)} in every burst, counter reads "
            f"{min(calls, cap)}, nothing degraded: {verdict}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: start a throwaway local server)")
    parser.add_argument("--calls", type=int, default=500, help="concurrent calls per burst")
    parser.add_argument("--cap", type=int, default=50, help="the limit's cap (calls per day)")
    parser.add_argument("--price", type=float, default=0.05, help="USD per call")
    parser.add_argument("--trials", type=int, default=5, help="bursts per path")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)

    rid = bench.run_id()
    with bench.redis_server(args.redis) as server:
        env = bench.environment(server.url, server.origin)
        try:
            trials = asyncio.run(
                run(server.url, rid, calls=args.calls, cap=args.cap, trials=args.trials)
            )
        finally:
            bench.cleanup(server.url, [f"mcpbg:v1:bench_{rid}_*"])
    summary = summarize(trials, calls=args.calls, cap=args.cap, price=args.price)
    print(report(summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "concurrency": summary}, fh, indent=2)
        bench.progress(f"wrote {args.json}")
    return 0 if summary["lua_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
