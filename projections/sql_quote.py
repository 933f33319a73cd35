"""Quoting for the SQL text the read models build: one rule for names, one for strings.

Values go to DuckDB as parameters (``?``) wherever it takes them. What it does
not take there (a view's body, a ``COPY ... TO`` file, a column name) is
spliced into the text through these two functions, never by hand.

>>> quote_ident('limit'), quote_ident('a"b')
('"limit"', '"a""b"')
>>> quote_string("O'Brien's ledger")
"'O''Brien''s ledger'"
"""

from __future__ import annotations

import os

__all__ = ["quote_ident", "quote_string"]


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier (double quotes doubled): safe for keywords."""
    return '"' + name.replace('"', '""') + '"'


def quote_string(value: str | os.PathLike[str]) -> str:
    """``value`` as a SQL string literal (single quotes doubled); paths as their text."""
    return "'" + str(value).replace("'", "''") + "'"
