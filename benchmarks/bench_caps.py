"""``check()`` with per-customer caps, plans and grants present vs the same check without.

Variants, interleaved in chunks on one Redis and one client (see bench_check.py):

- ``noop EVALSHA``: one EVALSHA of ``lua/noop.lua``, the floor of one round trip;
- ``check() plain``: 3 gated CALLS limits (tenant, user, user+tool), no value
  caps, no plans, nothing set at run time;
- ``check() caps``: the same 3 limits, the policy giving the tenant a value cap
  and the user+tool limit a plan; at run time a cap with an ``until`` on the
  tenant, the user assigned to a plan, and a grant on every counter: every
  lookup ``charge.lua`` makes hits (the worst case);
- ``charge() unresolved``: the plain check's ops without their cap references,
  straight to the backend (flag ``c`` off);
- ``check() unresolved``: the plain check with its cap references stripped,
  the script's pre-caps path: what resolving costs at all.

The target (DESIGN.md): ``check() caps`` / ``check() plain`` <= 1.05 (median, same run).

Usage::

    python -m benchmarks.bench_caps [--redis URL] [--calls N] [--rounds R] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from typing import Any

from mcp_budget_governor import Context, Governor, Limit, Plan, Policy, RedisBackend, Scope, Window
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.planning import check_plan
from testing import bench

TARGET = 1.05
CAP = 10**15  # never refuses


def limits(rid: str, caps: bool) -> list[Limit]:
    tenant_caps = {f"t-{rid}": CAP - 1} if caps else None
    return [
        Limit(f"b{rid}-t", cap=CAP, window=Window.DAY, scope=Scope.TENANT, caps=tenant_caps),
        Limit(f"b{rid}-u", cap=CAP, window=Window.MINUTE, scope=Scope.USER),
        Limit(f"b{rid}-ut", cap=CAP, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    ]


async def run(url: str, rid: str, args: argparse.Namespace) -> dict[str, Any]:
    backend = RedisBackend.from_url(url, timeout=5.0)
    ctx = Context(user=f"u-{rid}", tenant=f"t-{rid}", tool="search")
    plain = Governor(Policy.of(*limits(rid + "p", caps=False)), backend)
    rules = limits(rid + "c", caps=True)
    capped_policy = Policy.of(
        *rules,
        plans=[Plan("pro", caps={rules[1].name: CAP - 2, rules[2].name: CAP - 3})],
        assignments={f"user=u-other-{rid}": "pro"},
    )
    capped = Governor(capped_policy, backend)
    await capped.set_cap(rules[0].name, CAP - 4, tenant=ctx.tenant, until=time.time() + 86_400)
    await capped.assign_plan("pro", user=ctx.user)
    for lim in rules:
        scope = {d.value: getattr(ctx, d.value) for d in lim.dimensions}
        await capped.grant(lim.name, 1000, reason="bench", **scope)
    unresolved = tuple(
        replace(op, ref=None) for op in check_plan(plain.policy, ctx, time.time()).ops
    )
    # The plain check with its cap references stripped: the script's pre-caps path.
    legacy = Governor(Policy.of(*limits(rid + "l", caps=False)), backend)
    planned = legacy._plan
    stripped: dict[int, Any] = {}

    def without_refs(c: Context, now: float, calls: int = 1) -> Any:
        plan = planned(c, now, calls)
        hit = stripped.get(id(plan))
        if hit is None or hit[0] is not plan:
            ops = tuple(replace(op, ref=None) for op in plan.ops)
            hit = stripped[id(plan)] = (plan, replace(plan, ops=ops))
        return hit[1]

    legacy._plan = without_refs  # type: ignore[method-assign]

    noop_script = bench.noop(backend.client)

    async def noop() -> Any:
        return await noop_script()

    async def check_plain() -> Any:
        return await plain.check(ctx)

    async def check_caps() -> Any:
        return await capped.check(ctx)

    async def charge_unresolved() -> Any:
        return await backend.charge(unresolved, op_id=new_id())

    async def check_legacy() -> Any:
        return await legacy.check(ctx)

    variants = [
        ("noop EVALSHA", noop),
        ("check() plain", check_plain),
        ("check() caps", check_caps),
        ("charge() unresolved", charge_unresolved),
        ("check() unresolved", check_legacy),
    ]
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
    assert (await capped.check(ctx)).admitted and (await plain.check(ctx)).admitted
    await backend.aclose()
    med = {name: bench.median(v) for name, v in samples.items()}
    ratio = med["check() caps"] / med["check() plain"]
    return {
        "median_us": {k: round(v / 1000, 2) for k, v in med.items()},
        "caps_vs_plain": round(ratio, 3),
        "plain_vs_noop": round(med["check() plain"] / med["noop EVALSHA"], 3),
        "plain_vs_unresolved_check": round(med["check() plain"] / med["check() unresolved"], 3),
        "target": TARGET,
        "met": ratio <= TARGET,
        "calls_per_variant": args.calls * args.rounds,
    }


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
            bench.cleanup(server.url, [f"mcpbg:v1:b{rid}*", f"mcpbg:v1:_caps:b{rid}*"])
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if results["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
