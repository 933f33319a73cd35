"""Compare every live counter with the ledger (``mcpbg reconcile``), and repair drift.

The comparison is exact even while a worker projects, because both sides are
taken at one cut:

1. Redis is read in one ``MULTI`` (:func:`~.counter_sync.snapshot`): each
   counter's committed amount, its in-flight entries, the applied-offset
   watermarks and Redis's clock. No script (no ``apply``) runs in between,
   so each committed amount is exactly the projection of the events at or
   below those watermarks.
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

``fix=True`` adds the difference to each drifting counter's committed amount
(``HINCRBY``, ``lua/rewrite.lua`` in ``add`` mode) and drops its stale
in-flight entries: a correction, not an overwrite, so it stays right even if
the worker applies more events meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import redis

from mcp_budget_governor.errors import GovernorError

from .counter_sync import (
    ledger_ids,
    ledger_totals,
    scan_counter_keys,
    snapshot,
    write_counters,
)

__all__ = ["Drift", "ReconcileResult", "reconcile"]

_ATTEMPTS = 5


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


@dataclass(slots=True)
class ReconcileResult:
    """What a reconciliation compared and found (and, with ``fix``, repaired)."""

    now: int
    watermarks: dict[str, int]
    compared: int = 0
    in_flight: int = 0
    drifts: list[Drift] = field(default_factory=list)
    fixed: int = 0


class ReconcileRaceError(GovernorError):
    """New counters kept appearing between snapshots; try again."""


def reconcile(
    con: duckdb.DuckDBPyConnection, client: redis.Redis, *, fix: bool = False
) -> ReconcileResult:
    """Compare every live counter in ``client``'s Redis with the ``ledger`` view on ``con``."""
    keys = scan_counter_keys(client)
    for _ in range(_ATTEMPTS):
        snap = snapshot(client, keys, atomic=True)
        totals = ledger_totals(con, snap.now, upto=snap.watermarks)
        unread = set(totals) - set(snap.counters)
        if not unread:
            break
        keys |= unread
    else:
        raise ReconcileRaceError("counters kept appearing while reading them; run reconcile again")
    result = ReconcileResult(snap.now, dict(snap.watermarks))
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
    if fix and result.drifts:
        corrections = []
        for d in result.drifts:
            total = totals.get(d.key)
            # A counter the ledger does not know keeps its own expiry (0: untouched).
            corrections.append((d.key, d.ledger - d.redis, 0 if total is None else total[1]))
        write_counters(client, corrections, watermarks=None, add=True, drop=stale_by_key)
        result.fixed = len(corrections)
    return result
