"""The Postgres schema and functions, shipped as files and loaded from here, like ``lua/``.

Each ``NNNN_<name>.sql`` is one migration, applied once, in order, in its own
transaction (``projections.counters.postgres.migrate``; ``mcpbg migrate``).
Any client that can run SQL files can use the same store.

>>> [m.version for m in migrations()][:2]
[1, 2]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

if __name__ != "mcp_budget_governor.sql":  # one name per module (README, Layout)
    raise ImportError("import mcp_budget_governor.sql, not sql")

_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")


@dataclass(frozen=True, slots=True)
class Migration:
    """One versioned migration: its number, name and SQL text."""

    version: int
    name: str
    text: str


@cache
def migrations() -> tuple[Migration, ...]:
    """Every migration shipped with the package, oldest first."""
    found = []
    for entry in files(__name__).iterdir():
        match = _NAME.fullmatch(entry.name)
        if match:
            text = entry.read_text(encoding="utf-8")
            found.append(Migration(int(match.group(1)), match.group(2), text))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"sql/: migrations must be numbered 1..n without gaps: {found}")
    return tuple(found)


def latest() -> int:
    """The schema version this package needs."""
    return migrations()[-1].version
