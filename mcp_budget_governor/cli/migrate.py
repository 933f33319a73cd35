"""``mcpbg migrate``: bring a Postgres database to this package's counter schema (``sql/``).

Every ``PostgresBackend`` migrates on first use too; this runs it ahead of a
deployment (or with a role allowed to create tables, when the service's is not).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..settings import SETTINGS, env_value
from .render import install_hint


def register(sub: Any) -> None:
    migrate = sub.add_parser(
        "migrate",
        help="create or upgrade the counter tables and functions in Postgres",
        description="Applies the migrations shipped in the package (sql/NNNN_*.sql) that "
        "the database lacks, each once, in order, under a lock; prints the schema version.",
    )
    setting = SETTINGS["postgres_url"]
    migrate.add_argument(
        "--postgres", "--postgres-url", dest="postgres_url", metavar="URL",
        help=setting.describe("the database, postgresql://user@host:port/db"),
    )  # fmt: skip
    migrate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
