"""Compare every live counter with the ledger (``mcpbg reconcile``), and repair drift.

The comparison is exact even while a worker projects, because both sides are
taken at one cut:

1. Redis is read in one ``MULTI`` (:func:`~.counters.sync.snapshot`): each
   counter's committed amount, its in-flight entries, the applied-offset
   watermarks and Redis's clock. No script (no ``apply``) runs in between,
   so each committed amount is exactly the projection of the events at or
   below those watermarks. Postgres is read in one ``REPEATABLE READ``
   transaction (:meth:`~.counters.pg_sync.PostgresStore.snapshot`): an apply
   commits its counters and its watermark together, so the cut is the same.
2. The ledger side is the sum of the charges **at offsets at or below each
   partition's watermark** (deduplicated as the projector deduplicates), per
   counter alive at that clock.

A counter drifts when the two differ, or when it holds an in-flight entry of
an event the ledger has at or below the watermark (applying it should have
moved that entry; it never will now). In-flight amounts of events not yet
applied are shown, never counted as drift.

Keys compared: every counter in Redis (a SCAN) and every counter the ledger
keeps alive. A key the ledger names but the snapshot did not read (created
by a projection after the SCAN) is read in a second snapshot.

What it assumes: the ledger holds every event up to each watermark (the
worker archives a batch *before* applying it, so an archive kept since the
topic's start does; a gap shows as drift), and a counter is only ever
committed by the projection (no ledger-less governor writing the same keys).

**Run-time changes** (caps, plan assignments, grants: the ledger's
``mcpbg.cap_set``, ``cap_unset``, ``plan_assigned``, ``granted`` and
``reset`` events) are compared too, on Redis, Redis Cluster and Postgres, each entry
with what the ledger's changes up to the cut leave live
(:mod:`.counters.changes_sync`); ``fix`` writes the differing ones back.

``fix=True`` adds the difference to each drifting counter's committed amount
(``HINCRBY``, ``lua/rewrite.lua`` in ``add`` mode) and drops its stale
in-flight entries: a correction, not an overwrite, so it stays right even if
the worker applies more events meanwhile. On Postgres all corrections are one
transaction (``mcpbg_rewrite_staged``).

**Orphans.** An in-flight entry (``e:<event id>`` in a counter hash, written
by the hot path in the same script that admits or meters) whose event id the
ledger does not hold at all, made more than ``older_than`` seconds ago (the
time is the UUIDv7's), is an *orphan*: its process died between the Redis
charge and the ledger append (or its outbox was lost), so no projection will
ever move it, and it holds budget forever without being billed. They are
listed per unit, never summed across units. They are not settled here:
:func:`recovery_entries` builds one ``recovered`` event per orphaned id, with
that id, its time and the in-flight charges as Redis holds them, and the
caller (``mcpbg reconcile --fix``) appends those to the ledger; the
projection then commits the amounts and drops the entries exactly once, so
counters, ledger and FOCUS export agree, and the charge is billed rather than
dropped. The bound must exceed the longest time an event may take to reach
the ledger view (outbox backlog during a broker outage, worker and archive
lag); a too-small bound is still safe, since a late original is a duplicate
id the projection skips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import duckdb
from redis.cluster import RedisCluster

from mcp_budget_governor.context import Context
from mcp_budget_governor.errors import GovernorError
from mcp_budget_governor.keys import parse_key
from mcp_budget_governor.ledger import EntryType, LedgerCharge, LedgerEntry, id_time
from mcp_budget_governor.money import Unit
from mcp_budget_governor.windows import Window, bucket_of

from .counters.changes_sync import ChangeDrift, ChangesResult, reconcile_changes
from .counters.cluster_sync import (
    SlotSnapshot,
    correct_slot,
    is_cluster,
    resume_watermarks,
    scan_keys,
    slot_snapshots,
)
from .counters.rebuild import Store, is_postgres, read_store
from .counters.sync import (
    Snapshot,
    Totals,
    ledger_ids,
    ledger_seen_ids,
    ledger_totals,
    scan_counter_keys,
    write_counters,
)
from .ledger_view import query_error

__all__ = [
    "DEFAULT_ORPHAN_AGE",
    "Drift",
    "LimitMeta",
    "Orphan",
    "ReconcileResult",
    "limit_meta",
    "reconcile",
    "recovery_entries",
]

_ATTEMPTS = 5
#: Seconds an in-flight entry must have existed, without its event in the ledger,
#: before reconcile calls it orphaned (``--older-than``).
DEFAULT_ORPHAN_AGE = 600


@dataclass(frozen=True, slots=True)
class Drift:
    """One counter whose committed amount differs from the ledger, or holds stale in-flight."""

    key: str
    redis: int
    ledger: int
    in_flight: int
    stale: int  # in-flight entries of events already at or below the watermark

    @property
    def drift(self) -> int:
        """Redis minus ledger: positive means Redis counts more than the ledger holds."""
        return self.redis - self.ledger


@dataclass(frozen=True, slots=True)
class Orphan:
    """An in-flight amount no ledger event explains, older than the bound."""

    key: str
    event_id: str
    amount: int
    limit: str
    unit: str | None  # None: no ledger event names this limit, so its unit is unknown
    age: int  # seconds since the event id was made
    expire_at: int  # the counter's expiry (Redis clock + TTL)


@dataclass(frozen=True, slots=True)
class LimitMeta:
    """What the ledger says of a limit: its unit and window (from its newest charge)."""

    unit: Unit
    window: Window


@dataclass(slots=True)
class ReconcileResult:
    """What a reconciliation compared and found (and, with ``fix``, repaired)."""

    now: int
    watermarks: dict[str, int]
    compared: int = 0
    in_flight: int = 0
    drifts: list[Drift] = field(default_factory=list)
    fixed: int = 0
    orphans: list[Orphan] = field(default_factory=list)
    #: Redis Cluster, with ``fix``: seen ids put back into the slots that had lost them.
    seen_restored: int = 0
    #: Run-time caps, plan assignments and grants the store holds otherwise than the
    #: ledger gives (:mod:`.counters.changes_sync`).
    change_drifts: list[ChangeDrift] = field(default_factory=list)
    #: With ``fix``: how many of them were put back.
    changes_fixed: int = 0
    #: Run-time events kept without their change (old archive segments): when any,
    #: the run-time entries are not compared.
    changes_unreadable: int = 0

    def note_changes(self, found: ChangesResult) -> None:
        """Take in what the run-time comparison found."""
        self.change_drifts = found.drifts
        self.changes_fixed = found.fixed
        self.changes_unreadable = found.unreadable

    def orphaned_by_unit(self) -> dict[str, int]:
        """Orphaned in-flight amounts summed per unit (``?`` when unknown), never across."""
        out: dict[str, int] = {}
        for o in self.orphans:
            out[o.unit or "?"] = out.get(o.unit or "?", 0) + o.amount
        return out


class ReconcileRaceError(GovernorError):
    """New counters kept appearing between snapshots; try again."""


def reconcile(
    con: duckdb.DuckDBPyConnection,
    client: Store,
    *,
    fix: bool = False,
    older_than: int = DEFAULT_ORPHAN_AGE,
) -> ReconcileResult:
    """Compare every live counter in ``client`` (Redis, Redis Cluster, or a Postgres
    store) with the ``ledger`` view on ``con``, and list the orphaned in-flight entries
    older than ``older_than`` seconds."""
    if is_cluster(client):
        return _reconcile_cluster(con, client, fix=fix, older_than=older_than)
    postgres = is_postgres(client)
    # Postgres reads every counter in its snapshot; Redis reads the keys a SCAN found.
    keys: set[str] = set() if postgres else scan_counter_keys(client)  # type: ignore[arg-type]
    for _ in range(_ATTEMPTS):
        snap = read_store(client, keys)
        totals = ledger_totals(con, snap.now, upto=snap.watermarks)
        unread = set(totals) - set(snap.counters)
        if not unread:
            break
        keys |= unread
    else:
        raise ReconcileRaceError("counters kept appearing while reading them; run reconcile again")
    result = ReconcileResult(snap.now, dict(snap.watermarks))
    stale_by_key = _compare(con, snap, totals, result)
    result.orphans = _orphans(con, snap, older_than)
    if fix and result.drifts:
        corrections = _corrections(result.drifts, totals)
        if postgres:
            client.rewrite(corrections, add=True, drop=stale_by_key)  # type: ignore[union-attr]
        else:
            write_counters(
                client,  # type: ignore[arg-type]
                corrections,
                watermarks=None,
                add=True,
                drop=stale_by_key,
            )
        result.fixed = len(corrections)
    result.note_changes(reconcile_changes(con, client, fix=fix))
    return result


def _compare(
    con: duckdb.DuckDBPyConnection, snap: Snapshot, totals: Totals, result: ReconcileResult
) -> dict[str, list[str]]:
    """Add the drifts of ``snap`` against ``totals`` to ``result``; the stale in-flight
    event ids per key (events the ledger holds at or below the watermarks)."""
    pending = {i for c in snap.counters.values() for i in c.pending}
    applied = ledger_ids(con, pending, upto=snap.watermarks)
    stale_by_key: dict[str, list[str]] = {}
    for key in sorted(snap.counters):
        counter = snap.counters[key]
        total = totals.get(key)
        if counter.ttl == -2 and total is None:
            continue  # neither side has it (gone since the SCAN)
        result.compared += 1
        result.in_flight += counter.in_flight
        ledger = 0 if total is None else total[0]
        stale = [i for i in counter.pending if i in applied]
        if counter.committed != ledger or stale:
            result.drifts.append(
                Drift(key, counter.committed, ledger, counter.in_flight, len(stale))
            )
            if stale:
                stale_by_key[key] = stale
    return stale_by_key


def _corrections(drifts: Sequence[Drift], totals: Totals) -> list[tuple[str, int, int]]:
    out = []
    for d in drifts:
        total = totals.get(d.key)
        # A counter the ledger does not know keeps its own expiry (0: untouched).
        out.append((d.key, d.ledger - d.redis, 0 if total is None else total[1]))
    return out


def _reconcile_cluster(
    con: duckdb.DuckDBPyConnection, client: RedisCluster, *, fix: bool, older_than: int
) -> ReconcileResult:
    """Redis Cluster: each slot compared on its own cut (projections/counters/cluster_sync.py).

    The keys: every counter a SCAN of every master finds and every counter
    the ledger keeps alive (a counter whose writes a failover lost entirely
    is drift too).
    """
    now = int(client.time()[0])
    keys = scan_keys(client) | set(ledger_totals(con, now))
    parts = slot_snapshots(client, keys)
    resume = resume_watermarks(client)
    result = ReconcileResult(min((p.snap.now for p in parts), default=now), resume)
    # One ledger query per distinct cut (usually every slot's is the resume watermarks).
    cuts: dict[tuple[tuple[str, int], ...], list[SlotSnapshot]] = {}
    for part in parts:
        cuts.setdefault(tuple(sorted(part.snap.watermarks.items())), []).append(part)
    # Per cut: the drifting slots, their corrections and stale in-flight entries.
    fixes: list[list[tuple[SlotSnapshot, list[tuple[str, int, int]], dict[str, list[str]]]]] = []
    for group in cuts.values():
        fixes.append([])
        upto = group[0].snap.watermarks
        group_keys = [k for p in group for k in p.snap.counters]
        totals = ledger_totals(con, group[0].snap.now, upto=upto, keys=group_keys)
        for part in group:
            before = len(result.drifts)
            stale = _compare(con, part.snap, totals, result)
            drifts = result.drifts[before:]
            if drifts:
                fixes[-1].append((part, _corrections(drifts, totals), stale))
    result.drifts.sort(key=lambda d: d.key)
    every = {k: c for p in parts for k, c in p.snap.counters.items()}
    result.orphans = _orphans(con, Snapshot(result.now, resume, every), older_than)
    if fix:
        for group, fixing in zip(cuts.values(), fixes, strict=True):
            if not fixing:
                continue
            # The seen ids the fixed slots must hold: the events they are compared up to.
            seen = ledger_seen_ids(
                con,
                group[0].snap.now,
                upto=group[0].snap.watermarks,
                keys=[k for part, _, _ in fixing for k in part.snap.counters],
            )
            for part, corrections, stale in fixing:
                result.seen_restored += correct_slot(client, part, corrections, stale, seen)
                result.fixed += len(corrections)
    # After the counters' fix: a slot it moved up to the resume watermarks is read as moved.
    result.note_changes(reconcile_changes(con, client, fix=fix))
    return result


def _orphans(con: duckdb.DuckDBPyConnection, snap: Snapshot, older_than: int) -> list[Orphan]:
    """In-flight entries whose event id is nowhere in the ledger, older than the bound."""
    pending = {i for c in snap.counters.values() for i in c.pending}
    known = ledger_ids(con, pending)  # at any offset: applied or still to be projected
    meta = limit_meta(con)
    out = []
    for key in sorted(snap.counters):
        counter = snap.counters[key]
        parsed = parse_key(key)
        for event_id, amount in sorted(counter.pending.items()):
            made = id_time(event_id)
            if event_id in known or made is None:
                continue
            age = max(0, int(snap.now - made))  # Redis's clock is in whole seconds
            if age < older_than:
                continue
            limit = parsed.limit if parsed is not None else "?"
            unit = meta.get(limit)
            expire_at = snap.now + counter.ttl if counter.ttl > 0 else 0
            out.append(
                Orphan(
                    key,
                    event_id,
                    amount,
                    limit,
                    None if unit is None else unit.unit.value,
                    age,
                    expire_at,
                )
            )
    return out


def limit_meta(con: duckdb.DuckDBPyConnection) -> dict[str, LimitMeta]:
    """Each limit's unit and window, as its newest charge in the ledger records them."""
    sql = """
        SELECT "limit", arg_max(unit, "time"), arg_max("window", "time")
        FROM ledger WHERE "limit" IS NOT NULL AND unit IS NOT NULL GROUP BY "limit"
    """
    try:
        rows = con.execute(sql).fetchall()
    except duckdb.Error as exc:
        raise query_error(exc) from None
    out = {}
    for limit, unit, window in rows:
        try:
            out[limit] = LimitMeta(Unit(unit), Window(window))
        except ValueError:
            continue  # not a unit or window this version knows: left unfixable
    return out


def recovery_entries(
    orphans: Sequence[Orphan],
    meta: Mapping[str, LimitMeta],
    holds: Mapping[str, Mapping[str, tuple[int, int]]] | None = None,
) -> tuple[list[LedgerEntry], list[Orphan]]:
    """One ``recovered`` entry per orphaned event id, and the orphans that cannot be
    settled (their limit's unit is unknown: no ledger event ever named it, or the
    counter has no expiry to give the charge).

    An orphan that refunds (a settlement or release whose event was lost) draws on
    a reservation, as the projection requires (``counters.Holds``): the entry
    names one of ``holds`` (``ledger_view.open_reservations``) made before it
    whose estimate on each of its counters covers the refund; without one, the
    orphan cannot be settled.

    Each entry has the orphan's id and time (its UUIDv7), one charge per counter
    with that id in flight (the amount Redis holds, the key's bucket, the
    counter's expiry), and the context the keys name (hashed values left out).
    """
    by_id: dict[str, list[Orphan]] = {}
    for o in orphans:
        by_id.setdefault(o.event_id, []).append(o)
    entries: list[LedgerEntry] = []
    unfixable: list[Orphan] = []
    open_ones = dict(holds or {})
    for event_id, group in sorted(by_id.items()):
        parsed = [(o, parse_key(o.key)) for o in group]
        if any(
            p is None
            or o.limit not in meta
            or o.expire_at <= 0
            or bucket_of(meta[o.limit].window, p.bucket) is None
            for o, p in parsed
        ):
            unfixable += group
            continue
        charges = []
        context: dict[str, str] = {}
        for o, p in parsed:
            assert p is not None
            m = meta[o.limit]
            charges.append(LedgerCharge(o.limit, m.unit, o.amount, m.window, p.bucket, o.key,
                                        _expiry(m.window, p.bucket, o.expire_at)))  # fmt: skip
            for dim, value, hashed in zip(p.dims, p.values, p.hashed, strict=True):
                if not hashed:
                    context.setdefault(dim.value, value)
        made = id_time(event_id)
        assert made is not None
        reservation = None
        refunds = {o.key: -o.amount for o in group if o.amount < 0}
        if refunds:
            reservation = next(
                (
                    r
                    for r, held in sorted(open_ones.items())
                    if r < event_id
                    and all(k in held and held[k][0] >= a for k, a in refunds.items())
                ),
                None,
            )
            if reservation is None:
                unfixable += group
                continue
            del open_ones[reservation]  # a reservation closes once
        entries.append(
            LedgerEntry(
                event_id,
                EntryType.RECOVERED,
                made,
                Context(**context),
                tuple(charges),
                reservation=reservation,
            )
        )
    return entries, unfixable


def _expiry(window: Window, label: str, ttl_expiry: int) -> int:
    """A recovered charge's expiry: its bucket's end plus grace, the rule every charge
    follows (Redis's TTL reads a second short); a session's, the counter's own."""
    bucket = bucket_of(window, label)
    assert bucket is not None  # recovery_entries left the others unfixable
    return ttl_expiry if bucket.end is None else bucket.expire_at(0)
