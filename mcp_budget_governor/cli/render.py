"""Output shared by the commands: tables for people, one-line errors.

Tables go through rich, so they fit the terminal and stay readable when piped
(no colour codes without a terminal). Every cell, header and title passes
:func:`printable` first: ids come from callers, and an ESC or OSC sequence in
one must print as text, never steer the operator's terminal. Commands that
print machine-readable output (``--json``, ``--csv``) bypass this module.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def printable(value: object) -> str:
    r"""``value`` as text a terminal shows and never obeys: control characters escaped.

    C0 and C1 controls (ESC, the OSC introducer, BEL, CR, ...), DEL and other
    non-printing characters become Python escapes, as ``mcpbg budgets`` shows
    ids; printable text, including non-ASCII letters, stays as it is.

    >>> printable("u1\x1b]8;;http://x\x07")
    'u1\\x1b]8;;http://x\\x07'
    >>> printable("müller"), printable(None), printable(12)
    ('müller', '', '12')
    """
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def one_line(text: str) -> str:
    """``text`` for one line of stderr: control characters (newlines too) escaped."""
    return printable(" ".join(text.splitlines()) if "\n" in text or "\r" in text else text)


def console() -> Console:
    """The console for stdout; wide enough for our tables when piped, unless COLUMNS says."""
    wide = sys.stdout.isatty() or os.environ.get("COLUMNS", "").strip().isdigit()
    return Console(width=None if wide else 200, highlight=False)


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
    out = Table(title=None if title is None else Text(printable(title)), title_justify="left")
    for name in headers:
        if name in right:
            # An amount is never split over two lines: the text columns fold instead.
            out.add_column(Text(printable(name)), justify="right", no_wrap=True)
        else:
            out.add_column(Text(printable(name)), justify="left", overflow="fold")
    for row in rows:
        # Text, not str: a cell holding a caller's id like "[red]x" must print as written,
        # never as rich markup.
        out.add_row(*(Text(printable(cell)) for cell in row))
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
    print(one_line(f"mcpbg {command}: {message}"), file=sys.stderr, flush=True)
    return code
