"""Rebuild the counters (Redis or Postgres) from the ledger after an outage (``mcpbg replay``).

:func:`rebuild_from_ledger` sets every live counter to its ledger total in one
DuckDB aggregation over the ledger view, with the watermarks, seen-id sets and
epoch marker the live worker resumes from; :func:`rebuild_from_kafka` applies
every retained event of the topic instead (:func:`mcp_budget_governor.stream.
rebuild.rebuild`). ``docs/exactly-once.md`` (*Rebuilding from the ledger view*)
lists the steps and what they assume. On Redis the writes go in blocks of
scripts; on Postgres (:class:`~.pg_sync.PostgresStore`) in one transaction.

>>> from mcp_budget_governor.projections.counters.sync import redis_client
>>> from mcp_budget_governor.projections.ledger_view import open_ledger
>>> con = open_ledger("/var/lib/mcpbg/archive")  # doctest: +SKIP
>>> client = redis_client("redis://localhost:6379/0")  # doctest: +SKIP
>>> report = rebuild_from_ledger(con, client, dry_run=True)  # doctest: +SKIP
>>> [(c.key, c.committed_before, c.committed_after) for c in report.changes]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, TypeAlias

import duckdb
import redis

from mcp_budget_governor.counters import AppliedEvent, ApplyOnly, CounterState
from mcp_budget_governor.errors import BackendUnavailableError, InvalidInputError
from mcp_budget_governor.keys import (
    EPOCH_KEY,
    HOLD_PREFIX,
    SEEN_PREFIX,
    SPENT_PREFIX,
    WATERMARK_KEY,
)
from mcp_budget_governor.ledger import new_id

from ..ledger_view import open_reservations, query_error, spent_approvals
from .rebuild_plan import (
    _SEEN_CHUNK,
    Change,
    LedgerBehindError,
    Progress,
    RebuildReport,
    _check_behind,
    _ledger_marks,
    _plan,
    _quiet,
    _restore_changes,
)
from .sync import (
    SEEN_DAY_SQL,
    SEEN_EXPIRE_SQL,
    Snapshot,
    is_current,
    ledger_totals,
    scan_counter_keys,
    snapshot,
    write_counters,
)

__all__ = [
    "Change",
    "LedgerBehindError",
    "Progress",
    "RebuildReport",
    "rebuild_from_kafka",
    "rebuild_from_ledger",
]

if TYPE_CHECKING:
    from .pg_sync import PostgresStore

#: The counters' store of a rebuild or reconcile: a Redis (or Redis Cluster) client or a
#: Postgres store.
Store: TypeAlias = "redis.Redis | redis.RedisCluster | PostgresStore"


def is_postgres(store: Any) -> bool:
    """Whether ``store`` is a :class:`~.pg_sync.PostgresStore` (psycopg imported only then)."""
    return not isinstance(store, (redis.Redis, redis.RedisCluster))


def read_store(store: Any, keys: Iterable[str] | None = None, *, atomic: bool = True) -> Snapshot:
    """Every counter of ``store`` (and ``keys``), its watermarks and its clock; on Redis
    Cluster each slot read at its own instant, with the resume watermarks."""
    if isinstance(store, redis.RedisCluster):
        from .cluster_sync import _node, resume_watermarks, scan_keys, slot_snapshots

        counters = {}
        for part in slot_snapshots(store, scan_keys(store) if keys is None else keys):
            counters.update(part.snap.counters)
        clock = int(_node(store, WATERMARK_KEY).time()[0])
        return Snapshot(clock, resume_watermarks(store), counters)
    if is_postgres(store):
        snap: Snapshot = store.snapshot(keys or ())
        return snap
    wanted = scan_counter_keys(store) if keys is None else set(keys)
    return snapshot(store, wanted, atomic=atomic)


def open_store(url: str, *, cluster: bool = False) -> Any:
    """A Redis client or, for a ``postgresql://`` URL, a Postgres store; with ``cluster``
    (a command that works on a cluster slot by slot: reconcile, replay), a Redis
    Cluster client for a ``redis+cluster://`` URL."""
    if url.lower().startswith(("postgresql:", "postgres:")):
        from .pg_sync import PostgresStore

        return PostgresStore.connect(url)
    if url.lower().startswith("redis+cluster://"):
        if not cluster:
            raise InvalidInputError(
                "--redis-url", url, "not yet on Redis Cluster (docs/cluster.md)"
            )
        from .cluster_sync import cluster_client

        return cluster_client(url)
    from .sync import redis_client

    return redis_client(url)


def rebuild_from_ledger(
    con: duckdb.DuckDBPyConnection,
    client: Store,
    *,
    source: str = "archive",
    all_buckets: bool = False,
    dry_run: bool = False,
    now: int | None = None,
    progress: Progress = _quiet,
    lost_only: bool = False,
) -> RebuildReport:
    """Rebuild the counters in ``client`` (Redis, Redis Cluster, or a Postgres store) from
    the ``ledger`` view on ``con``.

    ``now`` (epoch seconds) overrides the store's clock for which buckets are
    alive and current (benchmarks and tests of a past month). On Redis Cluster
    the rebuild goes slot by slot (:mod:`.cluster_rebuild`); ``lost_only``
    rebuilds only the slots whose epoch marker is missing.
    """
    if isinstance(client, redis.RedisCluster):
        from .cluster_rebuild import rebuild_cluster_from_ledger

        return rebuild_cluster_from_ledger(
            con,
            client,
            source=source,
            all_buckets=all_buckets,
            dry_run=dry_run,
            now=now,
            progress=progress,
            lost_only=lost_only,
        )
    if lost_only:
        raise InvalidInputError("--lost", True, "only for a Redis Cluster (redis+cluster://)")
    started = time.perf_counter()
    result = RebuildReport(source, dry_run)
    progress("read", 0, None)
    postgres = is_postgres(client)
    before = read_store(client, atomic=False)
    clock = before.now if now is None else int(now)
    totals = ledger_totals(con, clock, current_only=not all_buckets)
    marks, run_time = _ledger_marks(con, result)
    _check_behind(result, marks, before.watermarks, "Postgres" if postgres else "Redis")
    writes, drops = _plan(con, before, totals, clock, result)
    result.counters = len(writes)
    result.unreplayed_changes = sum(c is None for c in run_time)
    result.replayed_changes = len(run_time) - result.unreplayed_changes
    seen = _seen_ids(con, clock)
    result.seen_ids = sum(len(ids) for ids, _ in seen.values())
    progress("read", 1, 1)
    if dry_run:
        result.seconds = time.perf_counter() - started
        return result
    marks_after = {name: after for name, (_, after) in result.watermarks.items()}
    holds = open_reservations(con, clock)
    spent = spent_approvals(con, clock)
    if postgres:
        # Before the epoch: no settlement meets no reservation, no approval is unspent.
        _restore_holds_postgres(client, holds, spent)
        todo = [c for c in run_time if c is not None]
        epoch = new_id()
        client.rewrite(  # type: ignore[union-attr]
            writes,
            expected=before.watermarks,
            drop=drops,
            seen=seen,
            marks=marks_after,
            changes=todo,
            epoch=epoch,
            progress=progress,
        )
        result.replayed_changes, result.epoch = len(todo), epoch
        result.seconds = time.perf_counter() - started
        return result
    assert isinstance(client, redis.Redis)
    try:
        client.delete(EPOCH_KEY)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            progress("counters", done, len(writes))

        write_counters(
            client,
            writes,
            drop=drops,
            watermarks=before.watermarks,
            set_watermarks=marks_after,
            progress=advance,
        )
        added = 0
        for day, (ids, expire_at) in sorted(seen.items()):
            seen_key = f"{SEEN_PREFIX}:{day}"
            for i in range(0, len(ids), _SEEN_CHUNK):
                pipe = client.pipeline(transaction=False)
                pipe.sadd(seen_key, *ids[i : i + _SEEN_CHUNK])
                pipe.expireat(seen_key, expire_at)
                pipe.execute()
                added += len(ids[i : i + _SEEN_CHUNK])
                progress("seen", added, result.seen_ids)
        result.replayed_changes = _restore_changes(client, run_time, clock)
        _restore_holds_redis(client, holds, spent)
        result.epoch = new_id()
        client.set(EPOCH_KEY, result.epoch)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise BackendUnavailableError.redis(exc) from None
    result.seconds = time.perf_counter() - started
    return result


def _restore_holds_redis(
    client: redis.Redis,
    holds: Mapping[str, Mapping[str, tuple[int, int]]],
    spent: Mapping[str, int],
) -> None:
    """The open reservations and the spent approvals as lua/apply.lua keeps them
    (``keys.HOLD_PREFIX`` hashes; ``keys.SPENT_PREFIX`` markers, committed 1)."""
    pipe = client.pipeline(transaction=False)
    for reservation, held in holds.items():
        key = f"{HOLD_PREFIX}:{reservation}"
        pipe.hset(key, mapping={k: amount for k, (amount, _) in held.items()})
        pipe.expireat(key, max(e for _, e in held.values()))
    for once, until in spent.items():
        marker = f"{SPENT_PREFIX}:{once}"
        pipe.hset(marker, "c", 1)
        pipe.expireat(marker, until + 1)
    pipe.execute()


def _restore_holds_postgres(
    store: Any, holds: Mapping[str, Mapping[str, tuple[int, int]]], spent: Mapping[str, int]
) -> None:
    """The open reservations (``mcpbg_hold``, sql/0007) and the spent approvals (their
    marker counters, committed 1: sql/0008), in one transaction."""
    rows = [(r, k, a, e) for r, held in holds.items() for k, (a, e) in held.items()]
    with store.conn.transaction(), store.conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO mcpbg_hold (reservation, key, estimate, expire_at) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (reservation, key) DO UPDATE SET estimate = excluded.estimate,"
            " expire_at = excluded.expire_at",
            rows,
        )
        cur.executemany(
            "INSERT INTO mcpbg_counter AS t (key, committed, expire_at) VALUES (%s, 1, %s)"
            " ON CONFLICT (key) DO UPDATE SET committed = greatest(t.committed, 1)",
            [(f"{SPENT_PREFIX}:{once}", until + 1) for once, until in spent.items()],
        )


def _seen_ids(con: duckdb.DuckDBPyConnection, now: int) -> dict[str, tuple[list[str], int]]:
    """Event ids per seen-id day whose set is still alive at ``now`` (``AppliedEvent`` rules)."""
    sql = f"""
        SELECT {SEEN_DAY_SQL} AS day, {SEEN_EXPIRE_SQL} AS expire_at, list(DISTINCT id) AS ids
        FROM ledger_raw WHERE {SEEN_EXPIRE_SQL} > ?
        GROUP BY ALL
    """
    try:
        rows = con.execute(sql, [int(now)]).fetchall()
    except duckdb.Error as exc:
        raise query_error(exc) from None
    return {day: (list(ids), int(expire_at)) for day, expire_at, ids in rows}


class _CurrentOnly(ApplyOnly):
    """A backend wrapper for the Kafka path: drops charges outside the buckets rebuilt,
    counts events for the progress bar, and leaves the epoch to the caller in a dry run."""

    def __init__(
        self,
        inner: Any,
        *,
        all_buckets: bool,
        now: int,
        progress: Progress,
        dry_run: bool,
        slots: Set[int] | None = None,
    ) -> None:
        self.inner = inner
        self.all_buckets = all_buckets
        self.slots = slots  # a dry run of --lost: the lost slots' share alone
        self.now = now
        self.progress = progress
        self.dry_run = dry_run
        self.events = 0
        self.keys: set[str] = set()

    async def apply(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool = False,
        through: int = -1,
    ) -> int:
        kept = []
        for e in events:
            charges = tuple(
                c
                for c in e.charges
                if (self.all_buckets or is_current(c.key, c.expire_at, self.now))
                and self._kept(c.key)
            )
            self.keys.update(c.key for c in charges)
            # Run-time changes (caps, plans, grants) are kept whole: a grant of an ended
            # bucket is dropped by the script itself, as its expiry has passed.
            changes = tuple(c for c in e.changes if self._kept(c.key))
            kept.append(dataclasses.replace(e, charges=charges, changes=changes))
        self.events += len(events)
        self.progress("events", self.events, None)
        applied: int = await self.inner.apply(
            partition, kept, require_epoch=require_epoch, through=through
        )
        return applied

    def _kept(self, key: str) -> bool:
        from .cluster import in_slots  # the cluster client only when a cluster is rebuilt

        return in_slots(self.slots, key)

    async def state(self, key: str) -> CounterState:
        state: CounterState = await self.inner.state(key)
        return state

    async def counter_keys(self, limit: int, **options: Any) -> list[str]:
        keys: list[str] = await self.inner.counter_keys(limit, **options)
        return keys

    async def has_epoch(self) -> bool:
        return bool(await self.inner.has_epoch())

    async def mark_ready(self, epoch: str) -> None:
        if not self.dry_run:
            await self.inner.mark_ready(epoch)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def rebuild_from_kafka(
    url: str,
    bootstrap: str,
    topic: str,
    *,
    all_buckets: bool = False,
    dry_run: bool = False,
    idle_timeout: float = 5.0,
    progress: Progress = _quiet,
    lost_only: bool = False,
    **client_options: Any,
) -> RebuildReport:
    """Rebuild the counters from every retained event of ``topic`` (``stream/rebuild.py``).

    Applied through ``apply`` into the store at ``url`` (Redis, Redis Cluster, or
    Postgres for a ``postgresql://`` URL); ``lost_only`` (a cluster): into the
    slots whose epoch marker is missing alone (``cluster.LostSlots``). On a
    store that still holds a projection only events past its watermarks count
    (``apply``'s guards), a catch-up; after an outage (the store empty) that is
    everything retained. A dry run rebuilds into a MemoryBackend from nothing
    and lists the counters whose committed amount differs from the store's:
    what a rebuild of an empty store would give (with ``lost_only``: of the lost
    slots alone, the others neither read nor listed).
    """
    from mcp_budget_governor.projections.counters.memory import MemoryBackend
    from mcp_budget_governor.stream.rebuild import rebuild

    started = time.perf_counter()
    client = open_store(url, cluster=True)
    if lost_only and not isinstance(client, redis.RedisCluster):
        client.close()
        raise InvalidInputError("--lost", True, "only for a Redis Cluster (redis+cluster://)")
    try:
        before = read_store(client, ())
        result = RebuildReport("kafka", dry_run)
        inner: Any = MemoryBackend() if dry_run else _backend(client, url)
        target = await inner.lost() if lost_only and not dry_run else inner
        slots: set[int] | None = None
        partial = False  # some slots only: the resume watermark stays (docs/cluster.md)
        if lost_only and dry_run:  # the real run's LostSlots view, in the MemoryBackend
            from .cluster import SLOTS
            from .cluster_rebuild import lost_slots

            slots = lost_slots(client)
            partial = len(slots) < SLOTS
        backend = _CurrentOnly(
            target,
            all_buckets=all_buckets,
            now=before.now,
            progress=progress,
            dry_run=dry_run,
            slots=slots,
        )
        try:
            outcome = await rebuild(
                backend,
                bootstrap,
                topic,
                idle_timeout=idle_timeout,
                dry_run=dry_run,
                **client_options,
            )
            result.events = outcome.read
            result.counters = len(backend.keys)
            if partial:
                after = dict(before.watermarks)
            elif dry_run:
                after = {n: await inner.watermark(n) for n in _memory_partitions(inner)}
            else:
                after = read_store(client, ()).watermarks
            for name in sorted(set(before.watermarks) | set(after)):
                result.watermarks[name] = (
                    before.watermarks.get(name, -1),
                    after.get(name, before.watermarks.get(name, -1)),
                )
            if dry_run:
                current = read_store(client, backend.keys, atomic=False).counters
                for key in sorted(backend.keys):
                    rebuilt = (await inner.state(key)).committed
                    was = current[key]
                    if rebuilt != was.committed:
                        result.changes.append(
                            Change(key, was.committed, rebuilt, was.in_flight, was.in_flight)
                        )
                result.changed = len(result.changes)
            else:
                result.epoch = outcome.epoch
                result.changed = outcome.applied
        finally:
            await inner.aclose()
    finally:
        client.close()
    result.seconds = time.perf_counter() - started
    return result


def _backend(store: Any, url: str) -> Any:
    """The backend the Kafka path applies through: the store's own kind."""
    if is_postgres(store):
        from .postgres import PostgresBackend

        return PostgresBackend.from_url(url, timeout=30.0, max_connections=2)
    from .redis import RedisBackend

    return RedisBackend.from_url(url, timeout=30.0)


def _memory_partitions(backend: Any) -> list[str]:
    """The partitions a MemoryBackend has applied (it lists no watermarks publicly)."""
    marks = getattr(backend, "_watermarks", {})
    return sorted(marks) if isinstance(marks, dict) else []
