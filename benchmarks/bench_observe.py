"""What the observer hook costs ``check()``: off (the default), logs only, OpenTelemetry.

Variants, interleaved in chunks on one Redis and one client (see bench_check.py):

- ``noop EVALSHA``: one EVALSHA of ``testing/noop.lua``, the floor of one round trip;
- ``check() unhooked``: ``admission._check``, the check without its observer
  test: the hot path as it was before observability;
- ``check() off``: ``Governor.check`` with no observer (the default): one
  ``is not None`` test and one more await;
- ``check() logs``: with :class:`~mcp_budget_governor.observe.Observer` (refusal logs);
- ``check() otel``: with ``integrations.otel.Telemetry`` (metrics and spans into
  the SDK's providers, a Prometheus reader), when the ``[otel]`` extra is installed.

3 gated CALLS limits that never refuse. The target (issue 17): ``check() off`` /
``check() unhooked`` <= 1.02.

Two modes (``--mode``): ``time`` (the default) times each call, interleaved,
and compares medians; on a shared machine those move by more than 2 %.
``instructions`` counts what the client process executes per check under
valgrind's callgrind (``testing.bench.instructions_per_op``): each variant in a
subprocess of its own, once with N and once with 2N checks, the difference
divided by N, so start-up, imports and set-up cancel out. The count does not
depend on the machine's load. ``both`` runs the two; the exit status then
follows the instruction ratio.

Usage::

    python -m benchmarks.bench_observe [--mode time|instructions|both] [--redis URL]
        [--calls N] [--rounds R] [--checks N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Window,
    admission,
)
from mcp_budget_governor.observe import Observer
from testing import bench

TARGET = 1.02
CAP = 10**15  # never refuses


def policy(rid: str) -> Policy:
    return Policy.of(
        Limit(f"o{rid}-t", cap=CAP, window=Window.DAY, scope=Scope.TENANT),
        Limit(f"o{rid}-u", cap=CAP, window=Window.MINUTE, scope=Scope.USER),
        Limit(f"o{rid}-ut", cap=CAP, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    )


#: The variants' names, and the short names ``--child`` takes.
NAMES = {
    "noop": "noop EVALSHA",
    "unhooked": "check() unhooked",
    "off": "check() off",
    "logs": "check() logs",
    "otel": "check() otel",
}

Call = Callable[[], Awaitable[Any]]


def make_variants(
    backend: RedisBackend, rid: str, only: str | None = None
) -> tuple[list[tuple[str, Call]], Any]:
    """The variants (all, or the one named ``only``) and the Telemetry to close (or None)."""
    ctx = Context(user=f"u-{rid}", tenant=f"t-{rid}", tool="search")
    variants: list[tuple[str, Call]] = []
    wanted = set(NAMES) if only is None else {only}
    if "noop" in wanted:
        noop_script = bench.noop(backend.client)

        async def noop() -> Any:
            return await noop_script()

        variants.append((NAMES["noop"], noop))
    if wanted & {"unhooked", "off"}:
        plain = Governor(policy(rid), backend)

        async def unhooked() -> Any:
            return await admission._check(plain, ctx, 1, ())

        async def off() -> Any:
            return await plain.check(ctx)

        variants += [
            (NAMES[k], f) for k, f in (("unhooked", unhooked), ("off", off)) if k in wanted
        ]
    if "logs" in wanted:
        logs = Governor(policy(rid), backend, observer=Observer())

        async def logged() -> Any:
            return await logs.check(ctx)

        variants.append((NAMES["logs"], logged))
    tel = None
    if "otel" in wanted:
        try:
            from opentelemetry.sdk.trace import TracerProvider

            from mcp_budget_governor.integrations.otel import Telemetry

            tel = Telemetry.prometheus(tracer_provider=TracerProvider())
            traced = Governor(policy(rid), backend, observer=tel)

            async def otel() -> Any:
                return await traced.check(ctx)

            variants.append((NAMES["otel"], otel))
        except ImportError:
            bench.progress("the [otel] extra is not installed: no 'check() otel' variant")
    return variants, tel


async def run(url: str, rid: str, args: argparse.Namespace) -> dict[str, Any]:
    backend = RedisBackend.from_url(url, timeout=5.0)
    variants, tel = make_variants(backend, rid)
    samples: dict[str, list[int]] = {name: [] for name, _ in variants}
    clock = time.perf_counter_ns
    for _, call in variants:
        for _ in range(args.warmup):
            await call()
    for r in range(args.rounds):
        done = 0
        while done < args.calls:
            shift = (r + done // args.chunk) % len(variants)
            for name, call in variants[shift:] + variants[:shift]:
                into = samples[name]
                for _ in range(args.chunk):
                    t0 = clock()
                    await call()
                    into.append(clock() - t0)
            done += args.chunk
        bench.progress(f"round {r + 1}/{args.rounds} done")
    await backend.aclose()
    if tel is not None:
        tel.close()
    med = {name: bench.median(v) for name, v in samples.items()}
    base = med["check() unhooked"]
    ratio = med["check() off"] / base
    out: dict[str, Any] = {
        "median_us": {k: round(v / 1000, 2) for k, v in med.items()},
        "off_vs_unhooked": round(ratio, 3),
        "logs_vs_unhooked": round(med["check() logs"] / base, 3),
        "unhooked_vs_noop": round(base / med["noop EVALSHA"], 3),
        "target": TARGET,
        "met": ratio <= TARGET,
        "calls_per_variant": args.calls * args.rounds,
    }
    if "check() otel" in med:
        out["otel_vs_unhooked"] = round(med["check() otel"] / base, 3)
    return out


async def child(url: str, rid: str, name: str, checks: int, warmup: int) -> None:
    """One variant's ``warmup + checks`` calls in this process (what callgrind counts)."""
    backend = RedisBackend.from_url(url, timeout=5.0)
    variants, tel = make_variants(backend, rid, name)
    if not variants:
        raise SystemExit(f"variant {name!r} is not available")
    call = variants[0][1]
    for _ in range(warmup):
        await call()
    # Start-up's objects out of the collector's reach: a full collection over them
    # (millions of instructions) would land in one run and not the other.
    gc.collect()
    gc.freeze()
    for _ in range(checks):
        await call()
    await backend.aclose()
    if tel is not None:
        tel.close()


def count(url: str, rid: str, args: argparse.Namespace) -> dict[str, Any]:
    """Instructions per check of each variant under callgrind; ratios to ``unhooked``."""
    per: dict[str, float] = {}
    spreads: dict[str, str] = {}
    # Not noop: it goes through redis-py's own command path (the governor's check
    # through its auto-pipelined connection), so its count is no floor here.
    names = ["unhooked", "off", "logs"]
    try:
        import opentelemetry.sdk  # noqa: F401

        names.append("otel")
    except ImportError:
        bench.progress("the [otel] extra is not installed: no 'check() otel' variant")
    for name in names:

        def argv(k: int, name: str = name) -> list[str]:
            return [
                sys.executable, "-m", "benchmarks.bench_observe", "--child", name,
                "--checks", str(k), "--warmup", str(args.warmup_child),
                "--redis", url, "--rid", rid,
            ]  # fmt: skip

        t0 = time.monotonic()
        runs = [bench.instructions_per_op(argv, args.checks) for _ in range(args.repeat)]
        per[NAMES[name]] = bench.median(runs)  # an odd run can be off either way
        spread = (max(runs) - min(runs)) / min(runs)
        spreads[NAMES[name]] = f"{spread:.2%}"
        bench.progress(
            f"{NAMES[name]}: {per[NAMES[name]]:,.0f} instructions per check"
            f" ({args.repeat} x N={args.checks} and 2N, spread {spread:.2%},"
            f" {time.monotonic() - t0:.0f} s)"
        )
    base = per[NAMES["unhooked"]]
    ratio = per[NAMES["off"]] / base
    out: dict[str, Any] = {
        "instructions_per_check": {k: round(v) for k, v in per.items()},
        "spread": spreads,
        "off_vs_unhooked": round(ratio, 4),
        "logs_vs_unhooked": round(per[NAMES["logs"]] / base, 4),
        "target": TARGET,
        "met": ratio <= TARGET,
        "checks": f"N={args.checks} and 2N per variant (after {args.warmup_child} warm-up), "
        f"median of {args.repeat}",
        "counted": "the client (python) process only, all its threads; Redis is not counted",
    }
    if NAMES["otel"] in per:
        out["otel_vs_unhooked"] = round(per[NAMES["otel"]] / base, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: start a throwaway local server)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument(
        "--mode", choices=("time", "instructions", "both"), default="time",
        help="time the calls, count their instructions under callgrind, or both",
    )  # fmt: skip
    parser.add_argument(
        "--checks", type=int, default=500, help="instructions mode: N (runs N and 2N checks)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="instructions mode: median of R N/2N pairs"
    )
    parser.add_argument("--warmup-child", type=int, default=50, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=sorted(NAMES), help=argparse.SUPPRESS)
    parser.add_argument("--rid", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("checks", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive whole number, got {getattr(args, name)}")
    if args.child:  # one variant, under callgrind (see count)
        asyncio.run(child(args.redis, args.rid, args.child, args.checks, args.warmup_child))
        return 0
    if args.mode != "time" and not bench.callgrind_available():
        parser.error("--mode instructions needs valgrind (apt-get install valgrind)")
    rid = bench.run_id()
    results: dict[str, Any] = {}
    with bench.redis_server(args.redis) as server:
        try:
            if args.mode in ("time", "both"):
                results["time"] = asyncio.run(run(server.url, rid, args))
            if args.mode in ("instructions", "both"):
                results["instructions"] = count(server.url, rid, args)
        finally:
            bench.cleanup(server.url, [f"mcpbg:v1:o{rid}*"])
    if args.mode != "both":
        results = results[args.mode]
        met = results["met"]
    else:
        met = results["instructions"]["met"]  # the count is the trustworthy one
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
