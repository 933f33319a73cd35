"""Run-time changes a store lost, found and put back (``mcpbg reconcile``).

The ledger's run-time changes (``mcpbg.cap_set``, ``cap_unset``,
``plan_assigned``, ``granted``, ``reset``) are projected like charges, into
the caps hashes (:func:`~mcp_budget_governor.caps.caps_key`), the plans hash
(``caps.PLANS_KEY``) and the counters' grant field (``caps.GRANT_FIELD``).
A master that died before replicating some of them leaves them out, and no
one re-reads them (docs/cluster.md): the committed amounts show such a loss
as drift, these did not.

**What should be live** is what the rebuild restores (``rebuild_plan._plan`` for the
counters, ``rebuild_plan._run_time_change_rows`` for these): the ledger's changes,
each event once, in ledger order, those at offsets at or below the cut,
folded by the one rule at the store's clock (``MemoryBackend.change_at``,
the mirror of ``lua/lib.lua`` apply_change the golden vectors hold to it: a
grant or reset of a bucket that has ended changes nothing).

**The cut.** One Redis: the watermarks, the clock and every hash in one
``MULTI`` (:func:`.sync.read_hashes`), compared up to those watermarks (a
Redis restarted from an older snapshot went back with its watermarks: the
worker re-applies what it re-reads past them). A cluster: each slot of
those hashes in one ``MULTI`` on its master (:func:`.cluster_sync.read_slots`),
compared up to the greater of its own and the resume watermarks
(:mod:`.cluster_sync` says why). Postgres: the watermarks, the clock,
``mcpbg_cap``, ``mcpbg_plan`` and the counters' grants in one ``REPEATABLE
READ`` transaction (:meth:`.pg_sync.PostgresStore.run_time`; ``mcpbg_apply``
commits a batch's changes with its watermark). Each store's read becomes one
:class:`Held`, and :func:`compare` holds it to the ledger, whatever the store.

**Compared**: each entry of every caps hash (cap, until, who and why), each
plan assignment, and the grant of every counter alive that a grant or reset
wrote. A stored entry the ledger does not give is drift too.

**Fixed** by writing back, through ``lua/change.lua``, the change that makes
each entry what the ledger gives (a cap set or unset, an assignment, a reset
to the grant), in one transaction per Redis, or per slot on its master, that
``WATCH``es the watermark hash the entries were compared with: if a
projector applied meanwhile nothing is written
(:class:`~.sync.ConcurrentProjectionError`; stop the workers, run it again).
On a cluster the same transaction adds the slot's seen ids of those change
events back (``SADD``; a producer retry of a lost grant is then skipped, not
added twice) and raises the slot's watermarks that were behind. On Postgres
the same changes go through ``mcpbg_change`` in one transaction that first
takes the store lock exclusive and checks the watermarks read
(:meth:`.pg_sync.PostgresStore.rewrite`, as ``reconcile --fix``'s counters).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import duckdb
import redis
from redis import exceptions as redis_errors
from redis.cluster import RedisCluster
from redis.crc import key_slot

from mcp_budget_governor.caps import (
    CAPS_PREFIX,
    GRANT_FIELD,
    PLANS_KEY,
    Change,
    ChangeKind,
    why_from,
)
from mcp_budget_governor.errors import BackendUnavailableError
from mcp_budget_governor.keys import INTERNAL_PREFIX, SEEN_PREFIX, WATERMARK_KEY, parse_key
from mcp_budget_governor.lua import source

from ..ledger_view import query_error
from .cluster import slot_tag
from .cluster_sync import read_slots, scan_keys
from .memory import MemoryBackend
from .rebuild import is_postgres
from .rebuild_plan import _run_time_change_rows
from .sync import (
    SEEN_DAY_SQL,
    SEEN_EXPIRE_SQL,
    ConcurrentProjectionError,
    Hashes,
    _decode,
    read_hashes,
)

if TYPE_CHECKING:
    from .pg_sync import PostgresStore

__all__ = ["ChangeDrift", "ChangesResult", "reconcile_changes"]

_UNAVAILABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError)


@dataclass(frozen=True, slots=True)
class ChangeDrift:
    """A run-time entry the store holds otherwise than the ledger gives (None: absent)."""

    kind: str  # "cap", "plan" or "grant"
    key: str
    field: str  # the caps hash's scope field, the assignment's field, or "g"
    store: str | None
    ledger: str | None


@dataclass(frozen=True, slots=True)
class _Row:
    """A run-time change of the ledger, with where it sits and its seen-id set."""

    event_id: str
    partition: str
    offset: int
    day: str
    seen_expire_at: int
    change: Change


def _ledger_rows(con: duckdb.DuckDBPyConnection) -> tuple[list[_Row], int]:
    """The ledger's run-time changes in ledger order, each event once (the rebuild's),
    and how many keep no ``data.change`` (archive segments older than that column)."""
    columns = f'partition_name, "offset", {SEEN_DAY_SQL}, {SEEN_EXPIRE_SQL}'
    try:
        rows = _run_time_change_rows(con, columns)
    except duckdb.Error as exc:
        raise query_error(exc) from None
    out = [
        _Row(event_id, str(p), int(o), str(d), int(e), change)
        for event_id, (p, o, d, e), change in rows
        if change is not None
    ]
    return out, len(rows) - len(out)


def _upto(rows: Iterable[_Row], upto: Mapping[str, int]) -> list[_Row]:
    return [r for r in rows if r.offset <= upto.get(r.partition, -1)]


def _model(rows: Sequence[_Row], now: int) -> MemoryBackend:
    """The run-time state ``rows`` leave at clock ``now`` (the one rule, in ledger order)."""
    model = MemoryBackend(clock=lambda: float(now))
    model.change_at([r.change for r in rows], float(now))
    return model


def _text(value: bytes | str) -> str:
    return _decode(value)


def _cap_text(entry: tuple[int, int, str] | str | None) -> str | None:
    if entry is None or isinstance(entry, str):
        return None if entry is None else f"unreadable: {entry!r}"
    cap, until, why = entry
    actor, reason = why_from(why)
    by = f" ({actor or '-'}: {reason})" if why != "-" else ""
    return f"{cap} until {until if until else 'for good'}{by}"


@dataclass(slots=True)
class Held:
    """The run-time entries a store holds, as read (one Redis, one cluster slot, or
    Postgres): what :func:`compare` holds to the ledger. Only what was read is
    compared: ``plans`` None when the plans were not read (another slot's)."""

    #: caps key -> scope field -> (cap, until, why token), or the text when unreadable.
    caps: dict[str, dict[str, tuple[int, int, str] | str]] = field(default_factory=dict)
    plans: dict[str, str] | None = None
    #: counter key -> its grant as stored (None: no grant, or no such counter).
    grants: dict[str, str | None] = field(default_factory=dict)


def held_of(hashes: Hashes) -> Held:
    """What Redis hashes (caps hashes, the plans hash, counters, as read) hold."""
    held = Held()
    for key, (fields, _) in hashes.items():
        raw = {_text(f): _text(v) for f, v in fields.items()}
        if key.startswith(f"{CAPS_PREFIX}:"):
            held.caps[key] = {f: _caps_value(v) for f, v in raw.items()}
        elif key == PLANS_KEY:
            held.plans = raw
        else:
            held.grants[key] = raw.get(GRANT_FIELD)
    return held


def compare(held: Held, model: MemoryBackend, now: int) -> list[tuple[ChangeDrift, Change]]:
    """The entries of ``held`` that differ from ``model``, each with the change that
    puts it back, by key."""
    caps, plans = model.overrides_now()
    grants = model.granted(now)
    out: list[tuple[ChangeDrift, Change]] = []
    keys = {*held.caps, *held.grants, *((PLANS_KEY,) if held.plans is not None else ())}
    for key in sorted(keys):
        if key in held.caps:
            limit = key[len(CAPS_PREFIX) + 1 :]
            stored = held.caps[key]
            given = caps.get(key, {})
            for f in sorted({*stored, *given}):
                s, g = stored.get(f), given.get(f)
                if s == g:
                    continue
                if g is None:
                    fix = Change(ChangeKind.CAP_UNSET, limit, key, f)
                else:
                    actor, reason = why_from(g[2])
                    fix = Change(ChangeKind.CAP_SET, limit, key, f, g[0], g[1], None, actor, reason)
                out.append((ChangeDrift("cap", key, f, _cap_text(s), _cap_text(g)), fix))
        elif key == PLANS_KEY:
            assert held.plans is not None
            for f in sorted({*held.plans, *plans}):
                s_plan, g_plan = held.plans.get(f), plans.get(f)
                if s_plan != g_plan:
                    fix = Change(ChangeKind.PLAN_ASSIGNED, "", key, f, plan=g_plan)
                    out.append((ChangeDrift("plan", key, f, s_plan, g_plan), fix))
        elif key in grants:
            grant, until, why = grants[key]
            held_grant = held.grants[key]
            if int(held_grant or 0) != grant:
                parsed = parse_key(key)
                actor, reason = why_from(why)
                fix = Change(
                    ChangeKind.RESET,
                    "" if parsed is None else parsed.limit,
                    key,
                    "",
                    grant,
                    until,
                    None,
                    actor,
                    reason,
                )
                out.append((ChangeDrift("grant", key, GRANT_FIELD, held_grant, str(grant)), fix))
    return out


def _caps_value(raw: str) -> tuple[int, int, str] | str:
    """A stored caps-hash value, or the text itself when it is of no shape apply_change
    writes (drift: the fix writes the ledger's over it)."""
    from .redis import caps_value

    try:
        return caps_value(raw)
    except ValueError:
        return raw


def _keys(rows: Iterable[_Row], stored_caps: Iterable[str]) -> set[str]:
    """The hashes to read: every caps hash stored or named, the plans hash, and each
    counter a grant or reset names whose bucket has not long ended (by this machine's
    clock, a day's margin: the comparison itself takes the store's)."""
    recent = time.time() - 86_400
    return {
        PLANS_KEY,
        *stored_caps,
        *(r.change.key for r in rows if r.change.kind not in _GRANTS or r.change.until > recent),
    }


_GRANTS = (ChangeKind.GRANTED, ChangeKind.RESET)


@dataclass(slots=True)
class ChangesResult:
    """What the run-time comparison found and, with ``fix``, put back."""

    drifts: list[ChangeDrift] = field(default_factory=list)
    fixed: int = 0
    #: Run-time events the ledger keeps without their change (archive segments older
    #: than the ``change`` column): when any, nothing is compared (what they set is unknown).
    unreadable: int = 0


def reconcile_changes(
    con: duckdb.DuckDBPyConnection,
    client: redis.Redis | RedisCluster | PostgresStore,
    *,
    fix: bool,
) -> ChangesResult:
    """The run-time entries of ``client`` (one Redis, a cluster, or Postgres) that differ
    from the ``ledger`` view on ``con`` and, with ``fix``, how many were put back."""
    rows, unreadable = _ledger_rows(con)
    if unreadable:
        return ChangesResult(unreadable=unreadable)
    if isinstance(client, RedisCluster):
        return _reconcile_cluster(client, rows, fix=fix)
    if is_postgres(client):
        return _reconcile_postgres(client, rows, fix=fix)  # type: ignore[arg-type]
    assert isinstance(client, redis.Redis)
    try:
        stored = [_text(k) for k in client.scan_iter(match=f"{CAPS_PREFIX}:*", count=5000)]
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
    now, marks, hashes = read_hashes(client, _keys(rows, stored))
    found = compare(held_of(hashes), _model(_upto(rows, marks), now), now)
    if fix and found:
        _put_back(client, [c for _, c in found], WATERMARK_KEY, marks, now)
    return ChangesResult([d for d, _ in found], len(found) if fix else 0)


def _reconcile_postgres(store: PostgresStore, rows: list[_Row], *, fix: bool) -> ChangesResult:
    """Postgres: the run-time tables read in one snapshot, fixed in one transaction."""
    keys = _keys(rows, ())
    read = store.run_time(k for k in keys if not k.startswith(INTERNAL_PREFIX))
    # Every caps key the ledger names is compared, as on Redis (absent: an empty hash).
    caps: dict[str, dict[str, tuple[int, int, str] | str]] = {
        **{k: {} for k in keys if k.startswith(f"{CAPS_PREFIX}:")},
        **{k: dict(v) for k, v in read.caps.items()},
    }
    held = Held(caps, read.plans, read.grants)
    found = compare(held, _model(_upto(rows, read.watermarks), read.now), read.now)
    if fix and found:
        # The store lock taken exclusive and the watermarks checked, as the counters'
        # rewrite: refused, nothing written, if a projector applied meanwhile.
        store.rewrite([], expected=read.watermarks, changes=[c for _, c in found])
    return ChangesResult([d for d, _ in found], len(found) if fix else 0)


def _reconcile_cluster(client: RedisCluster, rows: list[_Row], *, fix: bool) -> ChangesResult:
    """Slot by slot: each slot's hashes compared up to its own cut, fixed on its master."""
    reads = read_slots(client, _keys(rows, scan_keys(client, f"{CAPS_PREFIX}:*")))
    drifts: list[ChangeDrift] = []
    fixed = 0
    models: dict[tuple[tuple[str, int], ...], MemoryBackend] = {}
    for read in reads:
        cut = tuple(sorted(read.upto.items()))
        if cut not in models:  # usually one: every slot's cut is the resume watermarks
            models[cut] = _model(_upto(rows, read.upto), read.now)
        found = compare(held_of(read.hashes), models[cut], read.now)
        drifts += (d for d, _ in found)
        if not (fix and found):
            continue
        seen: dict[str, tuple[set[str], int]] = {}
        for r in _upto(rows, read.upto):
            if key_slot(r.change.key.encode()) == read.slot and r.seen_expire_at > read.now:
                seen.setdefault(r.day, (set(), r.seen_expire_at))[0].add(r.event_id)
        behind = {p: o for p, o in read.upto.items() if read.own.get(p, -1) < o}
        node = client.get_redis_connection(
            client.get_node_from_key(read.watermark_key)  # type: ignore[no-untyped-call]
        )
        _put_back(
            node,
            [c for _, c in found],
            read.watermark_key,
            read.own,
            read.now,
            seen={f"{SEEN_PREFIX}:{day}{slot_tag(read.slot)}": v for day, v in seen.items()},
            raise_to=behind,
        )
        fixed += len(found)
    drifts.sort(key=lambda d: (d.key, d.field))
    return ChangesResult(drifts, fixed)


def _put_back(
    node: Any,
    changes: Sequence[Change],
    watermark_key: str,
    watermarks: Mapping[str, int],
    now: int,
    *,
    seen: Mapping[str, tuple[set[str], int]] | None = None,
    raise_to: Mapping[str, int] | None = None,
) -> None:
    """Write ``changes`` through lua/change.lua in one transaction, refused if the
    watermark hash is no longer ``watermarks``; with them the seen ids ``seen`` (set
    key -> (ids, expire_at)) and the watermarks ``raise_to``."""
    from .redis import change_tokens

    keys: list[str] = []
    tokens = change_tokens(changes, keys, {})
    moved = ConcurrentProjectionError(
        "a projector applied events meanwhile (the watermarks moved): "
        "stop the workers, then run this again"
    )
    try:
        with node.pipeline(transaction=True) as pipe:
            pipe.watch(watermark_key)
            raw = pipe.hgetall(watermark_key)
            if {_text(k): int(v) for k, v in raw.items()} != dict(watermarks):
                raise moved
            pipe.multi()
            for seen_key, (ids, expire_at) in sorted((seen or {}).items()):
                pipe.sadd(seen_key, *sorted(ids))
                pipe.expireat(seen_key, expire_at)
            pipe.eval(source("change"), len(keys), *keys, tokens, str(now * 1000))
            if raise_to:
                pipe.hset(watermark_key, mapping=dict(raise_to))
            pipe.execute()
    except redis_errors.WatchError:
        raise moved from None
    except _UNAVAILABLE as exc:
        raise BackendUnavailableError.redis(exc) from None
