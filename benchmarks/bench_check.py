"""Latency of ``Governor.check()`` against one no-op EVALSHA, and against the naive path.

Variants, all through the same redis-py async client (one pool) on the same Redis:

- ``noop EVALSHA``: one EVALSHA of ``testing/noop.lua`` (``bench.noop``),
  the floor for any check that makes one round trip. The baseline.
- ``check() 1/3/5 limits``: ``await governor.check(ctx)``, inline mode
  (ledger=None), CALLS limits with caps that never refuse.
- ``naive 1/3/5 limits``: per limit GET and compare in Python, then per limit
  INCRBY + EXPIRE: 3 awaited round trips per limit (what ``charge.lua`` does in one).
- ``check() 3 limits, coalescing off``: the same check through the client's
  pool (``RedisBackend(coalesce=False)``): one caller's cost of coalescing.
- ``noop EVALSHA, bare socket``: the no-op EVALSHA over the backend's own
  asyncio connection (``autopipe.Pipe``), the floor of a round trip from Python.
- ``charge.lua alone, bare socket``: the 3-limit check's very charge command,
  packed once (a fresh operation id spliced in per call), on that connection:
  the script's cost with no governor code.
- ``floor: charge's commands, bare socket``: the same bytes to
  ``testing/charge_floor.lua``, which makes charge.lua's Redis commands with
  none of its logic (``tests/test_charge_floor.py``): what the work costs.

Then, unless ``--no-concurrency``: 64 concurrent callers of ``check()`` (3
limits) against 64 concurrent callers of the no-op EVALSHA on the same
client, as rates (calls/s), interleaved trials, beside the same checks on a
backend that sends each alone (charge.lua, no charge_many.lua), with Redis'
time a check for both; and the 500-call demo.

Variants are interleaved: each round runs ``--calls`` calls of every variant in
chunks of ``--chunk``, rotating the order, so drift on a busy machine hits all
variants alike. Each call is timed on its own with ``perf_counter_ns``.

Usage::

    python -m benchmarks.bench_check [--redis URL] [--calls N] [--rounds R]
        [--json out.json] [--no-concurrency] [--profile]

Without ``--redis`` a throwaway local redis-server is started and stopped.
With ``--redis`` only this run's keys are touched, and deleted at the end.
Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import io
import json
import pstats
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from benchmarks import bench_concurrency
from mcp_budget_governor import (
    MAX_AMOUNT,
    Context,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Window,
)
from mcp_budget_governor.counters import Charge
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.projections.counters.autopipe import pack
from testing import bench

TARGET_RATIO = 1.3  # issue 15: check() with 3 gated limits <= 1.3x one no-op EVALSHA (median)
LONE_TARGET = 1.05  # one caller with coalescing on <= 1.05x off
CONCURRENT_TARGET = 3.0  # 64 concurrent check() >= 3x the rate of 64 concurrent no-op EVALSHAs
CALLERS = 64
CAP = MAX_AMOUNT  # never refuses


def limits(rid: str, kind: str) -> list[Limit]:
    """Five CALLS limits over different scopes and windows; checks use the first 1, 3 or 5."""
    spec: list[tuple[str, Any, Window]] = [
        ("user_day", Scope.USER, Window.DAY),
        ("user_tool_hour", (Scope.USER, Scope.TOOL), Window.HOUR),
        ("tenant_month", Scope.TENANT, Window.MONTH),
        ("agent_day", Scope.AGENT, Window.DAY),
        ("global_hour", None, Window.HOUR),
    ]
    return [
        Limit(f"bench_{rid}_{kind}_{name}", cap=CAP, window=window, scope=scope)
        for name, scope, window in spec
    ]


CTX = Context(user="u_bench", tenant="t_bench", tool="search", agent="a_bench")


@dataclass
class Variant:
    name: str
    round_trips: str
    short: str
    call: Callable[[], Awaitable[Any]]
    ok: Callable[[Any], bool]
    samples: list[list[int]] = field(default_factory=list)  # ns, one list per round
    bad: int = 0


FLOOR = bench.REPO / "testing" / "charge_floor.lua"


def _charged(reply: Any) -> bool:
    return isinstance(reply, list) and int(reply[0]) == 0


def build_variants(backend: RedisBackend, rid: str) -> list[Variant]:
    gov_limits = limits(rid, "gov")
    naive_limits = limits(rid, "naive")
    client = backend.client
    out = [Variant("noop EVALSHA", "1", "noop", bench.noop(client), lambda r: int(r) == 1)]
    pipe_backend = RedisBackend.from_url(backend_url(backend), timeout=5.0)
    noop_sha = bench.noop(client).sha
    raw = pack(["EVALSHA", noop_sha, 0])
    out.append(
        Variant(
            "noop EVALSHA, bare socket",
            "1",
            "bare",
            lambda: pipe_backend._pipe().call(raw),
            lambda r: int(r) == 1,
        )
    )
    # The 3-limit check's charge as bytes on the bare socket (a fresh operation id
    # spliced into one packed command per call), to charge.lua and to
    # testing/charge_floor.lua (its very Redis commands, no logic): what the
    # script costs, and what the work itself costs, with no governor code.
    gov3 = Governor(Policy.of(*gov_limits[:3]), backend)
    ops = gov3._plan(CTX, time.time()).ops
    placeholder = new_id()
    args = backend.charge_args(Charge(ops, op_id=placeholder))
    floor_sha = hashlib.sha1(FLOOR.read_bytes()).hexdigest()
    for name, short, sha, ok in (
        ("charge.lua alone, bare socket", "chargebare", backend._charge.sha, _charged),
        ("floor: charge's commands, bare socket", "floorbare", floor_sha, _charged),
    ):
        packed = pack(["EVALSHA", sha, *args])
        out.append(
            Variant(
                name,
                "1",
                short,
                lambda packed=packed: pipe_backend._pipe().call(
                    packed.replace(placeholder.encode(), new_id().encode())
                ),
                ok,
            )
        )
    for n in (1, 3, 5):
        gov = Governor(Policy.of(*gov_limits[:n]), backend)
        out.append(
            Variant(
                f"check() {n} limit{'s' if n > 1 else ''}",
                "1",
                f"check{n}",
                lambda gov=gov: gov.check(CTX),
                lambda d: d.admitted and not d.degraded,
            )
        )
    off = RedisBackend(client, coalesce=False)
    gov_off = Governor(Policy.of(*gov_limits[:3]), off)
    out.append(
        Variant(
            "check() 3 limits, coalescing off",
            "1",
            "check3off",
            lambda: gov_off.check(CTX),
            lambda d: d.admitted and not d.degraded,
        )
    )
    for n in (1, 3, 5):
        policy = Policy.of(*naive_limits[:n])
        out.append(
            Variant(
                f"naive {n} limit{'s' if n > 1 else ''}",
                str(3 * n),
                f"naive{n}",
                lambda policy=policy: bench.naive_check(client, policy, CTX, time.time()),
                bool,
            )
        )
    return out


def backend_url(backend: RedisBackend) -> str:
    kw = backend.client.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


async def rates(backend: RedisBackend, rid: str, *, per_caller: int, trials: int) -> dict[str, Any]:
    """Calls per second of ``CALLERS`` concurrent callers: check() (3 limits) on the
    backend, and the no-op EVALSHA on the same client (its pool), interleaved; and
    check() on a second backend that sends each check as its own charge.lua call
    (``alone``: the same backend before charge_many.lua), with Redis' own time a
    check (INFO commandstats) for both."""
    gov = Governor(Policy.of(*limits(rid, "conc")[:3]), backend)
    noop = bench.noop(backend.client)
    single = RedisBackend.from_url(backend_url(backend), timeout=5.0)
    # Never loads charge_many.lua (as if Redis refused it): one EVALSHA a check.
    single._many_not_before = float("inf")
    gov_alone = Governor(Policy.of(*limits(rid, "conc")[:3]), single)

    async def noop_call() -> Any:
        return await noop()

    async def check_call() -> Any:
        return await gov.check(CTX)

    async def alone_call() -> Any:
        return await gov_alone.check(CTX)

    async def evalsha_usec() -> float:
        st = (await backend.client.info("commandstats")).get("cmdstat_evalsha", {})
        return float(st.get("usec", 0))

    cpu: dict[str, list[float]] = {"noop": [], "check": [], "alone": []}
    server: dict[str, list[float]] = {"check": [], "alone": []}

    async def rate(call: Callable[[], Awaitable[Any]], name: str = "") -> float:
        async def caller() -> None:
            for _ in range(per_caller):
                await call()

        u0 = await evalsha_usec() if name in server else 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(caller() for _ in range(CALLERS)))
        elapsed, used = time.perf_counter() - t0, time.process_time() - c0
        calls = CALLERS * per_caller
        if name:  # this process's CPU a call (Redis' is the server's own)
            cpu[name].append(used / calls * 1e6)
        if name in server:
            server[name].append((await evalsha_usec() - u0) / calls)
        return calls / elapsed

    try:
        await rate(noop_call)
        await rate(check_call)  # warm: connections, scripts
        await rate(alone_call)
        got: dict[str, list[float]] = {"noop": [], "check": [], "alone": []}
        for t in range(trials):
            order = [("noop", noop_call), ("check", check_call), ("alone", alone_call)]
            for name, call in order[t % 3 :] + order[: t % 3]:
                got[name].append(await rate(call, name))
    finally:
        await single.aclose()
    ratios = [c / n for c, n in zip(got["check"], got["noop"], strict=True)]
    alone = [c / n for c, n in zip(got["alone"], got["noop"], strict=True)]
    return {
        "callers": CALLERS,
        "per_caller": per_caller,
        "noop_per_s": got["noop"],
        "check_per_s": got["check"],
        "alone_per_s": got["alone"],
        "ratios": ratios,
        "ratio_median": bench.median(ratios),
        "ratio_worst": min(ratios),
        "alone_ratio_median": bench.median(alone),
        "alone_ratio_worst": min(alone),
        "cpu_us_per_call": {k: bench.median(v) for k, v in cpu.items()},
        "redis_us_per_check": {k: bench.median(v) for k, v in server.items()},
    }


async def timed(v: Variant, n: int, into: list[int]) -> None:
    clock = time.perf_counter_ns
    call, ok = v.call, v.ok
    for _ in range(n):
        t0 = clock()
        result = await call()
        into.append(clock() - t0)
        if not ok(result):
            v.bad += 1


async def measure(
    variants: list[Variant], *, rounds: int, calls: int, chunk: int, warmup: int
) -> None:
    for v in variants:  # load scripts, open connections, warm caches
        await timed(v, warmup, [])
        v.bad = 0
    start = time.perf_counter()
    for r in range(rounds):
        for v in variants:
            v.samples.append([])
        done, passes = 0, 0
        while done < calls:
            k = min(chunk, calls - done)
            shift = (r + passes) % len(variants)
            for v in variants[shift:] + variants[:shift]:
                await timed(v, k, v.samples[r])
            done += k
            passes += 1
        base = bench.median(variants[0].samples[r])
        ratios = " ".join(
            f"{v.short}={bench.median(v.samples[r]) / base:.2f}x" for v in variants[1:]
        )
        bench.progress(
            f"round {r + 1}/{rounds}: {variants[0].short} median {base / 1000:.1f} us; {ratios} "
            f"({time.perf_counter() - start:.0f}s)"
        )


def summarize(variants: list[Variant]) -> dict[str, Any]:
    base = variants[0]
    base_all = [x for s in base.samples for x in s]
    base_med = bench.median(base_all)
    base_p99 = bench.percentile(base_all, 99)
    out: dict[str, Any] = {}
    for v in variants:
        pooled = [x for s in v.samples for x in s]
        med = bench.median(pooled)
        p99 = bench.percentile(pooled, 99)
        per_round = [bench.median(s) for s in v.samples]
        per_round_ratio = [
            m / bench.median(b) for m, b in zip(per_round, base.samples, strict=True)
        ]
        out[v.name] = {
            "round_trips": v.round_trips,
            "samples": len(pooled),
            "median_us": med / 1000,
            "p99_us": p99 / 1000,
            "mean_us": sum(pooled) / len(pooled) / 1000,
            "ratio_median": med / base_med,
            "ratio_p99": p99 / base_p99,
            "per_round_median_us": [m / 1000 for m in per_round],
            "per_round_ratio": per_round_ratio,
            "failed_checks": v.bad,
        }
    return out


def report(results: dict[str, Any]) -> str:
    headers = [
        "variant", "RTTs", "median us", "p99 us", "ratio (median)", "per-round ratio",
        "ratio (p99)",
    ]  # fmt: skip
    rows = []
    for name, r in results.items():
        lo, hi = min(r["per_round_ratio"]), max(r["per_round_ratio"])
        rows.append(
            [
                name,
                r["round_trips"],
                f"{r['median_us']:.1f}",
                f"{r['p99_us']:.1f}",
                f"{r['ratio_median']:.2f}x",
                f"{lo:.2f}-{hi:.2f}x",
                f"{r['ratio_p99']:.2f}x",
            ]
        )
    return bench.table(headers, rows, [False, True, True, True, True, True, True])


# -- profiling ---------------------------------------------------------------


def _area(filename: str, func: str) -> str:
    """Which layer a profiled function belongs to."""
    repo = str(bench.REPO)
    if filename.endswith("/projections/counters/redis.py"):
        return "RedisBackend (projections/counters/redis.py)"
    if filename.startswith(f"{repo}/mcp_budget_governor/"):
        return "mcp_budget_governor (governor, planning, keys, windows)"
    if filename.startswith(f"{repo}/benchmarks/"):
        return "benchmark loop"
    if "/site-packages/redis/" in filename:
        return "redis-py (pack, send, parse, pool)"
    if "/asyncio/" in filename or filename.endswith("selectors.py"):
        return "asyncio event loop"
    if filename == "~" and ("socket" in func or "epoll" in func):
        return "socket send/recv + epoll (C)"
    return "other C builtins / stdlib"


async def _server_usec(client: Any, fn: Callable[[], Awaitable[Any]], n: int = 2000) -> float:
    """Server-side microseconds per EVALSHA over ``n`` calls (INFO commandstats delta)."""

    async def read() -> tuple[int, float]:
        st = (await client.info("commandstats")).get("cmdstat_evalsha", {})
        return int(st.get("calls", 0)), float(st.get("usec", 0))

    c0, u0 = await read()
    for _ in range(n):
        await fn()
    c1, u1 = await read()
    return (u1 - u0) / max(1, c1 - c0)


async def profile(backend: RedisBackend, rid: str, calls: int) -> dict[str, Any]:
    """Where the time of ``check()`` with 3 limits goes, over one no-op EVALSHA.

    1. An interleaved ladder of async stages, noop EVALSHA up to gov.check.
    2. Sync pieces timed alone (medians).
    3. Server-side Lua time per EVALSHA from INFO commandstats.
    4. cProfile over ``calls`` checks, grouped by layer (cProfile inflates
       Python time: read it for shares, not absolute numbers).
    """
    from redis.asyncio.connection import Connection

    from mcp_budget_governor import planning

    policy = Policy.of(*limits(rid, "prof")[:3])
    gov = Governor(policy, backend)
    now = time.time()
    slots = planning.check_slots(policy, CTX, now)
    ops = [s.op for s in slots]
    # The backend's own builder: numkeys, KEYS, ARGV exactly as charge() sends them.
    command = backend.charge_args(Charge(ops))
    numkeys = int(command[0])
    keys, args = command[1 : 1 + numkeys], command[1 + numkeys :]
    noop_script, charge_script = bench.noop(backend.client), backend._charge
    charge_sha = charge_script.sha

    async def raw_charge() -> Any:
        return await backend.client.execute_command("EVALSHA", charge_sha, *command)

    ladder = [
        Variant("noop EVALSHA (0 keys, 0 args)", "1", "noop", noop_script, bool),
        Variant(
            f"noop EVALSHA, with charge's {len(keys)} KEYS + {len(args)} ARGV",
            "1",
            "noop+args",
            lambda: noop_script(keys=keys, args=args),
            bool,
        ),
        Variant(
            "charge.lua EVALSHA, KEYS/ARGV prebuilt",
            "1",
            "rawcharge",
            raw_charge,
            lambda r: int(r[0]) == 0,
        ),
        Variant(
            "RedisBackend.charge(ops), ops prebuilt",
            "1",
            "charge",
            lambda: backend.charge(ops),
            lambda r: r.admitted,
        ),
        Variant(
            "Governor.check(ctx), 3 limits",
            "1",
            "check3",
            lambda: gov.check(CTX),
            lambda d: d.admitted and not d.degraded,
        ),
    ]
    bench.progress("profile: interleaved ladder noop -> check() ...")
    await measure(ladder, rounds=3, calls=max(500, calls // 5), chunk=50, warmup=200)
    ladder_us = {v.name: bench.median([x for s in v.samples for x in s]) / 1000 for v in ladder}

    clock = time.perf_counter_ns
    conn = Connection()
    sha_noop, sha_charge = noop_script.sha, charge_script.sha
    result = await backend.charge(ops)

    def bench_sync(fn: Callable[[], Any], n: int = 20_000) -> float:
        ts = []
        for _ in range(n):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        return bench.median(ts) / 1000

    def build_args() -> list[Any]:  # what RedisBackend.charge does (its cache warm)
        return backend.charge_args(Charge(ops))

    class InstantBackend:
        """Answers charge() at once with the real reply: Governor.check's own Python cost."""

        async def charge(self, ops: Any, **_: Any) -> Any:
            return result

    instant = Governor(policy, cast(Any, InstantBackend()))
    loop_ts: list[int] = []
    for _ in range(20_000):
        t0 = clock()
        await instant.check(CTX)
        loop_ts.append(clock() - t0)

    pieces = {
        "Governor.check over an instant backend (all its own Python)": (
            bench.median(loop_ts) / 1000
        ),
        "planning.check_slots(policy, ctx, now), 3 limits": bench_sync(
            lambda: planning.check_slots(policy, CTX, now)
        ),
        "  one planning.slot(...)": bench_sync(
            lambda: planning.slot(policy.limits[1], CTX, now, policy.tz, 1, enforce=True)
        ),
        "[s.op for s in slots] (3 CounterOps)": bench_sync(lambda: [s.op for s in slots]),
        "KEYS/ARGV lists as RedisBackend.charge builds them": bench_sync(build_args),
        "redis-py pack_command, noop EVALSHA": bench_sync(
            lambda: conn.pack_command("EVALSHA", sha_noop, 0)
        ),
        f"redis-py pack_command, charge EVALSHA ({len(keys)} keys, {len(args)} args)": bench_sync(
            lambda: conn.pack_command("EVALSHA", sha_charge, len(keys), *keys, *args)
        ),
        "planning.admitted(slots, used) -> Decision": bench_sync(
            lambda: planning.admitted(slots, result.used)
        ),
    }

    bench.progress("profile: server-side time per EVALSHA (INFO commandstats) ...")
    server_us = {
        "noop.lua": await _server_usec(backend.client, noop_script),
        "charge.lua, 3 counters": await _server_usec(backend.client, raw_charge),
    }

    bench.progress(f"profile: cProfile over {calls} checks ...")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        await gov.check(CTX)
    prof.disable()
    stats = pstats.Stats(prof)
    areas: dict[str, float] = {}
    for (filename, _line, func), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        area = _area(filename, func)
        areas[area] = areas.get(area, 0.0) + tottime
    total = sum(areas.values())
    by_area = {k: v / calls * 1e6 for k, v in sorted(areas.items(), key=lambda kv: -kv[1])}
    buf = io.StringIO()
    stats.stream = buf  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(20)
    return {
        "ladder_median_us": ladder_us,
        "pieces_median_us": pieces,
        "server_usec_per_evalsha": server_us,
        "cprofile_us_per_check_by_area": by_area,
        "cprofile_total_us_per_check": total / calls * 1e6,
        "cprofile_top_tottime": buf.getvalue(),
    }


def profile_report(prof: dict[str, Any]) -> str:
    lines = ["Where check() with 3 limits spends its time", ""]
    lines.append("Interleaved ladder (median us; each step adds one layer):")
    prev = None
    for name, us in prof["ladder_median_us"].items():
        step = "" if prev is None else f"  (+{us - prev:.1f})"
        lines.append(f"  {name:<48} {us:7.1f}{step}")
        prev = us
    lines.append("")
    lines.append("Sync pieces (median us, timed alone):")
    for name, us in prof["pieces_median_us"].items():
        lines.append(f"  {name:<56} {us:6.2f}")
    lines.append("")
    lines.append("Server-side time per EVALSHA (INFO commandstats):")
    for name, us in prof["server_usec_per_evalsha"].items():
        lines.append(f"  {name:<48} {us:7.2f}")
    lines.append("")
    lines.append(
        "cProfile, own time per check by layer (us; profiler overhead included, "
        f"total {prof['cprofile_total_us_per_check']:.0f}):"
    )
    for name, us in prof["cprofile_us_per_check_by_area"].items():
        lines.append(f"  {name:<56} {us:6.1f}")
    lines.append("")
    lines.append("cProfile top functions by own time:")
    lines.append(prof["cprofile_top_tottime"].rstrip())
    return "\n".join(lines)


# -- main --------------------------------------------------------------------


async def run(url: str, rid: str, args: argparse.Namespace) -> dict[str, Any]:
    backend = RedisBackend.from_url(url, timeout=5.0)
    try:
        variants = build_variants(backend, rid)
        # The bare-socket charges name their scripts by SHA: loaded first, and the
        # 3-limit counters made (a warm server), so each is one EVALSHA that admits.
        for script in (backend._charge.script, FLOOR.read_text("utf-8")):
            await backend.client.script_load(script)
        await Governor(Policy.of(*limits(rid, "gov")[:3]), backend).check(CTX)
        await measure(
            variants, rounds=args.rounds, calls=args.calls, chunk=args.chunk, warmup=args.warmup
        )
        out: dict[str, Any] = {"variants": summarize(variants)}
        if not args.no_concurrency:
            bench.progress(f"rates: {CALLERS} concurrent callers, check() vs no-op EVALSHA ...")
            out["rates"] = await rates(backend, rid, per_caller=args.rate_calls, trials=5)
        if args.profile:
            bench.progress("profiling check() with 3 limits ...")
            out["profile"] = await profile(backend, rid, args.profile_calls)
    finally:
        await backend.aclose()
    return out


def _load(avg: tuple[float, ...] | None) -> str:
    return "n/a" if avg is None else "/".join(f"{x:.2f}" for x in avg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: start a throwaway local server)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--chunk", type=int, default=50, help="calls per variant per turn")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per variant")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--no-concurrency", action="store_true", help="skip the 500-call demo")
    parser.add_argument(
        "--profile", action="store_true", help="also profile check() (3 limits) with cProfile"
    )
    parser.add_argument("--profile-calls", type=int, default=5000, help="checks to profile")
    parser.add_argument(
        "--rate-calls",
        type=int,
        default=100,
        help=f"calls per caller in the {CALLERS}-caller rates",
    )
    args = parser.parse_args(argv)

    rid = bench.run_id()
    started = time.time()
    load_before = bench.loadavg()
    with bench.redis_server(args.redis) as server:
        env = bench.environment(server.url, server.origin)
        bench.progress(
            f"redis {env['redis_server']} ({server.origin}); {args.rounds} rounds x "
            f"{args.calls} calls per variant"
        )
        try:
            results = asyncio.run(run(server.url, rid, args))
            concurrency = None
            if not args.no_concurrency:
                bench.progress("concurrency demo: 500 concurrent calls, cap 50 ...")
                trials = asyncio.run(
                    bench_concurrency.run(server.url, rid, calls=500, cap=50, trials=5)
                )
                concurrency = bench_concurrency.summarize(trials, calls=500, cap=50, price=0.05)
        finally:
            bench.cleanup(server.url, [f"mcpbg:v1:bench_{rid}_*"])
    env["loadavg_before"] = load_before
    env["loadavg_after"] = bench.loadavg()
    env["seconds"] = round(time.time() - started, 1)

    variants = results["variants"]
    check3 = variants["check() 3 limits"]
    lo, hi = min(check3["per_round_ratio"]), max(check3["per_round_ratio"])
    met = check3["ratio_median"] <= TARGET_RATIO
    print(
        f"Governor.check latency: {args.rounds} rounds x {args.calls} calls per variant, "
        f"interleaved; Redis {env['redis_server']} ({server.origin}); Python {env['python']}, "
        f"redis-py {env['redis_py']}, hiredis {'yes' if env['hiredis'] else 'no'}, "
        f"{env['cpus']} CPUs; load avg {_load(env['loadavg_before'])} -> "
        f"{_load(env['loadavg_after'])}"
    )
    print(report(variants))
    print(
        f"Target (check() with 3 limits <= {TARGET_RATIO}x one no-op EVALSHA, median): "
        f"{check3['ratio_median']:.2f}x (rounds {lo:.2f}-{hi:.2f}x) -> "
        f"{'MET' if met else 'MISSED'}"
    )
    off = variants["check() 3 limits, coalescing off"]
    lone = check3["median_us"] / off["median_us"]
    print(
        f"Target (one caller, coalescing on <= {LONE_TARGET}x off, median): {lone:.2f}x -> "
        f"{'MET' if lone <= LONE_TARGET else 'MISSED'}"
    )
    bare = variants["noop EVALSHA, bare socket"]
    print(
        f"check() 3 limits vs the bare-socket no-op EVALSHA: "
        f"{check3['median_us'] / bare['median_us']:.2f}x"
    )
    alone = variants["charge.lua alone, bare socket"]["median_us"]
    floor = variants["floor: charge's commands, bare socket"]["median_us"]
    print(
        f"on the bare socket, vs its no-op: charge's Redis commands with no logic "
        f"{floor / bare['median_us']:.2f}x, charge.lua {alone / bare['median_us']:.2f}x; "
        f"check() / charge.lua alone {check3['median_us'] / alone:.2f}x"
    )
    if "rates" in results:
        r = results["rates"]
        print(
            f"Target ({CALLERS} concurrent check() >= {CONCURRENT_TARGET}x the rate of {CALLERS} "
            f"concurrent no-op EVALSHAs): {r['ratio_median']:.2f}x median of "
            f"{len(r['ratios'])} trials, worst {r['ratio_worst']:.2f}x "
            f"(check {bench.median(r['check_per_s']):.0f}/s, noop "
            f"{bench.median(r['noop_per_s']):.0f}/s) -> "
            f"{'MET' if r['ratio_median'] >= CONCURRENT_TARGET else 'MISSED'}"
        )
        print(
            f"each check its own charge.lua call (no charge_many.lua): "
            f"{r['alone_ratio_median']:.2f}x median, worst {r['alone_ratio_worst']:.2f}x "
            f"(check {bench.median(r['alone_per_s']):.0f}/s)"
        )
        print(
            f"this process's CPU a call at {CALLERS} callers (median of the trials): "
            f"check() {r['cpu_us_per_call']['check']:.1f} us, alone "
            f"{r['cpu_us_per_call']['alone']:.1f} us, no-op EVALSHA "
            f"{r['cpu_us_per_call']['noop']:.1f} us; Redis' time a check: "
            f"{r['redis_us_per_check']['check']:.1f} us batched, "
            f"{r['redis_us_per_check']['alone']:.1f} us alone"
        )
    failed = {k: v["failed_checks"] for k, v in variants.items() if v["failed_checks"]}
    if failed:
        print(f"WARNING: calls refused or degraded (numbers invalid): {failed}")
    if "profile" in results:
        print()
        print(profile_report(results["profile"]))
    if concurrency is not None:
        print()
        print(bench_concurrency.report(concurrency))

    if args.json:
        payload = {
            "environment": env,
            "config": {
                k: getattr(args, k) for k in ("calls", "rounds", "chunk", "warmup", "redis")
            },
            "target_ratio": TARGET_RATIO,
            "target_met": met,
            **results,
            "concurrency": concurrency,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        bench.progress(f"wrote {args.json}")
    ok = not failed and (concurrency is None or concurrency["lua_exact"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
