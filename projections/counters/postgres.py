"""Postgres counters: the shared read model, driven only through the functions in ``sql/``.

Each operation is one SQL function call, one round trip: ``mcpbg_charge``
admits or refuses a whole check over every applicable limit, locking the
counters it touches in one fixed order (sql/0002_functions.sql says how), so
concurrent checks never over-admit and never deadlock. The schema is
versioned: the migrations in ``sql/`` are applied on first use (and by
``mcpbg migrate``), each once, under a lock, so replicas starting together
agree.

The driver is psycopg 3 (async) with psycopg-pool: it is typed (mypy --strict
needs no stubs), speaks libpq's URLs and environment (``sslmode``, service
files, ``PGPASSWORD``) exactly as ``psql`` does, and the pool replaces dead
connections in the background, so a restarted server is picked up without a
restart of ours. Connection failures and timeouts become
:class:`BackendUnavailableError`, so the governor applies each limit's fail
mode; a charge whose reply came too late carries its operation id, so its
replay counts once (as on Redis).

>>> backend = PostgresBackend.from_url("postgresql://postgres@127.0.0.1:5432/test")
>>> backend.timeout
0.5
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from mcp_budget_governor.caps import PLANS_KEY, Change, why_token
from mcp_budget_governor.counters import (
    AppliedEvent,
    ChargeResult,
    CounterOp,
    CounterState,
    overflow,
)
from mcp_budget_governor.errors import (
    BackendUnavailableError,
    EpochMissingError,
    InvalidInputError,
)
from mcp_budget_governor.keys import EPOCH_VALUE, INTERNAL_PREFIX, LEASE_PREFIX
from mcp_budget_governor.sql import latest, migrations
from mcp_budget_governor.urls import check_postgres_url, redact

DEFAULT_TIMEOUT = 0.5
_ADMITTED = ChargeResult(-1, ())
# The advisory lock migrations take (another class than the counters' locks).
_MIGRATION_LOCK = 1835233379
_UNAVAILABLE = (psycopg.OperationalError, PoolTimeout, TimeoutError, OSError)

_CHARGE = (
    "SELECT mcpbg_charge(%s, %s, %s, %s, %s::text[], %s::bigint[], %s::bigint[], "
    "%s::boolean[], %s::float8[], %s, %s::boolean[], %s::text[], %s::text[], %s::bigint[], "
    "%s::text[], %s::text[], %s::text[], %s, %s, %s)"
)
_APPLY = (
    "SELECT mcpbg_apply(%s, %s, %s, %s::bigint[], %s::text[], %s::text[], %s::float8[], "
    "%s::int[], %s::int[], %s::text[], %s::bigint[], %s::float8[], %s::text[], %s::text[], "
    "%s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::text[])"
)


CHANGE_SQL = (
    "SELECT mcpbg_change(%s::text[], %s::text[], %s::text[], %s::bigint[], "
    "%s::bigint[], %s::text[], %s::text[])"
)


def change_params(changes: Sequence[Change]) -> tuple[list[Any], ...]:
    """The arrays of one ``mcpbg_change`` call (:data:`CHANGE_SQL`)."""
    return (
        [c.kind.value for c in changes],
        [c.key for c in changes],
        [c.field or "-" for c in changes],
        [c.amount for c in changes],
        [c.until for c in changes],
        [c.plan or "-" for c in changes],
        [why_token(c.actor, c.reason) for c in changes],
    )


def like_pattern(match: str) -> str:
    """A ``keys.key_pattern`` (``*``: any run) as a LIKE pattern with ``\\`` escapes.

    >>> like_pattern("mcpbg:v1:per_tool:user=a%3Ab,tool=*:20261129")
    'mcpbg:v1:per\\\\_tool:user=a\\\\%3Ab,tool=%:20261129'
    """
    escaped = match.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%")


def charge_params(
    ops: Sequence[CounterOp],
    *,
    event_id: str | None,
    want_used: bool,
    op_id: str | None,
    lease: str | None,
    lease_ttl: float,
    ticket: str | None,
    require_epoch: bool,
) -> tuple[Any, ...]:
    """The arguments of one ``mcpbg_charge`` call (:data:`_CHARGE`), as every client
    passes them: the conformance vectors hold the TypeScript backend's to these."""
    if op_id is None or event_id is not None:
        op_id = None
    leases = any(op.key.startswith(LEASE_PREFIX) for op in ops)
    if leases and lease is None:
        raise InvalidInputError("lease", lease, "a charge taking leases needs a lease id")
    resolve = any(op.ref is not None for op in ops)
    refs = [op.ref for op in ops]
    return (
        event_id or "",
        op_id or "",
        want_used,
        require_epoch,
        [op.key for op in ops],
        [op.amount for op in ops],
        [op.cap for op in ops],
        [op.enforce for op in ops],
        [op.expire_at for op in ops],
        resolve,
        [r is not None for r in refs],
        [PLANS_KEY if r is None else r.caps_key for r in refs],
        ["" if r is None else r.field for r in refs],
        [None if r is None else r.value_cap for r in refs],
        ["" if r is None else ",".join(r.plan_fields) for r in refs],
        ["" if r is None else " ".join(f"{n} {c}" for n, c in r.plan_caps) for r in refs],
        ["" if r is None else r.file_plan or "" for r in refs],
        lease or "" if leases else "",
        max(1, round(lease_ttl * 1000)),
        ticket or "" if leases else "",
    )


# A charge that refuses (cap 0) on a key no counter has: it writes nothing.
_WARM_PARAMS = (
    "", "", True, False, ["mcpbg:v1:_warm:-:-"], [1], [0], [True], [0.0], True, [True],
    [PLANS_KEY], ["-"], [None], [""], [""], [""], "", 1, "",
)  # fmt: skip


async def _warm(conn: psycopg.AsyncConnection[Any]) -> None:
    """Run each new pooled connection's first charge before a caller gets it: Postgres
    compiles a PL/pgSQL function once per session, which would otherwise cost the
    first check on every connection several round trips' time."""
    # Not migrated yet (a new database): the first use migrates, then warms.
    with contextlib.suppress(pg_errors.UndefinedFunction, pg_errors.UndefinedTable):
        await conn.execute(_CHARGE, _WARM_PARAMS)


class PostgresBackend:
    """Counters in Postgres, shared by every replica (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 32,
        require_epoch: bool = False,
        durable: bool = True,
    ) -> None:
        self.url = url
        self.durable = durable
        self.timeout = timeout
        self.require_epoch = require_epoch
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=max(1, max_connections),
            open=False,
            timeout=timeout,
            kwargs={
                "autocommit": True,
                "connect_timeout": max(2, round(timeout + 0.5)),
                **({} if durable else {"options": "-c synchronous_commit=off"}),
            },
            reconnect_timeout=0,  # keep trying while the server is away
            name="mcpbg",
            configure=_warm,
        )
        self._opened = False
        self._migrated = False
        self._open_lock = asyncio.Lock()
        self._checking: asyncio.Task[None] | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 32,
        require_epoch: bool = False,
        durable: bool = True,
    ) -> PostgresBackend:
        """Connect lazily to ``url``; ``timeout`` (seconds) bounds every call.

        ``require_epoch=True`` (deployments with a ledger and a stream worker):
        until the worker has declared the counters complete, every charge
        counts as the store being unreachable, so nothing is admitted from
        counters that are not yet rebuilt.

        ``durable=False`` commits without waiting for the WAL flush
        (``synchronous_commit=off``): a check costs about a quarter as much
        (docs/postgres.md), and a crash of Postgres (not of this process) may
        lose the last fraction of a second of charges, whole transactions only,
        never half of one. With a ledger that is safe: the projection's
        watermark is lost with them, so the worker re-applies those events.
        Without a ledger the lost charges are not counted: keep the default.
        """
        check_postgres_url(url, "url")
        return cls(
            url,
            timeout=timeout,
            max_connections=max_connections,
            require_epoch=require_epoch,
            durable=durable,
        )

    # -- plumbing -----------------------------------------------------------

    def _down(self, exc: BaseException) -> BackendUnavailableError:
        """The one wording of "Postgres unreachable"; stale pooled connections are checked."""
        if isinstance(exc, BackendUnavailableError):
            return exc
        if self._opened and (self._checking is None or self._checking.done()):
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to check
                self._checking = asyncio.get_running_loop().create_task(self._check_pool())
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return BackendUnavailableError(f"postgres {redact(self.url)} unreachable: {text}")

    async def _check_pool(self) -> None:
        # Replaces the idle connections a server restart broke, so they fail no more calls.
        with contextlib.suppress(Exception):
            await self._pool.check()

    async def _ensure(self) -> None:
        if self._migrated:
            return
        async with self._open_lock:
            if not self._opened:
                await self._pool.open(wait=False)
                self._opened = True
            if not self._migrated:
                async with self._pool.connection() as conn:
                    await migrate_connection(conn)
                    await _warm(conn)
                self._migrated = True

    async def _call(self, query: str, params: Sequence[Any]) -> Any:
        """One statement's first value, within the timeout; failures: unavailable."""
        try:
            async with asyncio.timeout(self.timeout):
                if not self._migrated:
                    await self._ensure()
                async with self._pool.connection() as conn:
                    cur = await conn.execute(query, params)
                    row = await cur.fetchone()
        except pg_errors.RaiseException as exc:
            raise ValueError(str(exc).splitlines()[0]) from None
        except _UNAVAILABLE as exc:
            raise self._down(exc) from exc
        return None if row is None else row[0]

    async def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            async with asyncio.timeout(max(self.timeout, 5.0)):
                if not self._migrated:
                    await self._ensure()
                async with self._pool.connection() as conn:
                    cur = await conn.execute(query, params)
                    return list(await cur.fetchall())
        except _UNAVAILABLE as exc:
            raise self._down(exc) from exc

    async def migrate(self) -> int:
        """Apply every pending migration now; the schema version afterwards."""
        try:
            await self._ensure()
        except _UNAVAILABLE as exc:
            raise self._down(exc) from exc
        return latest()

    # -- the hot path -------------------------------------------------------

    async def charge(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
        lease: str | None = None,
        lease_ttl: float = 0.0,
        ticket: str | None = None,
    ) -> ChargeResult:
        # ``ticket``: a call waiting for a concurrency slot (Governor.check(wait=)) holds
        # its place in mcpbg_wait, so a freed slot goes to the oldest waiter.
        resolve = any(op.ref is not None for op in ops)
        params = charge_params(
            ops, event_id=event_id, want_used=want_used, op_id=op_id, lease=lease,
            lease_ttl=lease_ttl, ticket=ticket, require_epoch=self.require_epoch,
        )  # fmt: skip
        reply: list[int] = await self._call(_CHARGE, params)
        head = reply[0]
        if head == 0 and len(reply) == 1:
            return _ADMITTED
        if head == -2:
            op = ops[reply[1] - 1]
            raise overflow(op.key, op.amount)
        if head < 0:
            raise BackendUnavailableError("postgres counters not complete (no epoch): rebuilding")
        values = tuple(reply[1:])
        n = len(ops)
        if resolve and len(values) == 2 * n:
            return ChargeResult(head - 1, values[:n], values[n:])
        return ChargeResult(head - 1, values)

    async def usage(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        return list(await self._call("SELECT mcpbg_usage(%s::text[])", (list(keys),)))

    # -- leases -------------------------------------------------------------

    async def _leases(self, mode: str, keys: Sequence[str], lease: str, ttl_ms: int) -> list[int]:
        if not keys:
            return []
        sql = "SELECT mcpbg_leases(%s, %s::text[], %s, %s)"
        return list(await self._call(sql, (mode, list(keys), lease, ttl_ms)))

    async def leave(self, keys: Sequence[str], ticket: str) -> int:
        """Take waiting ticket ``ticket`` out of the queues of lease sets ``keys``."""
        if not keys:
            return 0
        return int(await self._call("SELECT mcpbg_leave(%s::text[], %s)", (list(keys), ticket)))

    async def release(self, keys: Sequence[str], lease: str) -> int:
        """Give lease ``lease`` back on every set in ``keys``; how many held it."""
        return sum(await self._leases("r", keys, lease, 0))

    async def renew(self, keys: Sequence[str], lease: str, ttl: float) -> int:
        """Extend lease ``lease`` to the server's now + ``ttl`` where it is still alive."""
        return sum(await self._leases("n", keys, lease, max(1, round(ttl * 1000))))

    async def in_progress(self, keys: Sequence[str]) -> list[int]:
        """How many live leases each set holds (calls in progress)."""
        return await self._leases("c", keys, "", 0)

    async def lease_keys(self, limit: int) -> list[str]:
        """Up to ``limit`` lease sets holding a live lease, sorted."""
        rows = await self._rows(
            "SELECT DISTINCT key FROM mcpbg_lease WHERE until_ms > "
            "floor(mcpbg_now() * 1000) ORDER BY key LIMIT %s",
            (max(limit, 0),),
        )
        return [r[0] for r in rows]

    # -- the projection -----------------------------------------------------

    async def apply(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool = False,
        through: int = -1,
    ) -> int:
        if not events and through < 0:
            return 0
        offsets, ids, days, day_expire, ncharges, nchanges = [], [], [], [], [], []
        ckeys, camounts, cexpire = [], [], []
        kinds, xkeys, xfields, xamounts, xuntils, xplans, xwhys = [], [], [], [], [], [], []
        for event in events:
            if not event.event_id:
                raise ValueError(f"event id {event.event_id!r}: empty")
            offsets.append(event.offset)
            ids.append(event.event_id)
            days.append(event.seen_day)
            day_expire.append(event.seen_expire_at)
            ncharges.append(len(event.charges))
            nchanges.append(len(event.changes))
            for charge in event.charges:
                ckeys.append(charge.key)
                camounts.append(charge.amount)
                cexpire.append(charge.expire_at)
            for c in event.changes:
                kinds.append(c.kind.value)
                xkeys.append(c.key)
                xfields.append(c.field or "-")
                xamounts.append(c.amount)
                xuntils.append(c.until)
                xplans.append(c.plan or "-")
                xwhys.append(why_token(c.actor, c.reason))
        params = (
            partition, require_epoch, through, offsets, ids, days, day_expire, ncharges,
            nchanges, ckeys, camounts, cexpire, kinds, xkeys, xfields, xamounts, xuntils,
            xplans, xwhys,
        )  # fmt: skip
        applied = int(await self._call_long(_APPLY, params))
        if applied < 0:
            raise EpochMissingError("postgres counters not complete (no epoch): rebuild first")
        return applied

    async def _call_long(self, query: str, params: Sequence[Any]) -> Any:
        """:meth:`_call` for batch work (apply, rewrite): a longer bound than the hot path's."""
        try:
            async with asyncio.timeout(max(self.timeout, 30.0)):
                if not self._migrated:
                    await self._ensure()
                async with self._pool.connection() as conn:
                    cur = await conn.execute(query, params)
                    row = await cur.fetchone()
        except pg_errors.RaiseException as exc:
            raise ValueError(str(exc).splitlines()[0]) from None
        except _UNAVAILABLE as exc:
            raise self._down(exc) from exc
        return None if row is None else row[0]

    async def watermark(self, partition: str) -> int:
        """The last applied offset of a partition, -1 when none."""
        rows = await self._rows(
            "SELECT applied FROM mcpbg_watermark WHERE partition = %s", (partition,)
        )
        return int(rows[0][0]) if rows else -1

    async def watermarks(self) -> dict[str, int]:
        """Every partition's applied offset."""
        rows = await self._rows("SELECT partition, applied FROM mcpbg_watermark")
        return {p: int(a) for p, a in rows}

    async def rewrite(
        self,
        counters: Sequence[tuple[str, int, int, Sequence[str]]],
        *,
        add: bool = False,
        expected: dict[str, int] | None = None,
        marks: dict[str, int] | None = None,
    ) -> int:
        """Rewrite counters from the ledger (rebuild, ``reconcile --fix``): per
        ``(key, amount, expire_at (0: keep), in-flight ids to drop)``, committed is
        set to (``add``: increased by) amount, in one transaction; refused (-1,
        nothing written) when the watermarks are not ``expected`` any more."""
        params = (
            "add" if add else "set",
            None if expected is None else json.dumps(expected),
            [c[0] for c in counters],
            [c[1] for c in counters],
            [c[2] for c in counters],
            json.dumps([list(c[3]) for c in counters]),
            json.dumps(marks or {}),
        )
        sql = (
            "SELECT mcpbg_rewrite(%s, %s::jsonb, %s::text[], %s::bigint[], %s::float8[], "
            "%s::jsonb, %s::jsonb)"
        )
        return int(await self._call_long(sql, params))

    async def gc(self, limit: int = 10_000) -> int:
        """Delete up to ``limit`` ended rows per table (never needed for correctness)."""
        return int(await self._call_long("SELECT mcpbg_gc(%s)", (limit,)))

    async def has_epoch(self) -> bool:
        """Whether the counters are declared complete (see :meth:`mark_ready`)."""
        return bool(await self._call("SELECT mcpbg_epoch_ok()", ()))

    async def mark_ready(self, epoch: str) -> None:
        """Declare the counters complete: the hot path may admit from them again."""
        if not isinstance(epoch, str) or EPOCH_VALUE.fullmatch(epoch) is None:
            raise InvalidInputError("epoch", epoch, f"expected {EPOCH_VALUE.pattern}")
        await self._call(
            "INSERT INTO mcpbg_meta (name, value) VALUES ('epoch', %s) "
            "ON CONFLICT (name) DO UPDATE SET value = excluded.value RETURNING 1",
            (epoch,),
        )

    async def clear_epoch(self) -> None:
        """Withdraw the epoch marker (a rebuild is starting)."""
        await self._call("DELETE FROM mcpbg_meta WHERE name = 'epoch' RETURNING 1", ())

    # -- reads --------------------------------------------------------------

    async def state(self, key: str) -> CounterState:
        rows = await self._rows(
            "SELECT c.committed, c.in_flight, c.grant_amount, "
            "coalesce((SELECT json_object_agg(p.event_id, p.amount) FROM mcpbg_pending p "
            "WHERE p.key = c.key), '{}') FROM mcpbg_counter c "
            "WHERE c.key = %s AND c.expire_at > mcpbg_now()",
            (key,),
        )
        if not rows:
            return CounterState(0, 0, {})
        c, f, g, pending = rows[0]
        return CounterState(int(c), int(f), {k: int(v) for k, v in pending.items()}, int(g))

    async def grants_of(self, keys: Sequence[str]) -> list[int]:
        """Each counter's grant (0 when none), in one round trip."""
        if not keys:
            return []
        rows = await self._rows(
            "SELECT coalesce(c.grant_amount, 0) FROM unnest(%s::text[]) WITH ORDINALITY "
            "AS k(key, ord) LEFT JOIN mcpbg_counter c ON c.key = k.key "
            "AND c.expire_at > mcpbg_now() ORDER BY k.ord",
            (list(keys),),
        )
        return [int(r[0]) for r in rows]

    async def grants(self, limit: int) -> list[tuple[str, int, str]]:
        """Up to ``limit`` counters holding a grant: ``(key, grant, why token)``, sorted."""
        rows = await self._rows(
            "SELECT key, grant_amount, coalesce(why, '-') FROM mcpbg_counter "
            "WHERE expire_at > mcpbg_now() AND why IS NOT NULL ORDER BY key LIMIT %s",
            (max(limit, 0),),
        )
        return [(k, int(g), w) for k, g, w in rows]

    async def grant_reason(self, key: str) -> str:
        """The why token (``caps.why_token``) of the counter's last grant or reset."""
        rows = await self._rows(
            "SELECT coalesce(why, '-') FROM mcpbg_counter WHERE key = %s", (key,)
        )
        return rows[0][0] if rows else "-"

    async def change(self, changes: Sequence[Change]) -> None:
        """Apply run-time changes directly (no ledger), all in one function call."""
        if not changes:
            return
        await self._call_long(CHANGE_SQL, change_params(changes))

    async def overrides(self) -> tuple[dict[str, dict[str, tuple[int, int, str]]], dict[str, str]]:
        """The run-time value caps (caps key -> field -> (cap, until, why)) and assignments."""
        caps: dict[str, dict[str, tuple[int, int, str]]] = {}
        for key, field, cap, until, why in await self._rows(
            "SELECT caps_key, field, cap, until, why FROM mcpbg_cap ORDER BY 1, 2"
        ):
            caps.setdefault(key, {})[field] = (int(cap), int(until), why)
        plans = dict(await self._rows("SELECT field, plan FROM mcpbg_plan"))
        return caps, plans

    async def counter_keys(self, limit: int, *, match: str | None = None) -> list[str]:
        """Up to ``limit`` live counter keys, sorted; ``match``: a ``keys.key_pattern``."""
        if limit <= 0:
            return []
        internal = like_pattern(INTERNAL_PREFIX) + "%"
        pattern = "%" if match is None else like_pattern(match)
        rows = await self._rows(
            "SELECT key FROM mcpbg_counter WHERE expire_at > mcpbg_now() "
            "AND key LIKE %s AND key NOT LIKE %s ORDER BY key LIMIT %s",
            (pattern, internal, limit),
        )
        return [r[0] for r in rows]

    async def aclose(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
            with contextlib.suppress(BaseException):
                await self._checking
        if self._opened:
            await self._pool.close()
            self._opened = False
            self._migrated = False


async def migrate_connection(conn: psycopg.AsyncConnection[Any]) -> list[int]:
    """Apply the migrations ``conn``'s database lacks, each once and in order, under a
    lock (replicas starting together wait for each other); the versions applied."""
    done: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS mcpbg_migrations (version integer PRIMARY KEY, "
            "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cur = await conn.execute("SELECT version FROM mcpbg_migrations")
        have = {int(r[0]) for r in await cur.fetchall()}
        for m in migrations():
            if m.version in have:
                continue
            await conn.execute(m.text.encode())
            await conn.execute(
                "INSERT INTO mcpbg_migrations (version, name) VALUES (%s, %s)", (m.version, m.name)
            )
            done.append(m.version)
    return done


async def migrate(url: str, *, connect_timeout: int = 10) -> list[int]:
    """``mcpbg migrate``: bring the database at ``url`` to this package's schema."""
    check_postgres_url(url, "--postgres")
    try:
        async with await psycopg.AsyncConnection.connect(
            url, autocommit=True, connect_timeout=max(2, connect_timeout)
        ) as conn:
            return await migrate_connection(conn)
    except psycopg.OperationalError as exc:
        raise BackendUnavailableError(f"postgres {redact(url)} unreachable: {exc}") from exc
