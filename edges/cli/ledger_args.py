"""Options shared by the commands that read the ledger or the counters.

(replay, reconcile, costs, sql, export, budgets.)

Each option falls back to its environment variable, from the one settings
table (:mod:`mcp_budget_governor.settings`) ``mcpbg worker`` reads too, so
one environment serves every command; help texts name the variable and the
default from there.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp_budget_governor.ledger import DEFAULT_TOPIC as DEFAULT_TOPIC  # the one default
from mcp_budget_governor.settings import SETTINGS, env_value

if TYPE_CHECKING:
    from datetime import datetime

    import duckdb


def add_option(p: Any, name: str, text: str | None = None) -> None:
    """The option of setting ``name``; help ``text`` (else the table's), default, variable."""
    setting = SETTINGS[name]
    p.add_argument(setting.option, help=setting.describe(text))


def add_ledger_options(p: Any) -> None:
    """``--archive-dir`` and ``--ledger-dir``."""
    add_option(p, "archive_dir", "the Parquet archive the worker writes")
    add_option(p, "ledger_dir")


def add_redis_option(p: Any) -> None:
    """``--redis-url``."""
    add_option(p, "redis_url")


def setting(args: argparse.Namespace, name: str) -> str | None:
    """The option's value, else its environment variable's (empty counts as unset),
    else the table's default (None when it has none)."""
    value = getattr(args, name, None)
    if value is None:
        value = env_value(name)
    if value is None:
        value = SETTINGS[name].default or None
    return value


def required(args: argparse.Namespace, name: str, what: str) -> str:
    """A setting that must be given; a one-line error names the option and the variable."""
    from ..errors import InvalidInputError

    value = setting(args, name)
    if value is None:
        s = SETTINGS[name]
        raise InvalidInputError(s.option, None, f"required: {what} (or set {s.env})")
    return value


#: The policy a command reads when neither --policy nor MCPBG_POLICY names one.
DEFAULT_POLICY_FILE = "policy.toml"


def policy_spec(args: argparse.Namespace) -> str:
    """The policy to load: ``--policy``, else ``MCPBG_POLICY``, else ``./policy.toml``
    when there is one; a one-line error naming all three otherwise."""
    from ..errors import InvalidInputError

    value = setting(args, "policy")
    if value:
        return str(value)
    if Path(DEFAULT_POLICY_FILE).is_file():
        return DEFAULT_POLICY_FILE
    s = SETTINGS["policy"]
    raise InvalidInputError(
        s.option,
        None,
        f"required: a .toml file or module:attribute (or set {s.env}, or put a "
        f"{DEFAULT_POLICY_FILE} in the current folder)",
    )


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
