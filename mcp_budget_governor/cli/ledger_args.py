"""Options shared by the commands that read the ledger or the counters.

(replay, reconcile, costs, sql, export, budgets.)

Each option falls back to its ``MCPBG_*`` environment variable, the names
``mcpbg worker`` uses, so one environment serves every command.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from mcp_budget_governor.ledger import DEFAULT_TOPIC as DEFAULT_TOPIC  # the one default

if TYPE_CHECKING:
    from datetime import datetime

    import duckdb

#: option -> environment variable
ENV = {
    "archive_dir": "MCPBG_ARCHIVE_DIR",
    "ledger_dir": "MCPBG_LEDGER_DIR",
    "redis_url": "MCPBG_REDIS_URL",
    "kafka_url": "MCPBG_KAFKA_URL",
    "topic": "MCPBG_TOPIC",
    "policy": "MCPBG_POLICY",
}


def add_ledger_options(p: Any) -> None:
    """``--archive-dir`` and ``--ledger-dir``."""
    p.add_argument(
        "--archive-dir",
        help="the Parquet archive the worker writes (env MCPBG_ARCHIVE_DIR)",
    )
    p.add_argument(
        "--ledger-dir",
        help="the embedded mode's file-ledger folder (env MCPBG_LEDGER_DIR)",
    )


def add_redis_option(p: Any) -> None:
    """``--redis-url``."""
    p.add_argument(
        "--redis-url", help="the counters' Redis, redis://host:port/db (env MCPBG_REDIS_URL)"
    )


def setting(args: argparse.Namespace, name: str) -> str | None:
    """The option's value, else its environment variable's (empty counts as unset)."""
    value = getattr(args, name, None)
    if value is None:
        value = os.environ.get(ENV[name], "").strip() or None
    return value


def required(args: argparse.Namespace, name: str, what: str) -> str:
    """A setting that must be given; a one-line error names the option and the variable."""
    from ..errors import InvalidInputError

    value = setting(args, name)
    if value is None:
        option = "--" + name.replace("_", "-")
        raise InvalidInputError(option, None, f"required: {what} (or set {ENV[name]})")
    return value


def open_ledger_from(
    args: argparse.Namespace, since: datetime | None = None, until: datetime | None = None
) -> duckdb.DuckDBPyConnection:
    """The ledger view over ``--archive-dir`` and/or ``--ledger-dir``.

    ``since`` / ``until``: the command's time range, when it has one; only the
    archive's date folders of that range are read (``open_ledger``).
    """
    from ..projections.ledger_view import open_ledger

    return open_ledger(
        setting(args, "archive_dir"), setting(args, "ledger_dir"), since=since, until=until
    )
