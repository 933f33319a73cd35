"""Redis' own work per script call, in instructions: charge.lua against a no-op EVALSHA.

Wall-clock figures of a few microseconds drown in a shared machine's load; an
instruction count does not. Each variant runs on a fresh ``redis-server`` under
``valgrind --tool=callgrind`` (``--hz 1``, so the server's timer work barely
depends on how slow the run is), N and then 2N EVALSHAs from one client; the
difference over N is the server's instructions per call, start-up and loading
cancelled. The client is not counted: this measures the scripts.

Variants (the bench_check and bench_caps plans, 3 limits each):

- ``noop EVALSHA``: ``return 1``, the floor of a call;
- ``charge, inline``: check()'s charge without a ledger (operation marker, run-time caps looked up);
- ``charge, ledger``: the same with an event id (in-flight parts);
- ``charge, caps hit``: bench_caps' worst case (a run-time cap with an until, a plan
  assigned at run time, a grant on every counter);
- ``floor: charge's Redis operations``: ``testing/charge_floor.lua`` with the inline
  plan's arguments, the very commands charge.lua makes and a reply of the same size,
  no logic: what any script doing that work atomically costs on this Redis;
- ``charge_many, inline`` and ``charge_many, caps hit``: the same checks
  ``autopipe.BATCH_CALLS`` (16) to one call of lua/charge_many.lua, as a burst of
  checks on one connection sends them; reported per check;
- ``--script FILE``: a candidate charge script (its prelude of lib.lua prepended, as
  lua/__init__.py assembles every script) beside the shipped one, inline plan: for
  work on the scripts.

Usage::

    python -m benchmarks.bench_lua [--calls N] [--script candidate.lua] [--json out.json]

Needs valgrind and redis-server on the PATH. A run takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

from benchmarks import bench_caps, bench_check
from mcp_budget_governor import Context, Governor, Plan, Policy, RedisBackend, lua
from mcp_budget_governor.counters import Charge
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.projections.counters.autopipe import BATCH_CALLS
from testing import bench
from testing.services import free_port

LUA = bench.REPO / "lua"
FLOOR = bench.REPO / "testing" / "charge_floor.lua"
Args = Callable[[], list[Any]]


def charge_source(script: Path | None = None) -> str:
    body = (script or LUA / "charge.lua").read_text("utf-8")
    return lua.assemble((LUA / "lib.lua").read_text("utf-8"), body)


async def plan_args(port: int, variant: str) -> Args:
    """The charge arguments of ``variant``'s check, with its run-time state written first."""
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", timeout=60.0)
    if variant == "caps":
        ctx = Context(user="u-l", tenant="t-l", tool="search")
        rules = bench_caps.limits("l", caps=True)
        cap = bench_caps.CAP
        gov = Governor(
            Policy.of(
                *rules,
                plans=[Plan("pro", caps={rules[1].name: cap - 2, rules[2].name: cap - 3})],
                assignments={"user=u-other": "pro"},
            ),
            backend,
        )
        await gov.set_cap(rules[0].name, cap - 4, tenant=ctx.tenant, until=time.time() + 86_400)
        await gov.assign_plan("pro", user=ctx.user)
        for lim in rules:
            scope = {d.value: getattr(ctx, d.value) for d in lim.dimensions}
            await gov.grant(lim.name, 1000, reason="bench", **scope)
    else:
        ctx = bench_check.CTX
        gov = Governor(Policy.of(*bench_check.limits("l", "conc")[:3]), backend)
    await gov.check(ctx)  # the counters exist, as on a warm server
    ops = gov._plan(ctx, time.time()).ops
    await backend.aclose()
    if variant == "ledger":
        return lambda: backend.charge_args(Charge(ops, event_id=new_id()))
    return lambda: backend.charge_args(Charge(ops, op_id=new_id()))


def many_args(charges: Sequence[list[Any]]) -> list[Any]:
    """charge_many.lua's arguments for ``charges`` (each charge.lua's numkeys, KEYS,
    ARGV): every charge's keys, then per charge its number of keys, its number of
    arguments and its arguments (tests/test_charge_many.py uses it too)."""
    keys: list[Any] = []
    argv: list[Any] = []
    for call in charges:
        nkeys = int(call[0])
        keys += call[1 : 1 + nkeys]
        rest = call[1 + nkeys :]
        argv += [nkeys, len(rest), *rest]
    return [len(keys), *keys, *argv]


def batched(one: Args) -> Args:
    """``BATCH_CALLS`` fresh calls of ``one`` as charge_many.lua's arguments."""
    return lambda: many_args([one() for _ in range(BATCH_CALLS)])


def server_instructions(source: str, variant: str, calls: int, workdir: Path) -> int:
    """Instructions of one fresh redis-server that ran ``calls`` EVALSHAs of ``source``."""
    port = free_port()
    out = workdir / f"callgrind.{port}.{time.time_ns()}"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "redis-server",
         "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--hz", "1", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)
    try:
        for _ in range(600):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        if variant == "noop":
            make: Args = lambda: [0]  # noqa: E731
        elif variant.startswith("many:"):
            make = batched(asyncio.run(plan_args(port, variant.removeprefix("many:"))))
        else:
            make = asyncio.run(plan_args(port, variant))
        sha = client.script_load(source)
        for _ in range(calls):
            client.evalsha(sha, *make())
        client.shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # SHUTDOWN closes the connection
    finally:
        proc.wait(timeout=120)
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {out}")


def per_call(source: str, variant: str, calls: int, workdir: Path) -> float:
    """Per check: a charge_many call's count is divided by the checks it carries."""
    one = server_instructions(source, variant, calls, workdir)
    two = server_instructions(source, variant, 2 * calls, workdir)
    return (two - one) / calls / (BATCH_CALLS if variant.startswith("many:") else 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="N (the runs make N and 2N calls)")
    parser.add_argument("--script", type=Path, help="a candidate charge.lua beside the shipped one")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    for tool in ("valgrind", "redis-server"):
        if shutil.which(tool) is None:
            print(f"bench_lua: {tool} is not on the PATH", file=sys.stderr)
            return 2
    shipped = charge_source()
    variants: list[tuple[str, str, str]] = [
        ("noop EVALSHA", "return 1", "noop"),
        ("charge, inline", shipped, "inline"),
        ("charge, ledger", shipped, "ledger"),
        ("charge, caps hit", shipped, "caps"),
        ("floor: charge's Redis operations", FLOOR.read_text("utf-8"), "inline"),
        (f"charge_many, inline, per check of {BATCH_CALLS}", lua.many_source(), "many:inline"),
        (f"charge_many, caps hit, per check of {BATCH_CALLS}", lua.many_source(), "many:caps"),
    ]
    if args.script is not None:
        name = f"candidate {args.script.name}, inline"
        variants.append((name, charge_source(args.script), "inline"))
    got: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mcpbg-bench-lua-") as tmp:
        for name, source, variant in variants:
            bench.progress(f"{name} ...")
            got[name] = per_call(source, variant, args.calls, Path(tmp))
    noop = got["noop EVALSHA"]
    rows = [[name, f"{v:,.0f}", f"{v / noop:.2f}x"] for name, v in got.items()]
    print(
        f"Redis server instructions per call (callgrind, {args.calls} vs {2 * args.calls} calls, "
        "fresh redis-server each)"
    )
    print(bench.table(["variant", "instructions", "vs noop"], rows, [False, True, True]))
    caps_ratio = got["charge, caps hit"] / got["charge, inline"]
    print(f"caps hit / inline: {caps_ratio:.3f}x")
    logic = got["charge, inline"] / got["floor: charge's Redis operations"]
    print(f"charge, inline / its Redis operations alone: {logic:.3f}x")
    many = got[f"charge_many, inline, per check of {BATCH_CALLS}"] / got["charge, inline"]
    print(f"charge_many / charge, inline, per check: {many:.3f}x")
    if args.script is not None:
        cand = got[f"candidate {args.script.name}, inline"]
        print(f"candidate / shipped (inline): {cand / got['charge, inline']:.3f}x")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"per_call": got, "caps_vs_inline": caps_ratio, "inline_vs_floor": logic}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
