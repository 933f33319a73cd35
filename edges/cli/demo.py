"""``mcpbg demo``: a governed MCP server under a simulated agent burst, no servers needed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .render import install_hint


def register(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="run an MCP server governed by BudgetMiddleware under a simulated agent burst",
        description="An in-process FastMCP server with BudgetMiddleware; simulated agents of "
        "several users and tenants burst tool calls at it on a simulated clock. Per-user "
        "quotas and burst caps refuse, model tokens are priced, the global breaker trips. "
        "Prints the budgets table and a DuckDB cost summary; writes the ledger and a FOCUS "
        "file into --out. Embedded by default (in-process counters, a file ledger); "
        "--redis (or --postgres) and --kafka run it against real services.",
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default ./mcpbg-demo); a previous demo's output there is replaced",
    )
    demo.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="counters in this Redis (redis://host:port/db; use a scratch database: "
        "today's demo spend stays there until the day ends)",
    )
    demo.add_argument(
        "--postgres",
        metavar="URL",
        default=None,
        help="counters in this Postgres (postgresql://user@host:port/db; migrated on first "
        "use; use a scratch database)",
    )
    demo.add_argument(
        "--kafka",
        metavar="URL",
        default=None,
        help="ledger on this Kafka (kafka://host:port), projected and archived after the run",
    )
    demo.add_argument(
        "--topic",
        default=None,
        help="Kafka topic for --kafka (default a fresh mcpbg.demo.<id> per run)",
    )
    demo.add_argument("--seed", type=int, default=7, help="seed of the simulated agents")
    demo.add_argument(
        "--serve",
        action="store_true",
        help="then serve the console (mcpbg serve) on the demo's own data and print a "
        "one-time login link to its dashboard; Ctrl-C stops it",
    )
    demo.add_argument(
        "--port", type=int, default=8900, help="the console's port with --serve (0: any free one)"
    )
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from ..demo.runner import DEFAULT_OUT, DemoOptions, main_sync
    except ImportError as exc:
        print(
            f"mcpbg demo: {exc}; install the demo's extras: " + install_hint("demo"),
            file=sys.stderr,
        )
        return 2
    from .render import console, fail

    if args.redis is not None:
        from ..urls import check_redis_url

        check_redis_url(args.redis, "--redis")
    if args.postgres is not None:
        from ..urls import check_postgres_url

        check_postgres_url(args.postgres, "--postgres")
        if args.redis is not None:
            return fail("demo", "--postgres: give --redis or --postgres, not both")
    if args.topic is not None and args.kafka is None:
        return fail("demo", f"--topic: only with --kafka (got {args.topic!r})")
    options = DemoOptions(
        out=args.out or DEFAULT_OUT,
        redis_url=args.redis,
        postgres_url=args.postgres,
        kafka_url=args.kafka,
        topic=args.topic,
        seed=args.seed,
        serve=args.serve,
        port=args.port,
    )
    main_sync(options, console())
    return 0
