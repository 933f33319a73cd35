"""CSV cells that a spreadsheet shows as text, never runs as a formula.

Every CSV the project writes (``mcpbg export focus``, ``mcpbg sql --csv``)
holds caller-chosen strings (user ids, tool names). A string cell starting
with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is prefixed with a
single quote, as OWASP's CSV-injection guidance describes, so ``=HYPERLINK(...)``
opens as the text it is. Only string cells: numbers (a negative amount too)
stay numbers, and Parquet, which has types, is written as it is.
"""

from __future__ import annotations

#: First characters a spreadsheet reads as the start of a formula.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def neutralise(cell: str) -> str:
    """``cell``, quoted with a leading ``'`` when a spreadsheet would run it.

    >>> neutralise("=HYPERLINK(\\"http://x\\")"), neutralise("alice"), neutralise("")
    ('\\'=HYPERLINK("http://x")', 'alice', '')
    """
    return "'" + cell if cell.startswith(FORMULA_STARTS) else cell


def neutralise_sql(expr: str) -> str:
    """The DuckDB SQL of :func:`neutralise` over the VARCHAR ``expr`` (NULL stays NULL).

    The same rule in SQL, for files DuckDB writes itself (``COPY``);
    ``tests/test_csv_safety.py`` holds the two together.
    """
    starts = ", ".join(f"chr({ord(c)})" for c in FORMULA_STARTS)
    return f"CASE WHEN left({expr}, 1) IN ({starts}) THEN '''' || {expr} ELSE {expr} END"


def cell(value: object) -> object:
    """A value for ``csv.writer``: strings neutralised, everything else (numbers) unchanged."""
    return neutralise(value) if isinstance(value, str) else value
