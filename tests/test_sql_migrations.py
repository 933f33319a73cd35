"""The shipped migrations are append-only: a released one never changes.

A database applies each migration once (``mcpbg_migrations``), so an edit to an
applied file would reach new databases and never the existing ones, and two
stores of one deployment would run different functions. A later migration
changes a function instead (``CREATE OR REPLACE``, as 0004 does for
``mcpbg_charge``); this test holds the released files to their digests.
Adding a migration: add its line below.
"""

from __future__ import annotations

import hashlib

from mcp_budget_governor.sql import migrations

RELEASED = {
    1: "74b741956723fcd3ded580ee5ca23a0105e2ed2741b8ff857d3da67b8b5ab498",
    2: "a82cdaf9d8f717208227331b6d71f41a0022fe2057f1676d32a7a04ec9eb61c0",
    3: "eca093b6559a708168ea3519715c051c8b5441380a2716d450da0ce6cfb9ef25",
    4: "a2a6a3e95f529f6ed010b4186b9889b1ea4272f33e61ebe74f9b83758e29745c",
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

