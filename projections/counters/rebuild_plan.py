"""What a rebuild from the ledger writes, on one Redis or slot by slot on a cluster: the
ledger's marks and run-time changes, the counters to write (:func:`_plan`), and the
report. Here, below both :mod:`.rebuild` and :mod:`.cluster_rebuild`, so that
``rebuild_from_ledger`` can hand a cluster client to the slot-by-slot rebuild without
the two importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import redis

from mcp_budget_governor.caps import Change as CapsChange
from mcp_budget_governor.caps import ChangeKind
from mcp_budget_governor.errors import GovernorError
from mcp_budget_governor.events import ChangeData, to_change
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.lua import source

from ..ledger_view import query_error
from .redis_scripts import change_tokens
from .sync import Snapshot, ledger_ids, ledger_totals

_SEEN_CHUNK = 10_000


class LedgerBehindError(GovernorError):
    """The store has applied a partition beyond what the ledger holds: a rebuild would lose
    events."""


#: ``progress(phase, done, total)``: phases "read", "counters", "seen", "events", and on
#: Postgres "commit" (0 of 1 inside the transaction, 1 of 1 once committed).
Progress = Callable[[str, int, int | None], None]


def _quiet(phase: str, done: int, total: int | None) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Change:
    """A counter a rebuild changes (or would): committed and in-flight, before and after."""

    key: str
    committed_before: int
    committed_after: int
    in_flight_before: int
    in_flight_after: int


@dataclass(slots=True)
class RebuildReport:
    """What a rebuild did, or with ``dry_run`` would do.

    ``counters``: counters written; ``changed``: how many of them change
    (committed or in-flight); ``changes``: those changes, listed in a dry
    run (a real run lists only the counters Redis held before).
    """

    source: str
    dry_run: bool
    events: int = 0
    counters: int = 0
    changed: int = 0
    changes: list[Change] = field(default_factory=list)
    watermarks: dict[str, tuple[int, int]] = field(default_factory=dict)  # before, after
    seen_ids: int = 0
    seconds: float = 0.0
    epoch: str | None = None
    #: Run-time changes (caps, plans, grants, resets) restored from the ledger, in order.
    replayed_changes: int = 0
    #: Records the projection refused (the ledger view's ``dead_letters``: a malformed
    #: record, a sum out of range): ``(partition, offset, event id, reason)``, not replayed.
    refused: list[tuple[str, int, str | None, str]] = field(default_factory=list)
    #: Run-time changes in archive segments written before the ``change`` column
    #: (they keep no ``data.change``): ``--source kafka`` applies them.
    unreplayed_changes: int = 0


def _ledger_marks(
    con: duckdb.DuckDBPyConnection, result: RebuildReport
) -> tuple[dict[str, int], list[CapsChange | None]]:
    """The ledger's last offset per partition and its run-time changes; counts its
    events into ``result``."""
    try:
        marks = dict(
            con.execute(
                'SELECT partition_name, max("offset") FROM ledger_raw GROUP BY partition_name'
            ).fetchall()
        )
        ((events,),) = con.execute("SELECT count(DISTINCT id) FROM ledger_raw").fetchall()
        result.refused = [
            (str(p), int(o), i, str(r))
            for p, o, i, r in con.execute(
                'SELECT partition_name, "offset", id, reason FROM dead_letters ORDER BY 1, 2'
            ).fetchall()
        ]
        run_time = _run_time_changes(con)
    except duckdb.Error as exc:
        raise query_error(exc) from None
    result.events = int(events)
    return {str(k): int(v) for k, v in marks.items()}, run_time


def _check_behind(
    result: RebuildReport, marks: dict[str, int], applied: dict[str, int], store: str
) -> None:
    """Refuse a rebuild that would lose offsets the store applied past the ledger's end;
    note each partition's watermark before and after in ``result``."""
    for name, last in sorted(marks.items()):
        was = applied.get(name, -1)
        if was > last:
            raise LedgerBehindError(
                f"partition {name}: {store} has applied up to offset {was}, the ledger ends "
                f"at {last}; replaying would lose offsets {last + 1}..{was} "
                "(replay from Kafka, or bring the archive up to date)"
            )
        result.watermarks[name] = (was, int(last))


def _plan(
    con: duckdb.DuckDBPyConnection,
    before: Snapshot,
    totals: dict[str, tuple[int, int]],
    clock: int,
    result: RebuildReport,
) -> tuple[list[tuple[str, int, int]], dict[str, list[str]]]:
    """The counters to write (``(key, committed, expire_at)``) and the in-flight entries
    to drop, from the store's counters ``before`` and the ledger's ``totals``; the
    changes are listed in ``result``."""
    # In-flight entries of events the ledger holds: counted by the rebuild, never moved live.
    pending = {i for c in before.counters.values() for i in c.pending}
    known = ledger_ids(con, pending)
    holding = [
        k for k, c in before.counters.items() if k not in totals and known & c.pending.keys()
    ]
    outside = ledger_totals(con, clock, keys=holding) if holding else {}
    writes: list[tuple[str, int, int]] = []
    drops: dict[str, list[str]] = {}
    changes = result.changes
    for key, counter in before.counters.items():
        # Counters Redis holds: committed from the ledger, in-flight of its events dropped.
        drop = [i for i in counter.pending if i in known]
        total = totals.get(key)
        if total is None and drop:
            # Outside the replayed buckets, yet holding in flight events the ledger has:
            # they leave in-flight for committed, as applying them would have done.
            total = outside.get(key)
        if total is None:
            continue  # not the ledger's, or outside the rebuilt buckets: left alone
        committed, expire_at = total
        writes.append((key, committed, expire_at))
        if drop:
            drops[key] = drop
        if committed != counter.committed or drop:
            gone = sum(counter.pending[i] for i in drop)
            changes.append(
                Change(
                    key, counter.committed, committed, counter.in_flight, counter.in_flight - gone
                )
            )
    known_keys = before.counters
    fresh = [(k, a, e) for k, (a, e) in totals.items() if k not in known_keys]
    writes += fresh
    result.changed = len(changes) + sum(1 for _, a, _ in fresh if a != 0)
    if result.dry_run:  # the list is for people to read; a real run only counts
        changes += (Change(k, 0, a, 0, 0) for k, a, _ in fresh if a != 0)
        changes.sort(key=lambda c: c.key)
    return writes, drops


def _run_time_changes(con: duckdb.DuckDBPyConnection) -> list[CapsChange | None]:
    """The ledger's run-time changes in ledger order (each event once); None for one
    whose row keeps no ``data.change`` (an archive segment older than that column)."""
    return [change for _, _, change in _run_time_change_rows(con)]


def _run_time_change_rows(
    con: duckdb.DuckDBPyConnection, columns: str = "NULL"
) -> list[tuple[str, tuple[Any, ...], CapsChange | None]]:
    """:func:`_run_time_changes` with each one's event id and the ``columns`` (SQL) of its row."""
    kinds = ", ".join(f"'mcpbg.{k.value}.v1'" for k in ChangeKind)
    rows = con.execute(
        f"""SELECT id, {columns}, "type", "change" FROM ledger_raw WHERE "type" IN ({kinds})
            QUALIFY row_number() OVER (PARTITION BY id ORDER BY "offset") = 1
            ORDER BY "time", partition_name, "offset", id"""
    ).fetchall()
    out: list[tuple[str, tuple[Any, ...], CapsChange | None]] = []
    for event_id, *cols, kind, change in rows:
        if change is None:
            out.append((str(event_id), tuple(cols), None))
            continue
        entry = EntryType(str(kind).split(".")[1])
        parsed = to_change(entry, ChangeData.model_validate_json(change))
        out.append((str(event_id), tuple(cols), parsed))
    return out


def _restore_changes(client: redis.Redis, changes: Sequence[CapsChange | None], now: float) -> int:
    """Apply run-time changes in ledger order through lua/change.lua, as the projection
    does, at clock ``now`` (epoch seconds: a grant whose bucket has ended changes
    nothing). A grant adds to its counter's: the grants of the counters they touch
    start again from none, so a replay onto live counters does not count one twice."""
    todo = [c for c in changes if c is not None]
    room = {c.key for c in todo if c.kind in (ChangeKind.GRANTED, ChangeKind.RESET)}
    if room:
        pipe = client.pipeline(transaction=False)
        for key in room:
            pipe.hdel(key, "g", "w")
        pipe.execute()
    script = client.register_script(source("change"))
    for start in range(0, len(todo), _CHANGES_PER_CALL):
        keys: list[str] = []
        tokens = change_tokens(todo[start : start + _CHANGES_PER_CALL], keys, {})
        script(keys=keys, args=[tokens, str(int(now * 1000))])
    return len(todo)


#: Run-time changes applied per script call (a script blocks Redis while it runs).
_CHANGES_PER_CALL = 500
