"""The shipped migrations are append-only: a released one never changes.

A database applies each migration once (``mcpbg_migrations``), so an edit to an
applied file would reach new databases and never the existing ones, and two
stores of one deployment would run different functions. A later migration
changes a function instead (``CREATE OR REPLACE``, as 0004 does for
``mcpbg_charge``); this test holds the released files to their digests.
Adding a migration: add its line below.

So a function's live body is its newest ``CREATE`` across the files: a migrated
database is held to exactly those, and docs/postgres.md's table to where each is.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from mcp_budget_governor.sql import migrations

RELEASED = {
    1: "74b741956723fcd3ded580ee5ca23a0105e2ed2741b8ff857d3da67b8b5ab498",
    2: "a82cdaf9d8f717208227331b6d71f41a0022fe2057f1676d32a7a04ec9eb61c0",
    3: "eca093b6559a708168ea3519715c051c8b5441380a2716d450da0ce6cfb9ef25",
    4: "a2a6a3e95f529f6ed010b4186b9889b1ea4272f33e61ebe74f9b83758e29745c",
    5: "c60447295bb389fe17213d2a8b22e7e327cc24d27ad1034b103200a94432596c",
    6: "4c63359d8f531cf2dedf0102eb7a0d2f634eba72ef98cb29440fec1623dd2c7d",
    7: "1115a31e074107eb3cc3e0e2e902d92e1abcbcaf5e1a9855c9ab3e42d9331637",
    8: "701105e0bc8715c1bb01dd838474e6f643c799d3ad70c730264ab70ac1b7b3b1",
    9: "aec0eff07ab67e370ce2ee4d63b617838085cf44f1d14d29559f364d5cc5c9ec",
    10: "3a373a0c689f84b9a4e71925a9faa3cc5c2e682b48c5becefe29e341962bf484",
}


def test_released_migrations_are_unchanged() -> None:
    changed = [
        f"{m.version:04d}_{m.name}.sql"
        for m in migrations()
        if m.version in RELEASED
        and hashlib.sha256(m.text.encode()).hexdigest() != RELEASED[m.version]
    ]
    assert not changed, (
        f"released migrations edited: {changed}; databases that applied them keep the old "
        "text. Put the change in a new migration (CREATE OR REPLACE FUNCTION ...)."
    )


def test_every_migration_is_on_the_released_list() -> None:
    """A new migration is added to RELEASED in the commit that adds it (so the next
    edit to it is caught too)."""
    assert [m.version for m in migrations()] == sorted(RELEASED)


# -- the live function bodies ----------------------------------------------------

_CREATE = re.compile(
    r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(mcpbg_\w+)\s*\((.*?)\)\s*RETURNS\b.*?"
    r"\bAS\s+\$\$(.*?)\$\$",
    re.DOTALL | re.IGNORECASE,
)
_DROP = re.compile(r"DROP\s+FUNCTION\s+(?:IF\s+EXISTS\s+)?(mcpbg_\w+)\s*\(", re.IGNORECASE)


@dataclass(frozen=True)
class Definition:
    """A function's newest definition across the migrations: where, its arguments, body."""

    file: str
    arguments: str
    body: str


def newest_definitions() -> dict[str, Definition]:
    """Each ``mcpbg_*`` function the migrations leave, by name, as its last
    ``CREATE [OR REPLACE] FUNCTION`` states it (a ``DROP FUNCTION`` after it removes it)."""
    newest: dict[str, Definition] = {}
    for m in migrations():
        file = f"{m.version:04d}_{m.name}.sql"
        events = [(d.start(), d.group(1), None) for d in _DROP.finditer(m.text)]
        for c in _CREATE.finditer(m.text):
            arguments = " ".join(c.group(2).split())
            events.append((c.start(), c.group(1), Definition(file, arguments, c.group(3))))
        for _, name, definition in sorted(events, key=lambda e: e[0]):
            if definition is None:
                newest.pop(name, None)
            else:
                newest[name] = definition
    return newest


def test_the_live_functions_are_their_newest_definitions(postgres_server: str) -> None:
    """A database migrated from nothing runs, for every ``mcpbg_*`` function, exactly
    the newest definition the files state (one function per name: a later migration
    restating an older signature would leave a second overload), so the newest
    ``CREATE`` in sql/ is the live body (docs/postgres.md lists where each is)."""
    import asyncio

    import psycopg

    from mcp_budget_governor.projections.counters.postgres import migrate
    from testing.postgres import scratch_database

    newest = newest_definitions()
    with scratch_database(postgres_server, "mcpbg_functions") as url:
        asyncio.run(migrate(url))
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                "SELECT p.proname, pg_get_function_arguments(p.oid), p.prosrc FROM pg_proc p "
                "JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = current_schema() AND p.proname LIKE 'mcpbg\\_%' "
                "ORDER BY 1, 2"
            ).fetchall()
    names = [name for name, _, _ in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"{twice}: a migration left an older signature (DROP FUNCTION it)"
    live = {name: (" ".join(args.split()), src) for name, args, src in rows}
    assert sorted(live) == sorted(newest)
    for name, (arguments, body) in live.items():
        assert arguments == newest[name].arguments, (name, newest[name].file)
        assert body == newest[name].body, f"{name}: the live body is not {newest[name].file}'s"


def test_docs_name_where_each_live_body_is() -> None:
    """docs/postgres.md's table of the live bodies is the migrations' newest definitions:
    a migration restating a function moves its row."""
    doc = (Path(__file__).parents[1] / "docs" / "postgres.md").read_text()
    section = doc.split("### Where each function's live body is", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(mcpbg_\w+)` \| `sql/(\d{4}_\w+\.sql)` \|", section, re.MULTILINE)
    assert dict(rows) == {name: d.file for name, d in newest_definitions().items()}
    assert len(rows) == len(dict(rows))


#: The longest run of statement lines two live bodies may share (6 today, rewrite and
#: rewrite_staged's bucket filter): longer, and the shared part wants a function of its own.
SHARED_RUN = 8


def _statements(body: str) -> list[str]:
    """A body's lines that say something: stripped, blanks and ``--`` comments left out."""
    return [s for line in body.splitlines() if (s := line.strip()) and not s.startswith("--")]


def _longest_shared_run(a: list[str], b: list[str]) -> int:
    """The length of the longest run of consecutive lines ``a`` and ``b`` both hold.

    >>> _longest_shared_run(["x", "y", "z", "w"], ["q", "y", "z", "r"])
    2
    """
    best, previous = 0, [0] * (len(b) + 1)
    for x in a:
        current = [0] * (len(b) + 1)
        for j, y in enumerate(b):
            if x == y:
                current[j + 1] = previous[j] + 1
                best = max(best, current[j + 1])
        previous = current
    return best


def test_the_live_functions_do_not_restate_each_other() -> None:
    """The functions a migrated database runs share their common part instead of
    copying it (a released migration may restate an older body whole: those are not
    live, and stay as released)."""
    bodies = {name: _statements(d.body) for name, d in newest_definitions().items()}
    names = sorted(bodies)
    shared = [
        (a, b, n)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if (n := _longest_shared_run(bodies[a], bodies[b])) >= SHARED_RUN
    ]
    assert not shared, f"live bodies repeating {SHARED_RUN}+ lines: {shared}"
