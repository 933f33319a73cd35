"""Hard cap vs soft cap: 50 concurrent $0.05 tool calls against $1 of room.

A real FastMCP server governed by ``BudgetMiddleware`` on a real Redis,
called by a real FastMCP client (in-memory transport), all calls at once
(``asyncio.gather``); each tool call sleeps ``--pause`` seconds so that every
call is in flight before the first one ends. A fresh limit per burst:

- **soft**: the tool declares a fixed price (``cost_usd``); the check reads
  the spend, sees room, and admits every call in flight: the overshoot grows
  with the number of calls in flight;
- **hard**: the tool declares an estimate (``estimate_usd``); each call
  reserves it first, so no more calls run than the room holds; the cost
  callback settles each to its actual cost;
- **hard, estimate low**: the same, with each call costing ``--actual-low``
  (more than its estimate): the overshoot is bounded by the estimate's error
  times the calls admitted, not by the calls in flight.

Usage::

    python -m benchmarks.bench_hardcap [--redis URL] [--calls 50] [--room 1]
        [--price 0.05] [--actual-low 0.06] [--trials 3] [--json out.json]

Without ``--redis`` a throwaway local redis-server is started and stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from decimal import Decimal
from typing import Any

from fastmcp import Client, FastMCP

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Unit, Window, usd
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware
from mcp_budget_governor.money import format_dollars
from testing import bench

CALLER = Context(user="bench")


async def burst(
    url: str,
    limit: str,
    *,
    variant: str,
    calls: int,
    room: int,
    price: str,
    actual: str,
    pause: float,
) -> dict[str, Any]:
    gov = Governor(
        Policy.of(Limit(limit, cap=room, window=Window.DAY, unit=Unit.USD_MICROS)),
        RedisBackend.from_url(url, max_connections=calls + 8),
    )
    mcp = FastMCP("bench")
    if variant == "soft":
        meta = {"mcpbg": {"cost_usd": actual, "limit": limit}}
        middleware = BudgetMiddleware(gov, identify=lambda c: CALLER)
    else:
        meta = {"mcpbg": {"estimate_usd": price, "limit": limit}}
        middleware = BudgetMiddleware(
            gov, identify=lambda c: CALLER, cost=lambda c, r: {limit: usd(actual)}
        )
    mcp.add_middleware(middleware)

    @mcp.tool(meta=meta)
    async def browse() -> str:
        await asyncio.sleep(pause)
        return "page"

    try:
        async with Client(mcp) as client:
            got = await asyncio.gather(
                *(client.call_tool("browse", {}) for _ in range(calls)), return_exceptions=True
            )
        spent = await gov.usage(limit, CALLER)
    finally:
        await gov.aclose()
    admitted = sum(1 for g in got if not isinstance(g, BaseException))
    return {"admitted": admitted, "spent": spent, "over": max(spent - room, 0)}


VARIANTS = ("soft", "hard", "hard_low")


async def run(
    url: str, rid: str, *, calls: int, room: int, price: str, low: str, trials: int, pause: float
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for trial in range(trials):
        for variant in VARIANTS:
            actual = low if variant == "hard_low" else price
            out[variant].append(
                await burst(
                    url,
                    f"bench_{rid}_{variant}_{trial}",
                    variant="soft" if variant == "soft" else "hard",
                    calls=calls,
                    room=room,
                    price=price,
                    actual=actual,
                    pause=pause,
                )
            )
    return out


def report(results: dict[str, list[dict[str, Any]]], *, price: str, low: str) -> str:
    est = usd(price)
    rows = []
    for variant in VARIANTS:
        trials = results[variant]
        worst = max(trials, key=lambda t: t["over"])
        actual = usd(low if variant == "hard_low" else price)
        bound = "-" if variant == "soft" else format_dollars(worst["admitted"] * (actual - est))
        rows.append(
            [
                variant,
                f"${Decimal(price)}" if variant != "soft" else "-",
                f"${Decimal(low if variant == 'hard_low' else price)}",
                ", ".join(str(t["admitted"]) for t in trials),
                format_dollars(worst["spent"]),
                format_dollars(worst["over"]),
                bound,
            ]
        )
    return bench.table(
        ["variant", "estimate", "actual", "admitted", "spent (worst)", "past cap", "bound"],
        rows,
        [False, True, True, True, True, True, True],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="Redis URL (default: start a throwaway local server)")
    parser.add_argument("--calls", type=int, default=50, help="concurrent calls per burst")
    parser.add_argument("--room", default="1", help="USD of room (the limit's cap)")
    parser.add_argument("--price", default="0.05", help="USD per call (and the estimate)")
    parser.add_argument("--actual-low", default="0.06", help="actual USD when the estimate is low")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds each call runs")
    parser.add_argument("--trials", type=int, default=3, help="bursts per variant")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)

    rid = bench.run_id()
    room = usd(args.room)
    with bench.redis_server(args.redis) as server:
        env = bench.environment(server.url, server.origin)
        try:
            results = asyncio.run(
                run(
                    server.url,
                    rid,
                    calls=args.calls,
                    room=room,
                    price=args.price,
                    low=args.actual_low,
                    trials=args.trials,
                    pause=args.pause,
                )
            )
        finally:
            bench.cleanup(server.url, [f"mcpbg:v1:bench_{rid}_*"])
    print(report(results, price=args.price, low=args.actual_low))
    est, low = usd(args.price), usd(args.actual_low)
    bounded = all(
        t["over"] <= t["admitted"] * max(actual - est, 0)
        for variant, actual in (("hard", est), ("hard_low", low))
        for t in results[variant]
    )
    print(f"hard cap overshoot within the estimate error: {bounded}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "hardcap": results}, fh, indent=2)
        bench.progress(f"wrote {args.json}")
    return 0 if bounded else 1


if __name__ == "__main__":
    sys.exit(main())
