"""Peer comparison: FastMCP's in-process RateLimitingMiddleware vs BudgetMiddleware on one Redis.

Two measurements in one run:

1. **Admission across replicas.** Four replicas (four processes, FastMCP
   servers over streamable HTTP under uvicorn) of the same server, each with
   FastMCP's ``RateLimitingMiddleware`` capped at ``--cap`` tool calls
   (token bucket of ``--cap`` tokens, no refill to speak of), then four with
   ``BudgetMiddleware`` and a global limit of ``--cap`` calls on one Redis.
   The same burst of ``--calls`` concurrent ``tools/call`` requests is spread
   round-robin over the four. In-process counters admit up to
   ``replicas x cap``; one shared counter admits exactly ``cap``.
2. **Per-call overhead.** Serial calls to one server of each kind with caps
   that never refuse, interleaved in chunks so drift hits every variant
   alike: unguarded (no middleware), unguarded with one no-op EVALSHA in the
   tool (what a single Redis round trip costs on this machine, the floor for
   any shared counter), ``RateLimitingMiddleware``, ``BudgetMiddleware``
   checking one limit, and ``BudgetMiddleware`` checking one limit and
   charging the tool's ``meta`` price on a second (charged by the admission
   itself since issue 33: one round trip, like the one-EVALSHA tool; the
   price counted is checked: counter = calls x price). Over
   streamable HTTP (a server process each) and over FastMCP's in-memory
   transport (client and server in this process), as ratios to unguarded.

The rate limiter's requests are bucketed by ``get_client_id`` so that only
``tools/call`` spends the capped bucket (every other request, such as the
``tools/list`` the client sends alongside its calls, gets a bucket of its
own), which keeps its count comparable to the governor's, which only governs
tool calls.

Usage::

    python -m benchmarks.bench_peers [--redis URL] [--calls 600] [--cap 100]
        [--replicas 4] [--latency-calls 300] [--rounds 5] [--json out.json]

Without ``--redis`` a throwaway local redis-server is started and stopped;
with it, only keys named ``mcpbg:v1:bench_<run id>_*`` are touched and they
are deleted at the end. Exit status 1 if the governed replicas did not admit
exactly ``--cap`` or any timed call failed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, contextmanager
from pathlib import Path
from typing import Any

from testing import bench

KINDS = {
    "unguarded": "no middleware",
    "redis_rtt": "no middleware, the tool does 1 no-op EVALSHA",
    "ratelimit": "FastMCP RateLimitingMiddleware (in-process)",
    "budget": "BudgetMiddleware, 1 limit checked (Redis)",
    "budget_meter": "BudgetMiddleware, 1 checked + meta price, one round trip (Redis)",
}
PRICE_MICROS = 1_000  # the budget_meter tool's meta price, $0.001
NEVER = 10**12  # a cap that never refuses, for the latency runs


def build_server(kind: str, *, cap: int, redis_url: str | None, rid: str) -> Any:
    """The FastMCP server every replica runs; ``kind`` picks its guard."""
    from fastmcp import FastMCP
    from fastmcp.server.middleware.rate_limiting import RateLimitingMiddleware

    from mcp_budget_governor import Governor, Limit, Policy, RedisBackend, Unit, Window, usd
    from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware

    spend = f"bench_{rid}_spend"
    mcp = FastMCP("peer")
    if kind == "ratelimit":
        other = itertools.count()

        def bucket(context: Any) -> str:
            # Only tools/call shares the capped bucket; every other request
            # (discover, the client's tools/list per call) gets a fresh one.
            return "tools" if context.method == "tools/call" else f"other-{next(other)}"

        # refill so slow that the burst sees exactly `cap` tokens (one per ~16 min)
        rate = 0.001 if cap < NEVER else float(cap)
        mcp.add_middleware(
            RateLimitingMiddleware(
                max_requests_per_second=rate, burst_capacity=cap, get_client_id=bucket
            )
        )
    elif kind in ("budget", "budget_meter"):
        assert redis_url is not None
        policy = Policy.of(
            # DAY, not MINUTE: a minute boundary mid-burst would open a second bucket.
            Limit(f"bench_{rid}_calls", cap=cap, window=Window.DAY),
            Limit(spend, cap=usd(10**6), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
        )
        governor = Governor(policy, RedisBackend.from_url(redis_url, timeout=5.0))
        mcp.add_middleware(BudgetMiddleware(governor))
    meta = {"mcpbg": {"cost_usd": "0.001", "limit": spend}} if kind == "budget_meter" else None
    rtt = (
        bench.noop(RedisBackend.from_url(redis_url, timeout=5.0).client)
        if kind == "redis_rtt"
        else None
    )

    @mcp.tool(meta=meta)
    async def work(n: int) -> int:
        if rtt is not None:  # the calibration: what one Redis round trip costs here
            await rtt()
        return n

    return mcp


# -- replicas: one process each -------------------------------------------------------


def serve(kind: str, port: int, cap: int, redis_url: str | None, rid: str) -> None:
    """Child process: run one replica until terminated."""
    import uvicorn

    app = build_server(kind, cap=cap, redis_url=redis_url, rid=rid).http_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", ws="none")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def replicas(
    kind: str, n: int, *, cap: int, redis_url: str | None, rid: str
) -> Iterator[list[str]]:
    """Start ``n`` replica processes; yield their MCP URLs; stop them by pid."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for _ in range(n):
            port = _free_port()
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.bench_peers",
                "--serve",
                kind,
                "--port",
                str(port),
            ]
            cmd += ["--cap", str(cap), "--rid", rid]
            if redis_url:
                cmd += ["--redis", redis_url]
            procs.append(
                subprocess.Popen(
                    cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=str(bench.REPO)
                )
            )
            urls.append(f"http://127.0.0.1:{port}/mcp")
        for proc, url in zip(procs, urls, strict=True):
            _wait_listening(proc, url)
        yield urls
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_listening(proc: subprocess.Popen[bytes], url: str, timeout: float = 60.0) -> None:
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"replica on port {port} did not listen within {timeout:.0f} s")


# -- 1. admission across replicas ------------------------------------------------------


async def burst(urls: Sequence[str], calls: int, concurrency: int) -> dict[str, Any]:
    """``calls`` concurrent tool calls, round-robin over the replicas."""
    from fastmcp import Client

    admitted = [0] * len(urls)
    refused: dict[str, int] = {}
    gate = asyncio.Semaphore(concurrency)
    async with AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(Client(url)) for url in urls]

        async def one(i: int) -> None:
            r = i % len(urls)
            async with gate:
                try:
                    result = await clients[r].call_tool("work", {"n": i}, raise_on_error=False)
                except Exception as exc:  # the rate limiter answers with a JSON-RPC error
                    key = type(exc).__name__ + ": " + str(exc).split(":")[0][:40]
                else:
                    if not result.is_error:
                        admitted[r] += 1
                        return
                    text = result.content[0].text if result.content else ""  # type: ignore[union-attr]
                    key = "tool error: " + text.split(" ", 1)[0]
            refused[key] = refused.get(key, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(calls)))
        elapsed = time.perf_counter() - t0
    return {
        "admitted": sum(admitted),
        "per_replica": admitted,
        "refused": refused,
        "seconds": elapsed,
    }


async def admission(args: argparse.Namespace, url: str, rid: str) -> dict[str, Any]:
    from mcp_budget_governor import Governor, Limit, Policy, RedisBackend, Window

    out: dict[str, Any] = {}
    for kind in ("ratelimit", "budget"):
        # A fresh counter per trial: the governed replicas' limit is named per run id.
        with replicas(kind, args.replicas, cap=args.cap, redis_url=url, rid=rid) as urls:
            bench.progress(f"admission: {kind}, {args.replicas} replicas up; bursting")
            out[kind] = await burst(urls, args.calls, args.concurrency)
    gov = Governor(
        Policy.of(Limit(f"bench_{rid}_calls", cap=args.cap, window=Window.DAY)),
        RedisBackend.from_url(url),
    )
    try:
        out["budget"]["redis_counter"] = await gov.usage(f"bench_{rid}_calls")
    finally:
        await gov.aclose()
    return out


# -- 2. per-call overhead --------------------------------------------------------------


async def _timed(call: Callable[[], Awaitable[Any]], n: int, into: list[float]) -> int:
    failures = 0
    for _ in range(n):
        t0 = time.perf_counter()
        result = await call()
        into.append(time.perf_counter() - t0)
        failures += bool(result.is_error)
    return failures


async def latency(
    targets: dict[str, Any], *, calls: int, rounds: int, chunk: int, warmup: int
) -> dict[str, Any]:
    """Serial calls to each target, interleaved ``chunk`` at a time; seconds per call."""
    from fastmcp import Client

    samples: dict[str, list[float]] = {k: [] for k in targets}
    failures = dict.fromkeys(targets, 0)
    async with AsyncExitStack() as stack:
        clients = {k: await stack.enter_async_context(Client(t)) for k, t in targets.items()}
        calls_of = {
            k: (lambda c=c: c.call_tool("work", {"n": 1}, raise_on_error=False))
            for k, c in clients.items()
        }
        for k in targets:
            await _timed(calls_of[k], warmup, [])
        for r in range(rounds):
            done = 0
            while done < calls:
                step = min(chunk, calls - done)
                for k in targets:
                    failures[k] += await _timed(calls_of[k], step, samples[k])
                done += step
            bench.progress(f"latency: round {r + 1}/{rounds} done")
    return {"samples": samples, "failures": failures}


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {
        "median_us": bench.median(values) * 1e6,
        "p90_us": bench.percentile(values, 90) * 1e6,
        "n": len(values),
    }


async def overhead(args: argparse.Namespace, url: str, rid: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    common = {"calls": args.latency_calls, "rounds": args.rounds, "chunk": 25, "warmup": 50}
    calls = common["warmup"] + args.latency_calls * args.rounds
    priced = list(KINDS).index("budget_meter")
    in_process = {
        k: build_server(k, cap=NEVER, redis_url=url, rid=f"{rid}x{i}") for i, k in enumerate(KINDS)
    }
    bench.progress("latency: in-memory transport")
    got = await latency(in_process, **common)
    out["in_memory"] = _summarize_latency(got)
    out["in_memory"]["price"] = await _price_counted(url, f"{rid}x{priced}", calls)
    with ExitStack() as stack:
        urls = {}
        for i, k in enumerate(KINDS):
            (u,) = stack.enter_context(replicas(k, 1, cap=NEVER, redis_url=url, rid=f"{rid}h{i}"))
            urls[k] = u
        bench.progress("latency: streamable HTTP, one server process per variant")
        got = await latency(urls, **common)
    out["http"] = _summarize_latency(got)
    out["http"]["price"] = await _price_counted(url, f"{rid}h{priced}", calls)
    return out


async def _price_counted(url: str, rid: str, calls: int) -> dict[str, int]:
    """The priced variant's spend counter against what its calls owe (calls x price)."""
    from mcp_budget_governor import Governor, Limit, Policy, RedisBackend, Unit, Window, usd

    spend = f"bench_{rid}_spend"
    policy = Policy.of(
        Limit(spend, cap=usd(10**6), window=Window.DAY, unit=Unit.USD_MICROS, gated=False)
    )
    gov = Governor(policy, RedisBackend.from_url(url))
    try:
        counted = await gov.usage(spend)
    finally:
        await gov.aclose()
    return {"calls": calls, "counted": counted, "owed": calls * PRICE_MICROS}


def _summarize_latency(got: dict[str, Any]) -> dict[str, Any]:
    stats = {k: _stats(v) for k, v in got["samples"].items()}
    base = stats["unguarded"]["median_us"]
    rtt = stats["redis_rtt"]["median_us"]
    for s in stats.values():
        s["ratio"] = s["median_us"] / base
        s["vs_rtt_tool"] = s["median_us"] / rtt
        s["added_us"] = s["median_us"] - base
        s["beyond_rtt_us"] = s["median_us"] - rtt
    return {"stats": stats, "failures": got["failures"]}


# -- report -------------------------------------------------------------------------------


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"admission: {args.calls} concurrent tool calls round-robin over {args.replicas} "
        f"replicas, cap {args.cap}",
        "",
    ]
    rows = []
    for kind in ("ratelimit", "budget"):
        r = result["admission"][kind]
        refused = ", ".join(f"{v} {k}" for k, v in sorted(r["refused"].items())) or "-"
        rows.append(
            [
                KINDS[kind],
                str(r["admitted"]),
                " / ".join(map(str, r["per_replica"])),
                f"{r['admitted'] / args.cap:.2f}x",
                refused,
            ]
        )
    lines.append(
        bench.table(
            ["guard", "admitted", "per replica", "vs cap", "refused"],
            rows,
            [False, True, True, True, False],
        )
    )
    lines.append(
        f"governed Redis counter after the burst: {result['admission']['budget']['redis_counter']}"
    )
    for path, label in (("in_memory", "in-memory transport"), ("http", "streamable HTTP")):
        lines += [
            "",
            f"per-call latency, {label} (serial calls; ratio = median / unguarded median)",
            "",
        ]
        rows = []
        for kind, s in result["overhead"][path]["stats"].items():
            rows.append(
                [
                    KINDS[kind],
                    f"{s['median_us']:.0f}",
                    f"{s['p90_us']:.0f}",
                    f"{s['added_us']:+.0f}",
                    f"{s['ratio']:.2f}x",
                    f"{s['vs_rtt_tool']:.3f}x",
                    f"{s['beyond_rtt_us']:+.0f}" if kind.startswith("budget") else "",
                ]
            )
        lines.append(
            bench.table(
                ["variant", "median us", "p90 us", "added us", "ratio", "vs 1-EVALSHA tool",
                 "beyond 1 RTT us"],
                rows,
                [False, True, True, True, True, True, True],
            )
        )  # fmt: skip
        price = result["overhead"][path].get("price")
        if price:
            lines.append(
                f"price counted: {price['counted']} micros for {price['calls']} calls x "
                f"{PRICE_MICROS} = {price['owed']} "
                f"({'exact' if price['counted'] == price['owed'] else 'NOT EXACT'})"
            )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    rid = bench.run_id()
    with bench.redis_server(args.redis) as server:
        try:
            result: dict[str, Any] = {
                "environment": bench.environment(server.url, server.origin),
                "loadavg_before": bench.loadavg(),
                "args": {k: v for k, v in vars(args).items() if k not in ("serve", "port", "rid")},
            }
            result["admission"] = await admission(args, server.url, rid)
            result["overhead"] = await overhead(args, server.url, rid)
            result["loadavg_after"] = bench.loadavg()
        finally:
            bench.cleanup(server.url, [f"mcpbg:v1:bench_{rid}*"])
    print(report(result, args))
    if args.json:
        await asyncio.to_thread(
            Path(args.json).write_text, json.dumps(result, indent=2, default=str)
        )
    governed = result["admission"]["budget"]
    failures = sum(n for path in result["overhead"].values() for n in path["failures"].values())
    prices = {path: r["price"] for path, r in result["overhead"].items()}
    inexact = [path for path, p in prices.items() if p["counted"] != p["owed"]]
    if inexact:
        print(f"FAIL: the price was not counted exactly ({', '.join(inexact)})")
        failures += 1
    exact = governed["admitted"] == min(args.calls, args.cap) == governed["redis_counter"]
    if not exact:
        print(f"FAIL: the governed replicas admitted {governed['admitted']}, not {args.cap}")
    if failures:
        print(f"FAIL: {failures} timed calls failed")
    return 0 if exact and not failures else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--redis", help="use this Redis (default: start a throwaway one)")
    p.add_argument("--calls", type=int, default=600, help="tool calls in the burst")
    p.add_argument("--cap", type=int, default=100, help="the cap every guard enforces")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64, help="calls in flight at once")
    p.add_argument("--latency-calls", type=int, default=300, help="timed calls per variant/round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--serve", choices=list(KINDS), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rid", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.cap, args.redis, args.rid)
        return 0
    for name in ("calls", "cap", "replicas", "concurrency", "latency_calls", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1 (got {getattr(args, name)})")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
