"""Output shared by the commands: tables for people, one-line errors.

Tables go through rich, so they fit the terminal and stay readable when piped
(no colour codes without a terminal). Commands that print machine-readable
output (``--json``, ``--csv``) bypass this module.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def console() -> Console:
    """The console for stdout; wide enough for our tables when not a terminal."""
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def table(
    title: str | None,
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    numeric: Iterable[str] = (),
) -> Table:
    """A table with ``headers``; columns named in ``numeric`` are right-aligned.

    >>> t = table("spend", ["user", "usd"], [["u1", "$1.50"]], numeric=["usd"])
    >>> t.row_count
    1
    """
    right = set(numeric)
    out = Table(title=None if title is None else Text(title), title_justify="left")
    for name in headers:
        out.add_column(name, justify="right" if name in right else "left", overflow="fold")
    for row in rows:
        # Text, not str: a cell holding a caller's id like "[red]x" must print as written,
        # never as rich markup.
        out.add_row(*(Text("" if cell is None else str(cell)) for cell in row))
    return out


def print_table(
    title: str | None,
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    numeric: Iterable[str] = (),
) -> None:
    """Render :func:`table` to stdout."""
    console().print(table(title, headers, rows, numeric=numeric))


def fail(command: str, message: str, code: int = 2) -> int:
    """Print ``mcpbg <command>: <message>`` on one line of stderr; return ``code``."""
    print(f"mcpbg {command}: {message}", file=sys.stderr)
    return code
