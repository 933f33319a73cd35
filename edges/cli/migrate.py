"""``mcpbg migrate``: bring a Postgres database to this package's counter schema (``sql/``).

Every ``PostgresBackend`` migrates on first use too; this runs it ahead of a
deployment (or with a role allowed to create tables, when the service's is not).

``mcpbg migrate --from-reference --redis-url URL --policy FILE`` instead moves
the live counters of mcp-budget-governor 0.1.0 in that Redis into ours
(``projections/counters/from_reference.py``); ``--dry-run`` only lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..settings import SETTINGS, env_value
from .ledger_args import add_option, required
from .render import install_hint


def register(sub: Any) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="create or upgrade the counter tables and functions in Postgres; with "
        "--from-reference, move mcp-budget-governor 0.1.0's live counters into ours",
        description="Applies the migrations shipped in the package (sql/NNNN_*.sql) that "
        "the database lacks, each once, in order, under a lock; prints the schema version. "
        "With --from-reference: adds each live counter mcp-budget-governor 0.1.0 kept in "
        "Redis (mcpbg:<limit>:<scope>:<bucket>) to this package's counter of the same limit, "
        "caller and period, then takes it off the old key; run it again after the last "
        "replica of the old package stops.",
    )
    migrate.add_argument(
        "--from-reference", action="store_true",
        help="move mcp-budget-governor 0.1.0's counters (needs --redis-url and --policy)",
    )  # fmt: skip
    migrate.add_argument(
        "--dry-run", action="store_true", help="with --from-reference: list, move nothing"
    )
    add_option(migrate, "redis_url")
    add_option(migrate, "policy", "the policy: a .toml file or package.module:attribute")
    setting = SETTINGS["postgres_url"]
    migrate.add_argument(
        "--postgres", "--postgres-url", dest="postgres_url", metavar="URL",
        help=setting.describe("the database, postgresql://user@host:port/db"),
    )  # fmt: skip
    migrate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.from_reference:
        return _from_reference(args)
    try:
        from ..projections.counters.postgres import migrate
    except ImportError as exc:
        print(f"mcpbg migrate: {exc}; install: " + install_hint("postgres"), file=sys.stderr)
        return 2
    from ..errors import InvalidInputError
    from ..sql import latest

    url = args.postgres_url or env_value("postgres_url")
    if not url:
        env = SETTINGS["postgres_url"].env
        raise InvalidInputError("--postgres", None, f"give --postgres or set {env}")
    applied = asyncio.run(migrate(url))
    done = ", ".join(str(v) for v in applied) if applied else "none needed"
    print(f"mcpbg migrate: schema version {latest()} (applied: {done})")
    return 0


def _from_reference(args: argparse.Namespace) -> int:
    import time

    from ..policy_file import load_policy
    from ..projections.counters.from_reference import move_reference_counters
    from ..projections.counters.redis import RedisBackend
    from ..urls import check_redis_url

    policy = load_policy(required(args, "policy", "a .toml file or module:attribute"))
    url = check_redis_url(required(args, "redis_url", "redis://host:port/db"), "--redis-url")

    async def move() -> int:
        backend = RedisBackend.from_url(url, timeout=5.0, max_connections=2)
        try:
            done = await move_reference_counters(
                backend, policy, now=time.time(), dry_run=args.dry_run
            )
        finally:
            await backend.aclose()
        verb = "would move" if args.dry_run else "moved"
        for old, new, amount in done.moved:
            print(f"{old} -> {new}: {amount}")
        print(
            f"mcpbg migrate --from-reference: {verb} {len(done.moved)} counter(s); "
            f"left {done.ended} whose period ended and {done.unknown} of no policy limit"
        )
        return 0

    return asyncio.run(move())
