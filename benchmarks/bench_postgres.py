"""Postgres check() against its floors, in one run, every figure a ratio (issue 31).

- Serial latency, 3 limits, every setting at its default: ``check()`` against one
  durable one-row upsert (``INSERT ... ON CONFLICT DO UPDATE``: one round trip and
  one WAL flush, the least a durable check can cost) and against ``SELECT 1``;
  with ``durable=False`` (``synchronous_commit=off``) against ``SELECT 1``. All
  through the backend's own pool and call path. Variants are interleaved in chunks,
  so drift on a busy machine hits them alike; ratios are of medians, per round too.
- 64 concurrent callers in one process: ``check()`` (each caller its own user; per
  user, per tenant of 8, per tool) against 64 callers doing ``SELECT 1`` through a
  pool of the same size (the default, 5), and how many checks the fail mode or a
  busy refusal decided (the target: none).
- One hot counter (every check on one global counter) against the spread run.
- Python against TypeScript: ``ts/bench/postgres.ts`` on the same database, its
  ``check()``/``SELECT 1`` ratio beside Python's (skipped, and said so, where Node or
  ts/'s dependencies are missing).

Usage::

    python -m benchmarks.bench_postgres [--postgres URL] [--calls N] [--rounds R]
        [--concurrent-calls N] [--no-typescript] [--json out.json]

Without ``--postgres`` the run uses the local server (127.0.0.1:5432) or starts one
with initdb, in a scratch database dropped at the end. Progress goes to stderr,
results to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg

from mcp_budget_governor import (
    MAX_AMOUNT,
    Context,
    Decision,
    Governor,
    Limit,
    Policy,
    PostgresBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.integrations.flow import governed_call
from testing import bench
from testing.postgres import find_postgres, scratch_database

CALLERS = 64
_FLOOR_TABLE = "CREATE TABLE IF NOT EXISTS mcpbg_bench_floor (k text PRIMARY KEY, v bigint)"
_UPSERT = (
    "INSERT INTO mcpbg_bench_floor AS t (k, v) VALUES (%s, 1) "
    "ON CONFLICT (k) DO UPDATE SET v = t.v + 1 RETURNING v"
)


def three_limits(rid: str) -> Policy:
    return Policy.of(
        Limit(f"b{rid}_user", cap=MAX_AMOUNT, window=Window.DAY, scope=Scope.USER),
        Limit(f"b{rid}_tenant", cap=MAX_AMOUNT, window=Window.MONTH, scope=Scope.TENANT),
        Limit(f"b{rid}_tool", cap=MAX_AMOUNT, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    )


def priced_limits(rid: str) -> Policy:
    """:func:`three_limits` and a spend limit that a tool's fixed price is charged to."""
    spend = Limit(f"b{rid}_spend", cap=MAX_AMOUNT, window=Window.DAY, unit=Unit.USD_MICROS)
    return Policy.of(*three_limits(rid).limits, spend)


def one_global(rid: str) -> Policy:
    return Policy.of(Limit(f"b{rid}_global", cap=MAX_AMOUNT, window=Window.DAY))


def ctx(i: int) -> Context:
    return Context(user=f"u{i}", tenant=f"t{i % 8}", tool="search")


async def serial(
    variants: dict[str, Callable[[], Awaitable[Any]]], rounds: int, calls: int, chunk: int = 50
) -> dict[str, list[list[int]]]:
    """Per variant and round, each call's latency (ns), the variants interleaved in chunks."""
    samples: dict[str, list[list[int]]] = {name: [] for name in variants}
    clock = time.perf_counter_ns
    for call in variants.values():  # warm: connections, plans, compiled functions
        for _ in range(200):
            await call()
    for r in range(rounds):
        for name in samples:
            samples[name].append([])
        done = 0
        order = list(variants.items())
        while done < calls:
            for name, call in order:
                into = samples[name][r]
                for _ in range(chunk):
                    t0 = clock()
                    await call()
                    into.append(clock() - t0)
            order.reverse()  # alternate which goes first
            done += chunk
        bench.progress(f"serial round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {bench.median(s[r]) / 1000:.0f}us" for n, s in samples.items()
        ))  # fmt: skip
    return samples


def ratio(samples: dict[str, list[list[int]]], num: str, den: str) -> dict[str, Any]:
    """``num``'s median over ``den``'s: over every sample, and per round."""
    everything = {n: [x for r in s for x in r] for n, s in samples.items()}
    return {
        "ratio_median": bench.median(everything[num]) / bench.median(everything[den]),
        "per_round": [
            bench.median(a) / bench.median(b)
            for a, b in zip(samples[num], samples[den], strict=True)
        ],
        f"{num}_us": bench.median(everything[num]) / 1000,
        f"{den}_us": bench.median(everything[den]) / 1000,
    }


async def throughput(call: Callable[[int], Awaitable[Any]], total: int) -> tuple[float, list[Any]]:
    """Calls/s of ``CALLERS`` concurrent callers making ``total`` calls between them,
    and what the calls returned."""
    each = total // CALLERS
    out: list[Any] = []

    async def caller(i: int) -> None:
        for _ in range(each):
            out.append(await call(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(CALLERS)))
    return each * CALLERS / (time.perf_counter() - t0), out


def not_by_postgres(decisions: list[Decision]) -> int:
    """Checks decided by the fail mode (degraded) or refused as busy (503)."""
    return sum(1 for d in decisions if d.degraded or d.status == 503)


@contextlib.contextmanager
def postgres_database(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with find_postgres() as server, scratch_database(server, "mcpbg_bench") as db:
        yield db


async def run(args: argparse.Namespace, pg_url: str) -> dict[str, Any]:
    rid = bench.run_id()
    pg = PostgresBackend.from_url(pg_url)  # every default
    await pg.migrate()
    fast = PostgresBackend.from_url(pg_url, durable=False)
    await fast.migrate()
    async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
        await conn.execute(_FLOOR_TABLE)
    floor_key = f"floor-{rid}"

    async def select1() -> Any:
        return await pg._call("SELECT 1", ())  # the pool's round trip, nothing else

    async def select1_fast() -> Any:
        return await fast._call("SELECT 1", ())

    async def upsert() -> Any:
        return await pg._call(_UPSERT, (floor_key,))

    gov = Governor(three_limits(rid), pg)
    gov_fast = Governor(three_limits(rid), fast)
    c0 = ctx(0)
    # A governed call with a fixed price (issue 33): charged with its admission, one
    # round trip, against the same call with the price metered after it (the path
    # before sql/0010, and what a store without prices_at_admission still takes).
    after = PostgresBackend.from_url(pg_url)
    after.prices_at_admission = False
    gov_priced = Governor(priced_limits(rid), pg)
    gov_after = Governor(priced_limits(rid), after)
    price = {f"b{rid}_spend": 100}  # $0.0001

    async def tool() -> str:
        return "ok"

    samples = await serial(
        {
            "select1": select1,
            "upsert": upsert,
            "check": lambda: gov.check(c0),
            "select1_fast": select1_fast,
            "check_fast": lambda: gov_fast.check(c0),
            "priced": lambda: governed_call(gov_priced, c0, tool, fixed=price),
            "priced_after": lambda: governed_call(gov_after, c0, tool, fixed=price),
        },
        args.rounds,
        args.calls,
    )
    results: dict[str, Any] = {
        "serial": {
            "durable_check_vs_upsert": ratio(samples, "check", "upsert"),
            "durable_check_vs_select1": ratio(samples, "check", "select1"),
            "upsert_vs_select1": ratio(samples, "upsert", "select1"),
            "fast_check_vs_select1": ratio(samples, "check_fast", "select1_fast"),
            "priced_after_vs_admission": ratio(samples, "priced_after", "priced"),
        }
    }
    n = args.concurrent_calls
    conc: dict[str, Any] = {"pool_size": pg.max_connections}
    hot = Governor(one_global(rid), pg)
    for name, backend, g in (("durable", pg, gov), ("durable=False", fast, gov_fast)):
        base_rate, _ = await throughput(lambda i, b=backend: b._call("SELECT 1", ()), n)
        rate, decisions = await throughput(lambda i, g=g: g.check(ctx(i)), n)
        conc[name] = {
            "select1_per_s": base_rate,
            "check_per_s": rate,
            "ratio": rate / base_rate,
            "not_decided_by_postgres": not_by_postgres(decisions),
        }
        bench.progress(f"{CALLERS} callers, {name}: {conc[name]}")
    hot_rate, hot_decisions = await throughput(lambda i: hot.check(ctx(i)), n)
    conc["hot"] = {
        "check_per_s": hot_rate,
        "vs_spread": hot_rate / conc["durable"]["check_per_s"],
        "not_decided_by_postgres": not_by_postgres(hot_decisions),
    }
    bench.progress(f"{CALLERS} callers, one hot counter: {conc['hot']}")
    results["concurrent"] = conc
    for g in (gov, gov_fast, hot, gov_priced, gov_after):
        with contextlib.suppress(Exception):
            await g.aclose()
    await pg.aclose()
    await fast.aclose()
    return results


def typescript(pg_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """ts/bench/postgres.ts on the same database, both commit modes; why not, if not."""
    try:
        from testing.node import typescript_postgres_bench

        return {
            "durable": typescript_postgres_bench(pg_url, calls=args.calls, rounds=args.rounds),
            "durable=False": typescript_postgres_bench(
                pg_url, calls=args.calls, rounds=args.rounds, durable=False
            ),
        }
    except Exception as exc:  # no Node, no ts/ dependencies: the row says so
        return {"skipped": str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)}


def render(results: dict[str, Any]) -> str:
    s = results["serial"]

    def row(label: str, r: dict[str, Any], target: str) -> list[str]:
        lo, hi = min(r["per_round"]), max(r["per_round"])
        return [label, f"{r['ratio_median']:.2f}x", f"{lo:.2f}-{hi:.2f}x", target]

    rows = [
        row("check() durable / one durable upsert", s["durable_check_vs_upsert"], "<= 1.5x"),
        row("check() durable=False / SELECT 1", s["fast_check_vs_select1"], "<= 2x"),
        row("check() durable / SELECT 1", s["durable_check_vs_select1"], "-"),
        row("one durable upsert / SELECT 1", s["upsert_vs_select1"], "-"),
        row("fixed-price call: metered after / charged with its admission",
            s["priced_after_vs_admission"], "-"),
    ]  # fmt: skip
    us = {
        "SELECT 1": s["durable_check_vs_select1"]["select1_us"],
        "upsert": s["durable_check_vs_upsert"]["upsert_us"],
        "check()": s["durable_check_vs_upsert"]["check_us"],
        "check() durable=False": s["fast_check_vs_select1"]["check_fast_us"],
    }
    serial = bench.table(
        ["serial, 3 limits, defaults", "ratio (median)", "per round", "target"],
        rows, [False, True, True, False],
    )  # fmt: skip
    c = results["concurrent"]
    conc_rows = [
        [name, f"{c[name]['select1_per_s']:.0f}", f"{c[name]['check_per_s']:.0f}",
         f"{c[name]['ratio']:.2f}x", str(c[name]["not_decided_by_postgres"])]
        for name in ("durable", "durable=False")
    ]  # fmt: skip
    conc = bench.table(
        ["64 callers", "SELECT 1/s", "check()/s", "ratio (>= 1.0x)", "fail mode or busy"],
        conc_rows, [False, True, True, True, True],
    )  # fmt: skip
    hot = c["hot"]
    ts = results.get("typescript", {})
    if "skipped" in ts or not ts:
        ts_line = f"Python vs TypeScript: not measured ({ts.get('skipped', 'not asked')})"
    else:
        py = s["durable_check_vs_select1"]["ratio_median"]
        pyf = s["fast_check_vs_select1"]["ratio_median"]
        ts_line = (
            "Python vs TypeScript, check()/SELECT 1 on each side: "
            f"durable {py:.2f}x vs {ts['durable']['ratio']:.2f}x "
            f"({s['durable_check_vs_select1']['check_us']:.0f} vs "
            f"{ts['durable']['check_us']:.0f} us); durable=False {pyf:.2f}x vs "
            f"{ts['durable=False']['ratio']:.2f}x"
        )
    return (
        f"{serial}\n"
        + "medians: "
        + ", ".join(f"{k} {v:.0f} us" for k, v in us.items())
        + "\n\n"
        + f"{conc}\n(pool of {c['pool_size']} connections on both sides)\n"
        + f"one hot counter: {hot['check_per_s']:.0f} checks/s, {hot['vs_spread']:.2f}x the "
        + f"spread run, {hot['not_decided_by_postgres']} by fail mode or busy\n"
        + ts_line
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--postgres", default=None, help="postgresql:// URL (default: local)")
    parser.add_argument("--calls", type=int, default=1000, help="serial calls per variant/round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrent-calls", type=int, default=6400)
    parser.add_argument("--no-typescript", action="store_true", help="skip the Node figures")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args(argv)
    with postgres_database(args.postgres) as pg_url:
        results = asyncio.run(run(args, pg_url))
        if not args.no_typescript:
            results["typescript"] = typescript(pg_url, args)
    results["environment"] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg": bench.loadavg(),
    }
    print(render(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
