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
from typing import TYPE_CHECKING, Any

from mcp_budget_governor import DISTRIBUTION

if TYPE_CHECKING:
    # rich is imported where a table is drawn: errors, hints and ``mcpbg schema``
    # work without the extras that bring it.
    from rich.console import Console
    from rich.table import Table


def install_hint(extra: str) -> str:
    """How to add an extra's dependencies to this installation.

    >>> install_hint("duckdb")
    "pip install 'mcpbg[duckdb]'"
    """
    return f"pip install '{DISTRIBUTION}[{extra}]'"


# The extra that brings each optional dependency a command may import late (pyproject.toml).
_EXTRA_OF = {
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
    "redis": "redis",
    "aiokafka": "kafka",
    "duckdb": "duckdb",
    "pyarrow": "duckdb",
    "rich": "duckdb",
    "fastmcp": "fastmcp",
    "aiohttp": "stream",
    "prometheus_client": "stream",
    "faust": "faust",
    "starlette": "serve",
    "uvicorn": "serve",
    "opentelemetry": "otel",
}


def missing_dependency(exc: ModuleNotFoundError) -> str:
    """One line for an optional dependency that is not installed: which extra brings it.

    >>> missing_dependency(ModuleNotFoundError("No module named 'psycopg'", name="psycopg"))
    "psycopg is not installed; install the postgres extra: pip install 'mcpbg[postgres]'"
    """
    top = (exc.name or "").split(".")[0]
    extra = _EXTRA_OF.get(top)
    if extra is None:
        return f"{exc}"
    return f"{top} is not installed; install the {extra} extra: {install_hint(extra)}"


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
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit 1 in silence; cli.main says it on one line instead.
            self.quiet = True
            raise BrokenPipeError

    wide = sys.stdout.isatty() or os.environ.get("COLUMNS", "").strip().isdigit()
    return _Console(width=None if wide else 200, highlight=False)


#: The narrowest a text column gets before a table is printed one record per block.
MIN_TEXT_WIDTH = 8


def table(
    title: str | None,
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    numeric: Iterable[str] = (),
    width: int | None = None,
) -> Table:
    """A table with ``headers``; columns named in ``numeric`` are right-aligned.

    An amount is never split over two lines. Given the ``width`` it must fit
    (the terminal's), numeric headers wrap at ``_``, text columns fold, and a
    table that still cannot fit is printed as one block of ``field value``
    lines per record instead (rich draws it: the ``duckdb`` and ``demo`` extras).
    """
    from rich.table import Table
    from rich.text import Text

    right = set(numeric)
    names = [printable(h) for h in headers]
    # Text, not str: a cell holding a caller's id like "[red]x" must print as written,
    # never as rich markup.
    cells = [[printable(cell) for cell in row] for row in rows]
    widths = _plan(names, [h in right for h in headers], cells, width)
    out = Table(title=None if title is None else Text(printable(title)), title_justify="left")
    if widths is None:  # too narrow for the columns side by side: one block per record
        out.add_column("field", overflow="fold")
        out.add_column("value", justify="right", overflow="fold")
        for i, row in enumerate(cells):
            if i:
                out.add_section()
            for name, cell in zip(names, row, strict=True):
                out.add_row(Text(name), Text(cell))
        return out
    for name, is_number, w in zip(names, [h in right for h in headers], widths, strict=True):
        header = Text(name.replace("_", "_\n") if w is not None and len(name) > w else name)
        if is_number:
            out.add_column(header, justify="right", no_wrap=True, width=w)
        else:
            out.add_column(header, justify="left", overflow="fold", width=w)
    for row in cells:
        out.add_row(*(Text(cell) for cell in row))
    return out


def _plan(
    names: Sequence[str], numbers: Sequence[bool], cells: Sequence[Sequence[str]], width: int | None
) -> list[int | None] | None:
    """Column widths that fit ``width``: None each (natural), or None if nothing fits."""
    natural = [max([len(n), *(len(r[i]) for r in cells)]) for i, n in enumerate(names)]
    frame = 3 * len(names) + 1  # "│ " before each column, " │" at the end
    if width is None or sum(natural) + frame <= width:
        return [None] * len(names)
    planned: list[int] = []
    for i, name in enumerate(names):
        if numbers[i]:  # the longest cell, and the longest piece of its header split at "_"
            word = max(len(piece) for piece in name.replace("_", "_\n").splitlines())
            planned.append(max([word, *(len(r[i]) for r in cells)]))
        else:
            planned.append(0)
    texts = [i for i, is_number in enumerate(numbers) if not is_number]
    room = width - frame - sum(planned)
    # Each text column needs its natural width or MIN_TEXT_WIDTH, whichever is less.
    if room < sum(min(natural[i], MIN_TEXT_WIDTH) for i in texts):
        return None
    # Narrow text columns keep their width; the wider ones share what is left.
    for k, i in enumerate(sorted(texts, key=lambda i: natural[i])):
        planned[i] = max(1, min(natural[i], room // (len(texts) - k)))
        room -= planned[i]
    return list(planned)


def print_table(
    title: str | None,
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    numeric: Iterable[str] = (),
) -> None:
    """Render :func:`table` to stdout, fitted to its width."""
    out = console()
    out.print(table(title, headers, rows, numeric=numeric, width=out.width))


def fail(command: str, message: str, code: int = 2) -> int:
    """Print ``mcpbg <command>: <message>`` on one line of stderr; return ``code``."""
    print(one_line(f"mcpbg {command}: {message}"), file=sys.stderr, flush=True)
    return code
