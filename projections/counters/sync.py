"""Ledger totals per counter, and writing them to Redis: what rebuild and reconcile share.

:func:`ledger_totals` is the committed amount the ledger gives each live
counter; :func:`snapshot` reads counters, watermarks and the Redis clock in one
``MULTI``; :func:`write_counters` rewrites counters in ``lua/rewrite.lua``
blocks that write nothing (:class:`ConcurrentProjectionError`) if a projector
applied meanwhile. ``docs/exactly-once.md`` (*Ledger totals and rewriting
counters*) gives the rules.

A day counter expires an hour (the grace period) after its bucket ends: in
that hour it is alive, but no longer current.

>>> end_of_day = 1764633600  # 2025-12-02T00:00:00Z
>>> key = "mcpbg:v1:spend:user=alice:20251201"
>>> is_current(key, end_of_day + 3600, now=end_of_day - 1)
True
>>> is_current(key, end_of_day + 3600, now=end_of_day + 60)
False
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa  # type: ignore[import-untyped]
import redis
from redis import exceptions as redis_errors

from mcp_budget_governor.errors import BackendUnavailableError, GovernorError, InvalidInputError
from mcp_budget_governor.keys import INTERNAL_PREFIX, PREFIX, WATERMARK_KEY
from mcp_budget_governor.lua import source
from mcp_budget_governor.urls import check_redis_url, redact
from mcp_budget_governor.windows import GRACE_SECONDS, SESSION_BUCKET

from ..ledger_view import query_error

__all__ = [
    "ConcurrentProjectionError",
    "RedisCounter",
    "Snapshot",
    "Totals",
    "is_current",
    "ledger_ids",
    "ledger_seen_ids",
    "ledger_totals",
    "read_hashes",
    "redis_client",
    "scan_counter_keys",
    "snapshot",
    "write_counters",
]

_CHUNK = 2000
_UNAVAILABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)


class ConcurrentProjectionError(GovernorError):
    """A projector applied events while counters were being rewritten: nothing was written."""


#: The old name of "the counters' Redis could not be reached": one class now.
RedisUnavailableError = BackendUnavailableError


def redis_client(url: str) -> redis.Redis:
    """A client for ``url``; a bad URL or an unreachable server is a one-line error."""
    check_redis_url(url)
    try:
        client = redis.Redis.from_url(url, socket_timeout=30.0, socket_connect_timeout=5.0)
        client.ping()
    except redis_errors.ResponseError as exc:  # e.g. a database index the server lacks
        raise InvalidInputError("--redis-url", redact(url), f"refused: {exc}") from None
    except (ValueError, *_UNAVAILABLE) as exc:
        raise BackendUnavailableError.redis(exc, url) from None
    return client


def is_current(key: str, expire_at: int, now: int) -> bool:
    """Whether the counter's bucket has not ended (a session counter: while alive)."""
    if key.endswith(f":{SESSION_BUCKET}"):
        return expire_at > now
    return expire_at - GRACE_SECONDS > now


#: A counter as the ledger gives it: ``key -> (sum of its charges, latest expire_at)``.
Totals = dict[str, tuple[int, int]]


def ledger_totals(
    con: duckdb.DuckDBPyConnection,
    now: int,
    *,
    current_only: bool = False,
    upto: Mapping[str, int] | None = None,
    keys: Iterable[str] | None = None,
) -> Totals:
    """Sum of ``amount`` per live counter key (docs/exactly-once.md), exact integers.

    ``upto``: watermark per ``partition_name``; only charges at offsets at or
    below it count (a partition absent from it counts nothing). ``keys``:
    only these counters.
    """
    join = _register_upto(con, upto) if upto is not None else "WHERE"
    if keys is not None:
        con.register("_mcpbg_keys", pa.table({"key": pa.array(sorted(set(keys)), pa.string())}))
        join += ' "key" IN (SELECT "key" FROM _mcpbg_keys) AND'
    params: dict[str, object] = {"now": int(now)}
    current = ""
    if current_only:
        current = "AND (max(expire_at) - $grace > $now OR any_value(bucket) = $session)"
        params.update(grace=GRACE_SECONDS, session=SESSION_BUCKET)
    sql = f"""
        SELECT "key", CAST(sum(amount) AS BIGINT) AS amount, max(expire_at) AS expire_at
        FROM ledger {join} "key" IS NOT NULL
        GROUP BY "key"
        HAVING max(expire_at) > $now {current}
    """
    try:
        # sum() of BIGINT is a HUGEINT, exact; the cast back raises rather than wraps.
        table = con.sql(sql, params=params).to_arrow_table()
    except duckdb.Error as exc:
        raise query_error(exc) from None
    pairs = zip(
        table.column("amount").to_pylist(), table.column("expire_at").to_pylist(), strict=True
    )
    return dict(zip(table.column("key").to_pylist(), pairs, strict=True))


def _register_upto(con: duckdb.DuckDBPyConnection, upto: Mapping[str, int]) -> str:
    """Register the watermarks as a table; the join restricting ``ledger`` rows to them."""
    con.register(
        "_mcpbg_upto",
        pa.table(
            {
                "partition_name": pa.array(list(upto), pa.string()),
                "applied": pa.array(list(upto.values()), pa.int64()),
            }
        ),
    )
    return 'JOIN _mcpbg_upto w USING (partition_name) WHERE "offset" <= w.applied AND'


def ledger_ids(
    con: duckdb.DuckDBPyConnection, ids: Iterable[str], *, upto: Mapping[str, int] | None = None
) -> set[str]:
    """Which of ``ids`` are events in the ledger (at or below the watermarks ``upto``)."""
    wanted = list(set(ids))
    if not wanted:
        return set()
    con.register("_mcpbg_ids", pa.table({"id": pa.array(wanted, pa.string())}))
    where = _register_upto(con, upto) if upto is not None else "WHERE"
    sql = f"SELECT DISTINCT id FROM ledger {where} id IN (SELECT id FROM _mcpbg_ids)"
    try:
        rows = con.execute(sql).fetchall()
    except duckdb.Error as exc:
        raise query_error(exc) from None
    return {r[0] for r in rows}


#: Per counter key: per seen-id day (``20261129``), the event ids and that set's expiry.
SeenIds = dict[str, dict[str, tuple[list[str], int]]]


#: An event's seen-id day and that set's expiry, in DuckDB over a ``"time"`` column:
#: ``AppliedEvent.seen_day`` and ``seen_expire_at`` (tests/test_replay.py holds them together).
SEEN_DAY_SQL = """strftime("time", '%Y%m%d')"""
SEEN_EXPIRE_SQL = """(CAST(floor(epoch("time") / 86400) AS BIGINT) + 2) * 86400"""


def ledger_seen_ids(
    con: duckdb.DuckDBPyConnection, now: int, *, upto: Mapping[str, int], keys: Iterable[str]
) -> SeenIds:
    """The ids of the events that charged each of ``keys`` at offsets at or below the
    watermarks ``upto``, by the seen-id day of the event (``AppliedEvent.seen_day``,
    expiring at ``seen_expire_at``), the days whose set is still alive at ``now``:
    what the seen-id sets of those counters' slot hold once it applied them
    (``reconcile --fix`` on Redis Cluster puts back what a failover lost)."""
    join = _register_upto(con, upto)
    con.register("_mcpbg_keys", pa.table({"key": pa.array(sorted(set(keys)), pa.string())}))
    sql = f"""
        SELECT "key", {SEEN_DAY_SQL} AS day, {SEEN_EXPIRE_SQL} AS expire_at,
               list(DISTINCT id ORDER BY id) AS ids
        FROM ledger {join} "key" IN (SELECT "key" FROM _mcpbg_keys) AND {SEEN_EXPIRE_SQL} > $now
        GROUP BY ALL
    """
    try:
        rows = con.execute(sql, {"now": int(now)}).fetchall()
    except duckdb.Error as exc:
        raise query_error(exc) from None
    out: SeenIds = {}
    for key, day, expire, ids in rows:
        out.setdefault(key, {})[day] = (list(ids), int(expire))
    return out


@dataclass(slots=True)
class RedisCounter:
    """A counter read from Redis: committed, in-flight total and per event id, TTL (s)."""

    committed: int = 0
    in_flight: int = 0
    pending: dict[str, int] = field(default_factory=dict)
    ttl: int = -2


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Counters, watermarks and the Redis clock, read at one instant."""

    now: int
    watermarks: dict[str, int]
    counters: dict[str, RedisCounter]


def scan_counter_keys(client: redis.Redis) -> set[str]:
    """Every counter key in Redis (an incremental SCAN; the projection's own keys left out)."""
    try:
        return {
            raw.decode() if isinstance(raw, bytes) else raw
            for raw in client.scan_iter(match=f"{PREFIX}:[^_]*", count=5000)
            if not (raw.decode() if isinstance(raw, bytes) else raw).startswith(INTERNAL_PREFIX)
        }
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _counter(raw: Mapping[bytes, bytes], ttl: int) -> RedisCounter:
    out = RedisCounter(ttl=int(ttl))
    for k, v in raw.items():
        name = _decode(k)
        if name == "c":
            out.committed = int(v)
        elif name == "f":
            out.in_flight = int(v)
        elif name.startswith("e:"):
            out.pending[name[2:]] = int(v)
    return out


def snapshot(client: redis.Redis, keys: Iterable[str], *, atomic: bool = True) -> Snapshot:
    """Read ``keys`` (missing ones come back empty), the watermarks and Redis's clock.

    ``atomic=True`` reads everything in one ``MULTI``: no script (no apply,
    no charge) runs in between, so committed amounts and watermarks match.
    ``atomic=False`` reads in pipelined chunks (cheaper for a very large
    Redis when no projector runs).
    """
    seconds, marks, hashes = read_hashes(client, keys, atomic=atomic)
    counters = {key: _counter(raw, ttl) for key, (raw, ttl) in hashes.items()}
    return Snapshot(seconds, marks, counters)


#: Hashes as read: key -> (field -> value, TTL in seconds; -2: no such key).
Hashes = dict[str, tuple[dict[bytes, bytes], int]]


def read_hashes(
    client: redis.Redis, keys: Iterable[str], *, atomic: bool = True
) -> tuple[int, dict[str, int], Hashes]:
    """Redis's clock (seconds), the watermarks and every hash of ``keys`` with its TTL,
    in one ``MULTI`` (``atomic``) or in pipelined chunks: what :func:`snapshot` reads,
    and the run-time changes' reconcile (:mod:`.changes_sync`)."""
    ordered = sorted(set(keys))
    try:
        pipe = client.pipeline(transaction=atomic)
        pipe.time()
        pipe.hgetall(WATERMARK_KEY)
        head: list[object] = []
        for start in range(0, max(len(ordered), 1), _CHUNK):
            for key in ordered[start : start + _CHUNK]:
                pipe.hgetall(key)
                pipe.ttl(key)
            if not atomic:
                head.extend(pipe.execute())
                pipe = client.pipeline(transaction=False)
        head.extend(pipe.execute())
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    clock: Any = head[0]
    marks = {_decode(k): int(v) for k, v in head[1].items()}  # type: ignore[attr-defined]
    values = head[2:]
    hashes: Hashes = {
        key: (values[2 * i], int(values[2 * i + 1]))  # type: ignore[misc, call-overload]
        for i, key in enumerate(ordered)
    }
    return int(clock[0]), marks, hashes


def write_counters(
    client: redis.Redis,
    counters: Sequence[tuple[str, int, int]],
    *,
    watermarks: Mapping[str, int] | None,
    add: bool = False,
    drop: Mapping[str, Sequence[str]] | None = None,
    set_watermarks: Mapping[str, int] | None = None,
    progress: Callable[[int], None] | None = None,
    chunk: int = _CHUNK,
    watermark_key: str = WATERMARK_KEY,
) -> None:
    """Rewrite ``counters`` (``(key, committed, expire_at)``), one ``lua/rewrite.lua`` call
    per block of ``chunk``. ``add=True``: the amounts are corrections added
    to committed (``reconcile --fix``: right even while a projector runs)
    instead of the new committed amounts.

    ``drop``: per key, the in-flight event ids to remove (events the ledger
    has counted). ``watermarks``: the watermark hash as read before; a block
    finding it changed (a projector applied meanwhile) writes nothing and
    raises :class:`ConcurrentProjectionError` (None: no check). ``set_watermarks`` are written
    by the last block, in the same atomic step as its counters, so the live
    projector resumes after what was written. ``progress(n)`` is called
    after each block with the number of counters it wrote. ``watermark_key``: the
    watermark hash (on Redis Cluster, the one of the counters' slot).
    """
    script = client.register_script(source("rewrite"))
    drops = drop or {}
    expected: list[str | int] = ["add" if add else "set"]
    if watermarks is None:
        expected.append(-1)
    else:
        expected.append(len(watermarks))
        for name, offset in watermarks.items():
            expected += (name, offset)
    blocks = [counters[i : i + chunk] for i in range(0, len(counters), chunk)] or [[]]
    try:
        for n, block in enumerate(blocks):
            keys: list[str] = [watermark_key]
            args: list[str | int] = list(expected)
            for key, committed, expire_at in block:
                keys.append(key)
                ids = drops.get(key, ())
                args += (committed, expire_at, len(ids), *ids)
            final = set_watermarks if n == len(blocks) - 1 and set_watermarks else {}
            args.append(len(final))
            for name, offset in final.items():
                args += (name, offset)
            if int(script(keys=keys, args=args)) < 0:
                raise ConcurrentProjectionError(
                    "a projector applied events meanwhile (the watermarks moved): "
                    "stop the workers, then run this again"
                )
            if progress is not None:
                progress(len(block))
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None


def _watermarks(client: redis.Redis) -> dict[str, int]:
    return {_decode(k): int(v) for k, v in client.hgetall(WATERMARK_KEY).items()}
