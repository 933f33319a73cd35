"""Rebuild the counters on Redis Cluster from the ledger, slot by slot (``mcpbg replay``).

The one-Redis rebuild (:func:`.rebuild.rebuild_from_ledger`) sets every live
counter to its ledger total, with the watermarks, seen-id sets and epoch
marker the worker resumes from. On a cluster each of those lives in the slot
of the counters it guards (docs/cluster.md), so the same plan (``rebuild_plan._plan``)
is written slot by slot on the slot's master: its counters and its own
watermark hash in ``lua/rewrite.lua`` blocks (nothing written if that slot's
watermarks moved meanwhile), its seen-id sets and run-time changes, and last
its epoch marker (:func:`.cluster.epoch_key`).

``lost_only``: only the slots whose epoch marker is missing (the shards that
restarted empty) are rebuilt; the other slots are neither read nor written,
and the resume watermark stays where it is. Otherwise every slot is, and the
resume watermark moves to the ledger's end.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Set

import duckdb
import redis
from redis import exceptions as redis_errors
from redis.cluster import RedisCluster
from redis.crc import key_slot

from mcp_budget_governor.caps import Change as CapsChange
from mcp_budget_governor.errors import BackendUnavailableError
from mcp_budget_governor.keys import SEEN_PREFIX, WATERMARK_KEY
from mcp_budget_governor.ledger import new_id

from ..ledger_view import query_error
from .cluster import SLOTS, _whole, epoch_key, in_slots, slot_tag
from .cluster_sync import _node, resume_watermarks, scan_keys, slot_snapshots
from .rebuild_plan import (
    _SEEN_CHUNK,
    Progress,
    RebuildReport,
    _check_behind,
    _ledger_marks,
    _plan,
    _quiet,
    _restore_changes,
    _run_time_change_rows,
)
from .sync import RedisCounter, Snapshot, _decode, ledger_totals, write_counters

__all__ = ["lost_slots", "rebuild_cluster_from_ledger"]

_UNAVAILABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)

#: Per slot, per seen-id day: the event ids and the set's expire_at.
_Seen = dict[int, dict[str, tuple[list[str], int]]]


def lost_slots(client: RedisCluster) -> set[int]:
    """The slots whose epoch marker is missing or not whole (``ClusterBackend.lost_slots``)."""
    try:
        pipe = client.pipeline()  # type: ignore[no-untyped-call]
        for slot in range(SLOTS):
            pipe.get(epoch_key(slot))
        got = pipe.execute(raise_on_error=False)
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    return {slot for slot, value in enumerate(got) if not _whole(value)}


def rebuild_cluster_from_ledger(
    con: duckdb.DuckDBPyConnection,
    client: RedisCluster,
    *,
    source: str = "archive",
    all_buckets: bool = False,
    dry_run: bool = False,
    now: int | None = None,
    progress: Progress = _quiet,
    lost_only: bool = False,
) -> RebuildReport:
    """Rebuild the counters of the cluster behind ``client`` from the ``ledger`` view on
    ``con`` (every slot, or with ``lost_only`` the slots whose marker is missing)."""
    started = time.perf_counter()
    result = RebuildReport(source, dry_run)
    progress("read", 0, None)
    slots = lost_slots(client) if lost_only else None
    try:
        clock = int(_node(client, WATERMARK_KEY).time()[0]) if now is None else int(now)
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    keys = {k for k in scan_keys(client) if in_slots(slots, k)}
    parts = {p.slot: p for p in slot_snapshots(client, keys)}
    counters: dict[str, RedisCounter] = {}
    applied: dict[str, int] = {} if slots is not None else resume_watermarks(client)
    for part in parts.values():
        counters.update(part.snap.counters)
        for name, offset in part.own.items():
            applied[name] = max(applied.get(name, -1), offset)
    before = Snapshot(clock, applied, counters)
    totals = {
        k: v
        for k, v in ledger_totals(con, clock, current_only=not all_buckets).items()
        if in_slots(slots, k)
    }
    marks, run_time = _ledger_marks(con, result)
    _check_behind(result, marks, applied, "Redis Cluster")
    writes, drops = _plan(con, before, totals, clock, result)
    changes = [c for c in run_time if c is not None and in_slots(slots, c.key)]
    seen = _seen_by_slot(con, clock, slots)
    result.counters = len(writes)
    result.unreplayed_changes = sum(c is None for c in run_time)
    result.replayed_changes = len(changes)
    result.seen_ids = sum(len(ids) for days in seen.values() for ids, _ in days.values())
    progress("read", 1, 1)
    if dry_run or (slots is not None and not slots):
        result.seconds = time.perf_counter() - started
        return result
    marks_after = {name: after for name, (_, after) in result.watermarks.items()}
    by_slot: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for write in writes:
        by_slot[key_slot(write[0].encode())].append(write)
    changes_by_slot: dict[int, list[CapsChange | None]] = defaultdict(list)
    for change in changes:
        changes_by_slot[key_slot(change.key.encode())].append(change)
    markers = range(SLOTS) if slots is None else sorted(slots)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress("counters", done, len(writes))

    try:
        _set_markers(client, markers, None)  # the hot path refuses these slots meanwhile
        added = 0
        for slot in sorted({*by_slot, *seen, *changes_by_slot}):
            node = _node(client, epoch_key(slot))
            tag = slot_tag(slot)
            read = parts.get(slot)
            own = read.own if read is not None else _own_watermarks(node, tag)
            write_counters(
                node,
                by_slot.get(slot, []),
                drop=drops,
                watermarks=own,
                set_watermarks=marks_after,
                watermark_key=WATERMARK_KEY + tag,
                progress=advance,
            )
            for day, (ids, expire_at) in sorted(seen.get(slot, {}).items()):
                seen_key = f"{SEEN_PREFIX}:{day}{tag}"
                for i in range(0, len(ids), _SEEN_CHUNK):
                    pipe = node.pipeline(transaction=False)
                    pipe.sadd(seen_key, *ids[i : i + _SEEN_CHUNK])
                    pipe.expireat(seen_key, expire_at)
                    pipe.execute()
                    added += len(ids[i : i + _SEEN_CHUNK])
                    progress("seen", added, result.seen_ids)
            if slot in changes_by_slot:
                _restore_changes(node, changes_by_slot[slot], clock)
        if slots is None and marks_after:
            client.hset(WATERMARK_KEY, mapping=marks_after)  # type: ignore[arg-type]
        result.epoch = new_id()
        _set_markers(client, markers, result.epoch)
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    result.seconds = time.perf_counter() - started
    return result


def _own_watermarks(node: redis.Redis, tag: str) -> dict[str, int]:
    """A slot's own watermark hash (``tag``: the slot's hash tag), as read now."""
    raw: dict[bytes, bytes] = node.hgetall(WATERMARK_KEY + tag)  # type: ignore[assignment]
    return {_decode(k): int(v) for k, v in raw.items()}


def _set_markers(client: RedisCluster, slots: range | list[int], epoch: str | None) -> None:
    """Set (``epoch``) or delete (None) the epoch markers of ``slots``."""
    pipe = client.pipeline()  # type: ignore[no-untyped-call]
    for slot in slots:
        if epoch is None:
            pipe.delete(epoch_key(slot))
        else:
            pipe.set(epoch_key(slot), epoch)
    pipe.execute()


def _seen_by_slot(con: duckdb.DuckDBPyConnection, now: int, slots: Set[int] | None) -> _Seen:
    """The event ids of each slot's seen-id sets still alive at ``now``: an event is in
    the sets of the slots its charges and run-time changes write (as apply puts it)."""
    day = "strftime(\"time\", '%Y%m%d')"
    expire = '(CAST(floor(epoch("time") / 86400) AS BIGINT) + 2) * 86400'
    sql = f"""
        SELECT {day} AS day, {expire} AS expire_at, "key", list(DISTINCT id) AS ids
        FROM ledger_raw
        WHERE "key" IS NOT NULL AND {expire} > ?
        GROUP BY ALL
    """
    try:
        rows = con.execute(sql, [int(now)]).fetchall()
        changes = _run_time_change_rows(con, f"{day} AS day, {expire} AS expire_at")
    except duckdb.Error as exc:
        raise query_error(exc) from None
    out: dict[int, dict[str, tuple[set[str], int]]] = defaultdict(dict)

    def note(key: str, day: str, expire_at: int, ids: list[str]) -> None:
        slot = key_slot(key.encode())
        if (slots is not None and slot not in slots) or expire_at <= now:
            return
        got, _ = out[slot].setdefault(day, (set(), expire_at))
        got.update(ids)

    for d, expire_at, key, ids in rows:
        note(key, d, int(expire_at), list(ids))
    for event_id, (d, expire_at), change in changes:
        if change is not None:
            note(change.key, d, int(expire_at), [event_id])
    return {s: {d: (sorted(ids), e) for d, (ids, e) in days.items()} for s, days in out.items()}
