"""``mcpbg reconcile``: compare every live counter with the ledger; ``--fix`` repairs drift.

Exit code 0 when every counter equals the ledger's total for it, 1 when any
drifts (the table names each key; also with ``--fix``, which repairs them: a
second run then exits 0), 2 for bad input, an unreachable Redis, an
empty or corrupt ledger. Exact while a worker runs (``projections/reconcile.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .ledger_args import add_ledger_options, add_redis_option, open_ledger_from, required


def register(sub: Any) -> None:
    p = sub.add_parser(
        "reconcile",
        help="compare every live counter with the ledger; exit 1 on drift; --fix repairs",
        description="Committed amounts are compared with the ledger's charges at offsets up to "
        "each partition's applied watermark, read in one atomic snapshot, so a running "
        "worker causes no false drift. In-flight amounts are shown, not compared.",
    )
    add_redis_option(p)
    add_ledger_options(p)
    p.add_argument(
        "--fix",
        action="store_true",
        help="add the difference to each drifting counter (and drop stale in-flight entries)",
    )
    p.add_argument("--show", type=int, default=100, help="drifting keys listed (default 100)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import InvalidInputError
    from ..projections.counter_sync import redis_client
    from ..projections.reconcile import reconcile
    from .render import console, print_table

    if args.show < 0:
        raise InvalidInputError("--show", args.show, "0 or more")
    redis_url = required(args, "redis_url", "the counters' Redis, redis://host:port/db")
    client = redis_client(redis_url)  # first: a bad URL is the error to see
    try:
        con = open_ledger_from(args)
    except BaseException:
        client.close()
        raise
    try:
        result = reconcile(con, client, fix=args.fix)
    finally:
        client.close()
        con.close()
    if args.json:
        json.dump(
            {
                "compared": result.compared,
                "in_flight": result.in_flight,
                "watermarks": result.watermarks,
                "fixed": result.fixed,
                "drift": [
                    {
                        "key": d.key,
                        "redis": d.redis,
                        "ledger": d.ledger,
                        "drift": d.drift,
                        "in_flight": d.in_flight,
                        "stale_in_flight": d.stale,
                    }
                    for d in result.drifts
                ],
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
    else:
        if result.drifts:
            print_table(
                f"drift: {len(result.drifts):,} of {result.compared:,} counters"
                + (" (fixed)" if result.fixed else ""),
                ["key", "redis", "ledger", "drift", "in-flight", "stale in-flight"],
                [
                    [d.key, d.redis, d.ledger, f"{d.drift:+d}", d.in_flight, d.stale]
                    for d in result.drifts[: args.show]
                ],
                numeric=["redis", "ledger", "drift", "in-flight", "stale in-flight"],
            )
            if len(result.drifts) > args.show:
                console().print(f"... and {len(result.drifts) - args.show:,} more (--show N)")
        else:
            console().print(
                f"no drift: {result.compared:,} counters equal the ledger "
                f"(in flight: {result.in_flight:,})"
            )
    return 1 if result.drifts else 0
