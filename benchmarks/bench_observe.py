"""What the observer hook costs ``check()``: off (the default), logs only, OpenTelemetry.

Variants, interleaved in chunks on one Redis and one client (see bench_check.py):

- ``noop EVALSHA``: one EVALSHA of ``testing/noop.lua``, the floor of one round trip;
- ``check() unhooked``: ``Governor._check``, the check without its observer
  test: the hot path as it was before observability;
- ``check() off``: ``Governor.check`` with no observer (the default): one
  ``is not None`` test and one more await;
- ``check() logs``: with :class:`~mcp_budget_governor.observe.Observer` (refusal logs);
- ``check() otel``: with ``integrations.otel.Telemetry`` (metrics and spans into
  the SDK's providers, a Prometheus reader), when the ``[otel]`` extra is installed.

3 gated CALLS limits that never refuse. The target (issue 17): ``check() off`` /
``check() unhooked`` <= 1.02 (median, same run).

Usage::

    python -m benchmarks.bench_observe [--redis URL] [--calls N] [--rounds R] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Window
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


async def run(url: str, rid: str, args: argparse.Namespace) -> dict[str, Any]:
    backend = RedisBackend.from_url(url, timeout=5.0)
    ctx = Context(user=f"u-{rid}", tenant=f"t-{rid}", tool="search")
    plain = Governor(policy(rid), backend)
    logs = Governor(policy(rid), backend, observer=Observer())
    variants: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
    noop_script = bench.noop(backend.client)

    async def noop() -> Any:
        return await noop_script()

    async def unhooked() -> Any:
        return await plain._check(ctx, 1, ())

    async def off() -> Any:
        return await plain.check(ctx)

    async def logged() -> Any:
        return await logs.check(ctx)

    variants += [
        ("noop EVALSHA", noop),
        ("check() unhooked", unhooked),
        ("check() off", off),
        ("check() logs", logged),
    ]
    tel = None
    try:
        from opentelemetry.sdk.trace import TracerProvider

        from mcp_budget_governor.integrations.otel import Telemetry

        tel = Telemetry.prometheus(tracer_provider=TracerProvider())
        traced = Governor(policy(rid), backend, observer=tel)

        async def otel() -> Any:
            return await traced.check(ctx)

        variants.append(("check() otel", otel))
    except ImportError:
        bench.progress("the [otel] extra is not installed: no 'check() otel' variant")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: start a throwaway local server)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    rid = bench.run_id()
    with bench.redis_server(args.redis) as server:
        try:
            results = asyncio.run(run(server.url, rid, args))
        finally:
            bench.cleanup(server.url, [f"mcpbg:v1:o{rid}*"])
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if results["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
