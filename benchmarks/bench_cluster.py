"""Latency of ``Governor.check()`` (3 limits) on Redis Cluster against a single Redis.

Variants, interleaved in chunks so drift hits all alike, each call timed alone:

- ``single Redis``: the three limits' counters on one local redis-server;
- ``cluster, one slot``: on a 3-master cluster, limit names chosen so that the
  three counters hash to one slot (one script call, like a single Redis);
- ``cluster, three masters``: names chosen so that each counter lives on
  another master (three script calls in parallel, one round trip of wall time);
- ``cluster, three masters, per-tenant caps``: the same spread with per-tenant
  limits and, in force for the checking tenant, a run-time cap on one, a
  run-time plan on another and a grant on the third (the client resolves the
  caps from its copy, re-read every ``caps_refresh`` s: that cost is in it).

Usage::

    python -m benchmarks.bench_cluster [--cluster redis+cluster://h:p,...] [--calls 500]
        [--rounds 3]

Without ``--cluster`` a throwaway 3 + 3 cluster is started on loopback
(``testing.services.start_redis_cluster``) and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from typing import Any

from redis.crc import key_slot

from mcp_budget_governor import (
    MAX_AMOUNT,
    Context,
    Governor,
    Limit,
    Plan,
    Policy,
    RedisBackend,
    Scope,
    Window,
)
from mcp_budget_governor.projections.counters.cluster import parse_cluster_url
from testing import bench
from testing.services import start_redis_cluster


def _key(name: str, tenant: str | None = None) -> bytes:
    from mcp_budget_governor import planning

    scope = Scope.TENANT if tenant else None
    policy = Policy.of(Limit(name, cap=MAX_AMOUNT, window=Window.HOUR, scope=scope))
    return planning.check_slots(policy, Context(tenant=tenant), time.time())[0].key.encode()


def _slot_owner(url: str) -> list[tuple[int, int, int]]:
    import redis

    host, port = parse_cluster_url(url)[0]
    rows = redis.Redis(host=host, port=port).execute_command("CLUSTER SLOTS")
    return [(int(a), int(b), int(m[1])) for a, b, m, *_ in rows]


def names(rid: str, url: str, spread: bool, tenant: str | None = None) -> list[str]:
    """Three limit names whose counters share one slot, or lie on three masters."""
    owners = _slot_owner(url)

    def master(slot: int) -> int:
        return next(m for a, b, m in owners if a <= slot <= b)

    found: list[str] = []
    want_slot: int | None = None
    for i in itertools.count():
        name = f"bc_{rid}_{'t' if tenant else ''}{i}"
        slot = key_slot(_key(name, tenant))
        if not found:
            found.append(name)
            want_slot = slot
        elif spread:
            if master(slot) not in {master(key_slot(_key(n, tenant))) for n in found}:
                found.append(name)
        elif slot == want_slot:
            found.append(name)
        if len(found) == 3:
            return found
    raise AssertionError("unreachable")


async def run(single_url: str, cluster_url: str, rid: str, calls: int, rounds: int) -> Any:
    one_slot = names(rid, cluster_url, spread=False)
    spread = names(rid, cluster_url, spread=True)
    tenant = f"bt_{rid}"
    scoped = names(rid, cluster_url, spread=True, tenant=tenant)

    def gov(url: str, limit_names: list[str]) -> Governor:
        policy = Policy.of(*(Limit(n, cap=MAX_AMOUNT, window=Window.HOUR) for n in limit_names))
        return Governor(policy, RedisBackend.from_url(url, timeout=5.0))

    per_tenant = Governor(
        Policy.of(
            *(Limit(n, cap=MAX_AMOUNT, window=Window.HOUR, scope=Scope.TENANT) for n in scoped),
            plans=[Plan("big", caps={scoped[1]: MAX_AMOUNT - 1})],
        ),
        RedisBackend.from_url(cluster_url, timeout=5.0),
    )
    await per_tenant.set_cap(scoped[0], MAX_AMOUNT - 1, tenant=tenant)
    await per_tenant.assign_plan("big", tenant=tenant)
    await per_tenant.grant(scoped[2], 1, tenant=tenant)
    variants = {
        "single Redis": gov(single_url, spread),
        "cluster, one slot": gov(cluster_url, one_slot),
        "cluster, three masters": gov(cluster_url, spread),
        "cluster, three masters, per-tenant caps": per_tenant,
    }
    ctx = {k: Context(tenant=tenant) if g is per_tenant else Context() for k, g in variants.items()}
    samples: dict[str, list[int]] = {k: [] for k in variants}
    for name, g in variants.items():  # connect, load scripts
        for _ in range(50):
            await g.check(ctx[name])
    chunk = 50
    for r in range(rounds):
        for start in range(0, calls, chunk):
            order = list(variants.items())
            shift = (r + start // chunk) % len(order)
            for name, g in order[shift:] + order[:shift]:
                for _ in range(chunk):
                    t0 = time.perf_counter_ns()
                    d = await g.check(ctx[name])
                    samples[name].append(time.perf_counter_ns() - t0)
                    assert d.admitted and not d.degraded
        bench.progress(f"round {r + 1}/{rounds} done")
    await per_tenant.unset_cap(scoped[0], tenant=tenant)
    await per_tenant.assign_plan(None, tenant=tenant)
    for g in variants.values():
        await g.aclose()
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", help="a cluster URL (default: start a throwaway one)")
    parser.add_argument("--calls", type=int, default=500, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rid = bench.run_id()
    service = None if args.cluster else start_redis_cluster()
    cluster_url = args.cluster or (service.url if service else "")
    try:
        with bench.redis_server(None) as single:
            samples = asyncio.run(run(single.url, cluster_url, rid, args.calls, args.rounds))
            bench.cleanup(single.url, [f"mcpbg:v1:bc_{rid}_*"])
    finally:
        if service is not None:
            service.stop()
    base = bench.median(samples["single Redis"])
    rows = [
        [name, f"{bench.median(s) / 1000:.1f}", f"{bench.median(s) / base:.2f}x"]
        for name, s in samples.items()
    ]
    print(
        f"Governor.check() with 3 limits, {args.rounds} rounds x {args.calls} calls, "
        f"interleaved; load avg {bench.loadavg()}"
    )
    print(bench.table(["variant", "median us", "ratio to single Redis"], rows, [False, True, True]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
