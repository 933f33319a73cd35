"""The candidate Redis clients for the hot path, side by side (issue 15).

Clients, each with its own defaults and concurrency model, all to the same Redis:

- ``redis-py``: ``redis.asyncio`` with hiredis, the pool ``RedisBackend.from_url``
  builds (a blocking pool of 64 connections: one connection per call in flight).
- ``coredis``: ``coredis.Redis`` (its default pool; requests multiplexed on a connection).
- ``glide``: valkey-glide's asyncio ``GlideClient`` (one multiplexed connection,
  driven by its Rust core in threads of its own).
- ``autopipe``: the project's own auto-pipelined asyncio connection
  (``projections/counters/autopipe.py``, what ``RedisBackend`` sends through).
- ``bare socket``: an ``asyncio.Protocol`` writing the command packed by
  ``hiredis.pack_command`` and reading the reply with a hiredis ``Reader``, one call
  at a time: the floor of a round trip from Python. The baseline.

Serial latency, one call at a time, each timed with ``perf_counter_ns``, for
every client: a no-op EVALSHA (``testing/noop.lua``) and the exact charge.lua
EVALSHA a 3-limit inline ``check()`` sends (``RedisBackend.charge_args``: its
KEYS and ARGV, a fresh operation id per call); then ``RedisBackend.charge(ops)``
and ``Governor.check(ctx)`` themselves. Variants are interleaved in chunks,
rotating the order each pass, so drift on a busy machine hits all alike.

Throughput, unless ``--no-rates``: 64 concurrent callers of that charge EVALSHA
per client (and of ``Governor.check``), calls/s, interleaved trials, with the CPU
seconds this process spent per call (all its threads) and the connections each
client opened.

Usage::

    python -m benchmarks.bench_clients [--redis URL] [--calls N] [--rounds R]
        [--json out.json] [--no-rates]

Needs the ``bench-clients`` extra (coredis, valkey-glide): without it, one line
names the extra and the exit status is 2. Without ``--redis`` a throwaway local
redis-server is started and stopped; with it, only this run's keys are touched,
and deleted at the end. Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import redis

from benchmarks.bench_check import CTX, Variant, _server_usec, limits, measure, summarize
from mcp_budget_governor import Governor, Policy, RedisBackend, planning
from mcp_budget_governor.counters import Charge
from mcp_budget_governor.keys import op_key
from mcp_budget_governor.projections.counters.autopipe import Address, Pipe, pack
from testing import bench

EXTRA = "bench-clients"
CALLERS = 64
OPTIONAL = {"coredis": "coredis", "glide": "valkey-glide", "hiredis": "hiredis"}
CLIENTS = ("redis-py", "coredis", "glide", "autopipe")


def load_optional() -> dict[str, ModuleType] | None:
    """coredis, glide and hiredis, or None (and one line on stderr) when any is missing."""
    mods: dict[str, ModuleType] = {}
    missing = []
    for module, package in OPTIONAL.items():
        try:
            mods[module] = importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        print(
            f"bench_clients needs the {EXTRA} extra (missing: {', '.join(missing)}): "
            f"pip install -e '.[{EXTRA}]'",
            file=sys.stderr,
        )
        return None
    return mods


class Bare(asyncio.Protocol):
    """One call at a time over a plain asyncio connection: the floor of a round trip."""

    def __init__(self, hiredis: ModuleType) -> None:
        self.reader = hiredis.Reader()
        self.waiting: asyncio.Future[Any] | None = None
        self.transport: asyncio.Transport | None = None

    @classmethod
    async def open(cls, address: Address, hiredis: ModuleType) -> Bare:
        loop = asyncio.get_running_loop()
        proto = cls(hiredis)
        transport, _ = await loop.create_connection(lambda: proto, address.host, address.port)
        import socket

        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        proto.transport = transport
        if address.password is not None:
            user = [address.username] if address.username else []
            await proto.call(pack(["AUTH", *user, address.password]))
        if address.db:
            await proto.call(pack(["SELECT", address.db]))
        return proto

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        reply = self.reader.gets()
        if reply is not False and self.waiting is not None:
            fut, self.waiting = self.waiting, None
            fut.set_result(reply)

    def call(self, packed: bytes) -> asyncio.Future[Any]:
        assert self.transport is not None
        fut = self.waiting = asyncio.get_running_loop().create_future()
        self.transport.write(packed)
        return fut

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class ChargeArgs:
    """The arguments of a 3-limit inline check's charge.lua EVALSHA (after the sha),
    as bytes, with a fresh operation id per call (``RedisBackend.charge_args``)."""

    SENTINEL = "__op__"

    def __init__(self, backend: RedisBackend, ops: Any, rid: str) -> None:
        raw = backend.charge_args(Charge(ops, op_id=self.SENTINEL))
        self.template = [a if isinstance(a, bytes) else str(a).encode() for a in raw]
        self.key_at = self.template.index(op_key(self.SENTINEL).encode())
        self.id_at = self.template.index(self.SENTINEL.encode())
        self.numkeys = int(self.template[0])
        self.prefix = f"bench_{rid}_op_"
        self.n = 0

    def next(self) -> list[bytes]:
        self.n += 1
        op_id = f"{self.prefix}{self.n}"
        args = self.template.copy()
        args[self.key_at] = op_key(op_id).encode()
        args[self.id_at] = op_id.encode()
        return args


@dataclass
class Clients:
    """Per client: a no-op EVALSHA and the charge EVALSHA, as zero-argument awaitables."""

    noop: dict[str, Callable[[], Awaitable[Any]]] = field(default_factory=dict)
    charge: dict[str, Callable[[], Awaitable[Any]]] = field(default_factory=dict)
    model: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)


def charged(reply: Any) -> bool:
    return int(reply[0]) == 0


async def build(
    mods: dict[str, ModuleType],
    backend: RedisBackend,
    address: Address,
    args: ChargeArgs,
    stack: contextlib.AsyncExitStack,
) -> tuple[Clients, Bare]:
    coredis, glide, hiredis = mods["coredis"], mods["glide"], mods["hiredis"]
    client = backend.client
    noop_sha = await client.script_load(bench.noop(client).script)
    charge_sha = await client.script_load(backend._charge.script)
    c = Clients()

    # redis-py: the backend's own client (its pool); the project packs nothing here.
    execute = client.execute_command
    c.noop["redis-py"] = lambda: execute("EVALSHA", noop_sha, 0)
    c.charge["redis-py"] = lambda: execute("EVALSHA", charge_sha, *args.next())
    pool = client.connection_pool
    c.model["redis-py"] = f"pool of {pool.max_connections} connections (BlockingConnectionPool)"

    cd = coredis.Redis(
        host=address.host,
        port=address.port,
        db=address.db,
        username=address.username,
        password=address.password,
        stream_timeout=5.0,
        connect_timeout=5.0,
    )
    await stack.enter_async_context(cd)
    nk = args.numkeys

    def cd_charge() -> Any:
        a = args.next()
        return cd.evalsha(charge_sha, keys=a[1 : 1 + nk], args=a[1 + nk :])

    c.noop["coredis"] = lambda: cd.evalsha(noop_sha)
    c.charge["coredis"] = cd_charge
    c.model["coredis"] = (
        f"pool of {cd.connection_pool.max_connections}, requests multiplexed (RESP3)"
    )

    credentials = None
    if address.password is not None:
        credentials = glide.ServerCredentials(address.password, address.username)
    config = glide.GlideClientConfiguration(
        [glide.NodeAddress(address.host, address.port)],
        database_id=address.db,
        credentials=credentials,
        request_timeout=5000,
    )
    gl = await glide.GlideClient.create(config)
    stack.push_async_callback(gl.close)
    custom = gl.custom_command
    noop_cmd = [b"EVALSHA", noop_sha.encode(), b"0"]
    c.noop["glide"] = lambda: custom(noop_cmd)
    c.charge["glide"] = lambda: custom([b"EVALSHA", charge_sha.encode(), *args.next()])
    c.model["glide"] = "one multiplexed connection, Rust core in its own threads (RESP3)"

    pipe = Pipe(address, 5.0)
    stack.callback(pipe.close)
    noop_packed = pack(["EVALSHA", noop_sha, 0])
    c.noop["autopipe"] = lambda: pipe.call(noop_packed)
    c.charge["autopipe"] = lambda: pipe.call(pack(["EVALSHA", charge_sha, *args.next()]))
    c.model["autopipe"] = "one auto-pipelined connection per event loop"

    bare = await Bare.open(address, hiredis)
    stack.callback(bare.close)
    c.noop["bare socket"] = lambda: bare.call(hiredis.pack_command(("EVALSHA", noop_sha, 0)))
    c.charge["bare socket"] = lambda: bare.call(
        hiredis.pack_command(("EVALSHA", charge_sha, *args.next()))
    )

    c.versions = {
        "redis-py": redis.__version__,
        "hiredis": str(getattr(hiredis, "__version__", "?")),
        "coredis": str(coredis.__version__),
        "glide": _version("valkey-glide"),
    }
    return c, bare


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def variants(
    c: Clients, backend: RedisBackend, gov: Governor, ops: Any, args: ChargeArgs
) -> list[Variant]:
    out = [
        Variant("bare socket: noop EVALSHA", "1", "bare", c.noop["bare socket"], lambda r: r == 1),
        Variant("bare socket: charge EVALSHA", "1", "bare-ch", c.charge["bare socket"], charged),
    ]
    for name in CLIENTS:
        out.append(
            Variant(f"{name}: noop EVALSHA", "1", f"{name}", c.noop[name], lambda r: int(r) == 1)
        )
        out.append(Variant(f"{name}: charge EVALSHA", "1", f"{name}-ch", c.charge[name], charged))

    counter = itertools.count()

    def backend_charge() -> Any:
        return backend.charge(ops, op_id=f"{args.prefix}b{next(counter)}")

    out.append(
        Variant(
            "RedisBackend.charge(ops) (autopipe)",
            "1",
            "charge",
            backend_charge,
            lambda r: r.admitted,
        )
    )
    out.append(
        Variant(
            "Governor.check(ctx), 3 limits (autopipe)",
            "1",
            "check3",
            lambda: gov.check(CTX),
            lambda d: d.admitted and not d.degraded,
        )
    )
    return out


def connected(url: str) -> int:
    client = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        return int(client.info("clients")["connected_clients"])
    finally:
        client.close()


async def rates(
    url: str, calls: dict[str, Callable[[], Awaitable[Any]]], *, per_caller: int, trials: int
) -> dict[str, Any]:
    """Calls/s and CPU us per call of ``CALLERS`` concurrent callers of each entry,
    interleaved trials (the order rotates), after one warm-up trial each."""

    async def rate(call: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
        async def caller() -> None:
            for _ in range(per_caller):
                await call()

        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(CALLERS)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        n = CALLERS * per_caller
        return n / wall, cpu / n * 1e6

    names = list(calls)
    conns: dict[str, int] = {}
    for name in names:  # warm: connections, pools; count what each opened
        before = await asyncio.to_thread(connected, url)
        await rate(calls[name])
        conns[name] = await asyncio.to_thread(connected, url) - before
    got: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for t in range(trials):
        shift = t % len(names)
        for name in names[shift:] + names[:shift]:
            r, c = await rate(calls[name])
            got[name].append(r)
            cpu[name].append(c)
        bench.progress(
            f"rates trial {t + 1}/{trials}: " + " ".join(f"{n}={got[n][-1]:.0f}/s" for n in names)
        )
    return {
        name: {
            "per_s": got[name],
            "median_per_s": bench.median(got[name]),
            "cpu_us_per_call": bench.median(cpu[name]),
            "connections_opened": conns[name],
        }
        for name in names
    }


async def run(
    url: str, rid: str, args: argparse.Namespace, mods: dict[str, ModuleType]
) -> dict[str, Any]:
    backend = RedisBackend.from_url(url, timeout=5.0)
    address = Address.of_client(backend.client)
    assert address is not None
    policy = Policy.of(*limits(rid, "clients")[:3])
    gov = Governor(policy, backend)
    ops = tuple(s.op for s in planning.check_slots(policy, CTX, time.time()))
    charge_args = ChargeArgs(backend, ops, rid)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(backend.aclose)
        c, _bare = await build(mods, backend, address, charge_args, stack)
        vs = variants(c, backend, gov, ops, charge_args)
        await measure(
            vs, rounds=args.rounds, calls=args.calls, chunk=args.chunk, warmup=args.warmup
        )
        out: dict[str, Any] = {"variants": summarize(vs), "models": c.model, "versions": c.versions}
        bench.progress("server-side time per EVALSHA (INFO commandstats) ...")
        out["server_us"] = {
            "noop": await _server_usec(backend.client, c.noop["bare socket"]),
            "charge": await _server_usec(backend.client, c.charge["bare socket"]),
        }
        if not args.no_rates:
            bench.progress(
                f"rates: {CALLERS} concurrent callers of the charge EVALSHA per client ..."
            )
            calls = {name: c.charge[name] for name in CLIENTS}
            calls["Governor.check (autopipe)"] = lambda: gov.check(CTX)
            out["rates"] = await rates(url, calls, per_caller=args.rate_calls, trials=args.trials)
    return out


def client_table(results: dict[str, Any]) -> str:
    v = results["variants"]
    floor = v["bare socket: noop EVALSHA"]["median_us"]
    rates_ = results.get("rates", {})
    auto = rates_.get("autopipe", {}).get("median_per_s")
    headers = [
        "client", "noop us", "x bare", "charge us", "x bare", f"{CALLERS} callers/s",
        "x autopipe", "CPU us/call", "+conns",
    ]  # fmt: skip
    rows = []
    for name in (*CLIENTS, "bare socket"):
        noop, ch = v[f"{name}: noop EVALSHA"], v[f"{name}: charge EVALSHA"]
        r = rates_.get(name)
        rows.append(
            [
                name,
                f"{noop['median_us']:.1f}",
                f"{noop['median_us'] / floor:.2f}x",
                f"{ch['median_us']:.1f}",
                f"{ch['median_us'] / floor:.2f}x",
                f"{r['median_per_s']:.0f}" if r else "-",
                f"{r['median_per_s'] / auto:.2f}x" if r and auto else "-",
                f"{r['cpu_us_per_call']:.1f}" if r else "-",
                str(r["connections_opened"]) if r else "-",
            ]
        )
    return bench.table(headers, rows, [False, *([True] * 8)])


def variant_table(results: dict[str, Any]) -> str:
    headers = ["variant", "median us", "p99 us", "x bare noop", "per-round"]
    rows = []
    for name, r in results["variants"].items():
        lo, hi = min(r["per_round_ratio"]), max(r["per_round_ratio"])
        rows.append(
            [
                name,
                f"{r['median_us']:.1f}",
                f"{r['p99_us']:.1f}",
                f"{r['ratio_median']:.2f}x",
                f"{lo:.2f}-{hi:.2f}x",
            ]
        )
    return bench.table(headers, rows, [False, True, True, True, True])


def _load(avg: tuple[float, ...] | None) -> str:
    return "n/a" if avg is None else "/".join(f"{x:.2f}" for x in avg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: start a throwaway local server)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--chunk", type=int, default=50, help="calls per variant per turn")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls per variant")
    parser.add_argument("--rate-calls", type=int, default=100, help="calls per caller in the rates")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials of the rates")
    parser.add_argument("--no-rates", action="store_true", help="serial latency only")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    mods = load_optional()
    if mods is None:
        return 2

    rid = bench.run_id()
    started = time.time()
    load_before = bench.loadavg()
    with bench.redis_server(args.redis) as server:
        env = bench.environment(server.url, server.origin)
        bench.progress(
            f"redis {env['redis_server']} ({server.origin}); {args.rounds} rounds x "
            f"{args.calls} calls x 12 variants"
        )
        try:
            results = asyncio.run(run(server.url, rid, args, mods))
        finally:
            bench.cleanup(server.url, [f"mcpbg:v1:bench_{rid}_*", op_key(f"bench_{rid}_*")])
    env["loadavg_before"] = load_before
    env["loadavg_after"] = bench.loadavg()
    env["seconds"] = round(time.time() - started, 1)
    env["clients"] = results["versions"]

    ver = results["versions"]
    print(
        f"Redis clients for the hot path: {args.rounds} rounds x {args.calls} calls per variant, "
        f"interleaved; Redis {env['redis_server']} ({server.origin}); Python {env['python']}, "
        f"redis-py {ver['redis-py']} + hiredis {ver['hiredis']}, coredis {ver['coredis']}, "
        f"valkey-glide {ver['glide']}; {env['cpus']} CPUs; load avg "
        f"{_load(env['loadavg_before'])} -> {_load(env['loadavg_after'])}"
    )
    print()
    print(
        "Per client (serial medians; 'x bare': over the bare-socket no-op EVALSHA; "
        f"charge: the EVALSHA of a 3-limit check; rates: {CALLERS} concurrent callers of it):"
    )
    print(client_table(results))
    print(
        f"  ('CPU us/call': this process, all its threads; '+conns': connections opened for "
        f"the {CALLERS} callers beyond those the serial calls used)"
    )
    for name, model in results["models"].items():
        print(f"  {name}: {model}")
    print()
    print(variant_table(results))
    v = results["variants"]
    check3 = v["Governor.check(ctx), 3 limits (autopipe)"]
    bare = v["bare socket: noop EVALSHA"]
    bare_ch = v["bare socket: charge EVALSHA"]
    print()
    print(
        f"check() 3 limits vs the bare-socket no-op EVALSHA: {check3['ratio_median']:.2f}x "
        f"(aim <= 2x); vs the bare-socket charge EVALSHA: "
        f"{check3['median_us'] / bare_ch['median_us']:.2f}x; the charge's own server and "
        f"wire cost (bare charge - bare noop): {bare_ch['median_us'] - bare['median_us']:.1f} us"
    )
    srv = results["server_us"]
    print(
        f"Inside Redis (INFO commandstats, us per call): noop.lua {srv['noop']:.1f}, "
        f"charge.lua 3 counters {srv['charge']:.1f}"
    )
    if "rates" in results:
        r = results["rates"]
        g = r["Governor.check (autopipe)"]
        print(
            f"Governor.check at {CALLERS} callers: {g['median_per_s']:.0f}/s "
            f"({g['cpu_us_per_call']:.1f} CPU us/call of this process)"
        )
    failed = {k: x["failed_checks"] for k, x in v.items() if x["failed_checks"]}
    if failed:
        print(f"WARNING: calls refused or failed (numbers invalid): {failed}")

    if args.json:
        payload = {
            "environment": env,
            "config": {
                k: getattr(args, k)
                for k in ("calls", "rounds", "chunk", "warmup", "rate_calls", "trials", "redis")
            },
            **results,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        bench.progress(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
