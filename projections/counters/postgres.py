"""Postgres counters: the shared read model, driven only through the functions in ``sql/``.

Each operation is one SQL function call, one round trip. Checks go through
``mcpbg_charge_many``: concurrent checks of one process are coalesced into one
call over arrays (one transaction, one commit, each check its own decision in
arrival order), at most ``max_connections`` calls in flight; a lone check goes
at once, alone. Calls lock the counters they touch in one fixed order
(sql/0002_functions.sql says how), so concurrent checks never over-admit and
never deadlock. The schema is versioned: the migrations in ``sql/`` are applied
on first use (and by ``mcpbg migrate``), each once, under a lock, so replicas
starting together agree.

The driver is psycopg 3 (async) with psycopg-pool: it is typed (mypy --strict
needs no stubs), speaks libpq's URLs and environment (``sslmode``, service
files, ``PGPASSWORD``) exactly as ``psql`` does, and the pool replaces dead
connections in the background, so a restarted server is picked up without a
restart of ours.

Busy is not down (docs/postgres.md). A live server that is slow to hand out a
connection or a lock is overloaded: the call raises :class:`BackendBusyError`
(the governor refuses with 503 ``budget_unavailable:postgres busy``, no fail
mode, nothing charged). Busy means: no pooled connection within
``queue_timeout`` while the server accepts connections; SQLSTATE 57014 (the
server's ``statement_timeout``, which is ``timeout``: lock waits count), 55P03
(lock not available) and class 53 (insufficient resources, 53300 too many
connections). Down means: a refused connection, a dead socket (no SQLSTATE),
class 08 (connection exception), 57P01-57P03 (shutdown, crash, starting up), or
no reply ``timeout`` + 1 s after the call was sent; only those raise
:class:`BackendUnavailableError`, so the governor applies each limit's fail
mode. A charge whose reply came too late carries its operation id, so its
replay counts once (as on Redis).

>>> backend = PostgresBackend.from_url("postgresql://postgres@127.0.0.1:5432/test")
>>> backend.timeout, backend.max_connections, backend.queue_timeout
(2.0, 5, 5.0)
>>> replicas_allowed(100, 3, 5)
19
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg import generators, pq
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from mcp_budget_governor.caps import PLANS_KEY, Change, why_token
from mcp_budget_governor.counters import (
    AppliedEvent,
    Charge,
    ChargeResult,
    CounterOp,
    CounterState,
    overflow,
    refused_event,
)
from mcp_budget_governor.errors import (
    BackendBusyError,
    BackendUnavailableError,
    EpochMissingError,
    InvalidInputError,
)
from mcp_budget_governor.keys import EPOCH_VALUE, INTERNAL_PREFIX, LEASE_PREFIX
from mcp_budget_governor.sql import latest, migrations
from mcp_budget_governor.urls import check_postgres_url, redact

log = logging.getLogger(__name__)

# The defaults (docs/postgres.md): a live server may take ``timeout`` on a check
# (its statement_timeout, lock waits included) before the check counts as busy; a
# check waits ``queue_timeout`` at most for a pooled connection; five connections
# per replica (coalesced checks need few) let 19 replicas share Postgres' default
# max_connections of 100.
DEFAULT_TIMEOUT = 2.0
DEFAULT_QUEUE_TIMEOUT = 5.0
DEFAULT_MAX_CONNECTIONS = 5
# No reply this long after the server's own bound: the socket or the server is gone.
REPLY_GRACE = 1.0

_T = TypeVar("_T")

# The most checks one coalesced call carries (the rest go in the next call).
MAX_BATCH = 256
_ADMITTED = ChargeResult(-1, ())
# The advisory lock migrations take (another class than the counters' locks).
_MIGRATION_LOCK = 1835233379
# SQLSTATEs of a live server that is overloaded (busy), not gone: the statement
# timeout, a lock timeout; class 53 (insufficient resources: 53300 too many
# connections, out of memory, disk full) is busy too.
_BUSY_STATES = frozenset({"57014", "55P03"})
# SQLSTATEs that mean the server is going or gone (with class 08 and no SQLSTATE).
_DOWN_STATES = frozenset({"57P01", "57P02", "57P03"})

_CHARGE = (
    "SELECT mcpbg_charge(%s, %s, %s, %s, %s::text[], %s::bigint[], %s::bigint[], "
    "%s::boolean[], %s::float8[], %s, %s::boolean[], %s::text[], %s::text[], %s::bigint[], "
    "%s::text[], %s::text[], %s::text[], %s, %s, %s)"
)
_CHARGE_MANY = (
    "SELECT * FROM mcpbg_charge_many(%s, %s::text[], %s::text[], %s::boolean[], "
    "%s::boolean[], %s::int[], %s::text[], %s::bigint[], %s::bigint[], %s::boolean[], "
    "%s::float8[], %s::boolean[], %s::text[], %s::text[], %s::bigint[], %s::text[], "
    "%s::text[], %s::text[])"
)
# _CHARGE_MANY as a statement prepared once per pooled connection (the hot path's):
# the same call with libpq's $n placeholders.
_CHARGE_MANY_NAME = b"mcpbg_charge_many_hot"
_CHARGE_MANY_SQL = _CHARGE_MANY
for _n in range(1, _CHARGE_MANY.count("%s") + 1):
    _CHARGE_MANY_SQL = _CHARGE_MANY_SQL.replace("%s", f"${_n}", 1)
del _n
_PREPARE_HOT = f"PREPARE {_CHARGE_MANY_NAME.decode()} AS {_CHARGE_MANY_SQL}"

_APPLY = (
    "SELECT mcpbg_apply_spent(%s::text[], %s::text[], %s::text[], %s, %s, %s, %s::bigint[], "
    "%s::text[], %s::text[], %s::float8[], "
    "%s::int[], %s::int[], %s::text[], %s::bigint[], %s::float8[], %s::text[], %s::text[], "
    "%s::text[], %s::bigint[], %s::bigint[], %s::text[], %s::text[])"
)


def replicas_allowed(max_connections: int, reserved: int, pool: int) -> int:
    """How many replicas with ``pool`` connections each fit in a server's
    ``max_connections`` less its ``superuser_reserved_connections``.

    >>> replicas_allowed(100, 3, 5), replicas_allowed(100, 3, 32)
    (19, 3)
    """
    return max(0, max_connections - reserved) // max(1, pool)


def _quoted(text: str) -> str:
    if '"' in text or "\\" in text:
        text = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _succeeded(
    conn: psycopg.AsyncConnection[Any], results: list[pq.abc.PGresult]
) -> pq.abc.PGresult:
    """The last of ``results``, or the error it reports (a psycopg error class, as an
    execute would raise it: a cancelled statement is QueryCanceled)."""
    result = results[-1]
    if result.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
        raise pg_errors.error_from_result(result, encoding=conn.info.encoding)
    return result


def _bigints(value: bytes | None) -> list[int]:
    """A bigint[] in Postgres' text form, read.

    >>> _bigints(b"{-2,1}"), _bigints(b"{}")
    ([-2, 1], [])
    """
    if not value or value == b"{}":
        return []
    return [int(v) for v in value[1:-1].split(b",")]


def texts(values: Iterable[str]) -> str:
    """A text[] literal, every element quoted.

    >>> texts(["a:b,c", 'say "hi"', ""])
    '{"a:b,c","say \\\\"hi\\\\"",""}'
    """
    return "{" + ",".join(map(_quoted, values)) + "}"


def numbers(values: Iterable[int | float | None]) -> str:
    """A bigint[] or float8[] literal (None: NULL).

    >>> numbers([1, -2, None, 1.5e+20, float("inf")])
    '{1,-2,NULL,1.5e+20,inf}'
    """
    return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"


def flags(values: Iterable[bool]) -> str:
    """A boolean[] literal.

    >>> flags([True, False])
    '{t,f}'
    """
    return "{" + ",".join("t" if v else "f" for v in values) + "}"


#: How mcpbg_charge_many's per-op arrays (:func:`op_columns`, in order) are written
#: as array literals.
_OP_LITERALS: tuple[Callable[[Iterable[Any]], str], ...] = (
    texts, numbers, numbers, flags, numbers, flags, texts, texts, numbers, texts, texts, texts,
)  # fmt: skip


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_busy(exc: BaseException) -> bool:
    """Whether ``exc`` is a live server saying it is overloaded (see the module docstring).

    >>> is_busy(pg_errors.QueryCanceled("canceling statement due to statement timeout"))
    True
    >>> is_busy(psycopg.OperationalError("server closed the connection unexpectedly"))
    False
    """
    state = getattr(exc, "sqlstate", None) or ""
    return state in _BUSY_STATES or state.startswith("53")


def is_down(exc: BaseException) -> bool:
    """Whether ``exc`` means the server cannot be reached (see the module docstring).

    >>> is_down(psycopg.OperationalError("connection refused")), is_down(TimeoutError())
    (True, True)
    >>> is_down(pg_errors.UndefinedFunction("no such function"))
    False
    """
    if is_busy(exc):
        return False
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate or ""
        if state:
            return state.startswith("08") or state in _DOWN_STATES
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)  # the socket
    return isinstance(exc, TimeoutError | OSError)


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


def op_columns(ops: Sequence[CounterOp]) -> tuple[list[Any], ...]:
    """The per-op arrays both SQL charge functions take, in their order: keys,
    amounts, caps, enforce, expire_at, has_ref, caps_key, field, value_cap,
    plan_fields, plan_caps, file_plan (one home: ``mcpbg_charge`` gets them as lists,
    ``mcpbg_charge_many`` as array literals)."""
    refs = [op.ref for op in ops]
    return (
        [op.key for op in ops],
        [op.amount for op in ops],
        [op.cap for op in ops],
        [op.enforce for op in ops],
        [op.expire_at for op in ops],
        [r is not None for r in refs],
        [PLANS_KEY if r is None else r.caps_key for r in refs],
        ["" if r is None else r.field for r in refs],
        [None if r is None else r.value_cap for r in refs],
        ["" if r is None else ",".join(r.plan_fields) for r in refs],
        ["" if r is None else " ".join(f"{n} {cap}" for n, cap in r.plan_caps) for r in refs],
        ["" if r is None else r.file_plan or "" for r in refs],
    )


def charge_params(
    c: Charge, *, require_epoch: bool, leases: bool | None = None, resolve: bool | None = None
) -> tuple[Any, ...]:
    """The arguments of one ``mcpbg_charge`` call (:data:`_CHARGE`), as every client
    passes them: the conformance vectors hold the TypeScript backend's to these.
    ``leases`` (whether the charge takes leases) and ``resolve`` (whether a counter
    has a run-time cap to look up): when the caller has found out."""
    ops = c.ops
    if leases is None:
        leases = any(op.key.startswith(LEASE_PREFIX) for op in ops)
    if resolve is None:
        resolve = any(op.ref is not None for op in ops)
    columns = op_columns(ops)
    return (
        c.event_id or "",
        c.inline_op or "",
        c.want_used,
        require_epoch,
        *columns[:5],
        resolve,
        *columns[5:],
        c.lease_id(leases),
        c.lease_ttl_ms,
        c.ticket or "" if leases else "",
    )


# A charge that refuses (cap 0) on a key no counter has: it writes nothing.
_WARM_PARAMS = (
    "", "", True, False, ["mcpbg:v1:_warm:-:-"], [1], [0], [True], [0.0], True, [True],
    [PLANS_KEY], ["-"], [None], [""], [""], [""], "", 1, "",
)  # fmt: skip
# The same through the coalesced function: one check of one op.
_WARM_MANY = (
    False, [""], [""], [True], [True], [1], ["mcpbg:v1:_warm:-:-"], [1], [0], [True], [0.0],
    [True], [PLANS_KEY], [""], [None], [""], [""], [""],
)  # fmt: skip


async def _warm(conn: psycopg.AsyncConnection[Any]) -> None:
    """Run each new pooled connection's first charges before a caller gets it: Postgres
    compiles a PL/pgSQL function once per session, which would otherwise cost the
    first check on every connection several round trips' time."""
    # Not migrated yet (a new database): the first use migrates, then warms.
    with contextlib.suppress(pg_errors.UndefinedFunction, pg_errors.UndefinedTable):
        await conn.execute(_CHARGE, _WARM_PARAMS)
        await conn.execute(_CHARGE_MANY, _WARM_MANY)


@dataclass(slots=True, eq=False)
class _Check:
    """One check waiting for (or in) a coalesced call."""

    event_id: str
    op_id: str
    want_used: bool
    resolve: bool
    ops: Sequence[CounterOp]
    future: asyncio.Future[list[int]]
    since: float


class _Coalescer:
    """The checks of one event loop: a lone check goes at once; checks arriving while
    ``slots`` calls are in flight (or in the same loop turn) wait here, in order, and
    go together in the next call. A check that waits here longer than the queue bound
    is refused as busy (it was never sent: nothing is charged)."""

    def __init__(self, backend: PostgresBackend, loop: asyncio.AbstractEventLoop) -> None:
        self.backend = backend
        self.loop = loop
        self.queue: deque[_Check] = deque()
        self.in_flight = 0
        self.scheduled = False
        self.watch: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def charge(self, c: Charge, resolve: bool) -> list[int]:
        future: asyncio.Future[list[int]] = self.loop.create_future()
        check = _Check(c.event_id or "", c.inline_op or "", c.want_used, resolve, c.ops, future,
                       self.loop.time())  # fmt: skip
        if not self.in_flight and not self.queue:  # alone: no task, no wait
            self.in_flight += 1
            try:
                return (await self.backend.charge_many([check]))[0]
            finally:
                self.in_flight -= 1
                self.kick()
        self.queue.append(check)
        self.kick()
        return await future

    def kick(self) -> None:
        if self.queue and not self.scheduled and self.in_flight < self.backend.max_connections:
            self.scheduled = True
            self.loop.call_soon(self.flush)
        elif self.queue and self.watch is None:
            self.watch = self.loop.call_later(0.1, self.expire)

    def flush(self) -> None:
        self.scheduled = False
        while self.queue and self.in_flight < self.backend.max_connections:
            batch: list[_Check] = []
            while self.queue and len(batch) < MAX_BATCH:
                check = self.queue.popleft()
                if not check.future.done():  # (its caller gave up while it waited)
                    batch.append(check)
            if batch:
                self.in_flight += 1
                task = self.loop.create_task(self.send(batch))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        if self.queue and self.watch is None:
            self.watch = self.loop.call_later(0.1, self.expire)

    async def send(self, batch: list[_Check]) -> None:
        try:
            replies = await self.backend.charge_many(batch)
        except asyncio.CancelledError:
            for check in batch:
                check.future.cancel()
            raise
        except Exception as exc:
            for check in batch:
                if not check.future.done():
                    check.future.set_exception(exc)
        else:
            for check, reply in zip(batch, replies, strict=True):
                if not check.future.done():
                    check.future.set_result(reply)
        finally:
            self.in_flight -= 1
            self.kick()

    def expire(self) -> None:
        """Refuse, as busy, the checks that waited here past the queue bound."""
        self.watch = None
        bound = self.backend.queue_timeout
        end = self.loop.time() - bound
        while self.queue and self.queue[0].since <= end:
            check = self.queue.popleft()
            if not check.future.done():
                check.future.set_exception(
                    BackendBusyError("postgres", f"{self.backend.max_connections} calls "
                                     f"in flight for {bound:g}s; this check was not sent")
                )  # fmt: skip
        if self.queue:
            self.watch = self.loop.call_later(0.1, self.expire)


class PostgresBackend:
    """Counters in Postgres, shared by every replica (see the module docstring)."""

    #: One charge may admit a call and charge its fixed price under two event ids
    #: (counters.with_cost; sql/0010_priced_admission.sql): Governor.admitted(price=)
    #: then takes one round trip.
    prices_at_admission = True

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
        require_epoch: bool = False,
        durable: bool = True,
    ) -> None:
        self.url = url
        self.durable = durable
        self.timeout = timeout
        self.queue_timeout = queue_timeout
        self.max_connections = max(1, max_connections)
        self.require_epoch = require_epoch
        # The server's bound on every statement of the pool (the hot path's): past it a
        # live server cancels the call (SQLSTATE 57014, busy) and nothing is written.
        # Batch work (apply, rewrite, migrations, reads) lifts it (see _long).
        options = f"-c statement_timeout={max(1, round(timeout * 1000))}"
        if not durable:
            options += " -c synchronous_commit=off"
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=self.max_connections,
            open=False,
            timeout=queue_timeout,
            kwargs={
                "autocommit": True,
                "connect_timeout": max(2, round(timeout + 0.5)),
                "options": options,
            },
            reconnect_timeout=0,  # keep trying while the server is away
            name="mcpbg",
            configure=self._configure,
        )
        self._opened = False
        self._migrated = False
        self._open_lock = asyncio.Lock()
        self._checking: asyncio.Task[None] | None = None
        self._coalescer: _Coalescer | None = None
        self._probe: asyncio.Task[bool] | None = None
        self._probed_at = -1.0
        # Per ops tuple, its per-op array elements (charge_many): see _op_elements.
        self._elements: dict[int, tuple[Sequence[CounterOp], tuple[str, ...]]] = {}
        # The pooled connections _CHARGE_MANY_NAME is prepared on (_charge_call).
        self._prepared_on: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        queue_timeout: float = DEFAULT_QUEUE_TIMEOUT,
        require_epoch: bool = False,
        durable: bool = True,
    ) -> PostgresBackend:
        """Connect lazily to ``url``.

        ``timeout`` (seconds, default 2): the longest a live server may take on
        one check, lock waits included (its ``statement_timeout``); past it the
        server cancels the call and the check is refused as busy. No reply at
        all ``timeout`` + 1 s after sending: the server is unreachable (fail
        modes). ``max_connections`` (default 5): this replica's pool, and the
        most coalesced calls in flight; at startup the log says how many
        replicas of this size the server's ``max_connections`` allows.
        ``queue_timeout`` (default 5): the longest a check waits in this process
        for a connection before it is refused as busy. docs/postgres.md says
        what to tune first.

        ``require_epoch=True`` (deployments with a ledger and a stream worker):
        until the worker has declared the counters complete, every charge
        counts as the store being unreachable, so nothing is admitted from
        counters that are not yet rebuilt.

        ``durable=False`` commits without waiting for the WAL flush
        (``synchronous_commit=off``): a check no longer waits for the disk,
        most of its time where the flush is slow (docs/postgres.md), and a
        crash of Postgres (not of this process) may lose the last fraction of
        a second of charges, whole transactions only, never half of one. With
        a ledger that is safe: the projection's watermark is lost with them,
        so the worker re-applies those events.
        Without a ledger the lost charges are not counted: keep the default.
        """
        check_postgres_url(url, "url")
        for name, value in (("timeout", timeout), ("queue_timeout", queue_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise InvalidInputError(name, value, "expected a number of seconds above 0")
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or (max_connections < 1)
        ):
            raise InvalidInputError("max_connections", max_connections, "expected an int >= 1")
        return cls(
            url,
            timeout=float(timeout),
            max_connections=max_connections,
            queue_timeout=float(queue_timeout),
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
        text = _first_line(exc)
        return BackendUnavailableError(f"postgres {redact(self.url)} unreachable: {text}")

    def _failed(self, exc: BaseException) -> BaseException:
        """What a failed call raises: busy, unreachable, or the error itself (a bug)."""
        if isinstance(exc, BackendBusyError | BackendUnavailableError):
            return exc
        if is_busy(exc):
            return BackendBusyError("postgres", _first_line(exc))
        if isinstance(exc, TimeoutError):
            return self._down(TimeoutError(f"no reply within {self.timeout + REPLY_GRACE:g}s"))
        if is_down(exc):
            return self._down(exc)
        if isinstance(exc, pg_errors.RaiseException):
            return ValueError(_first_line(exc))
        return exc

    async def _check_pool(self) -> None:
        # Replaces the idle connections a server restart broke, so they fail no more calls.
        with contextlib.suppress(Exception):
            await self._pool.check()

    async def _reachable(self) -> bool:
        """Whether the server accepts a connection now (too many clients counts: it is
        alive); one probe at a time, its answer kept for half a second."""
        loop = asyncio.get_running_loop()
        probe = self._probe
        if (
            probe is None
            or probe.get_loop() is not loop  # (a probe of an earlier asyncio.run)
            or (probe.done() and loop.time() - self._probed_at > 0.5)
        ):
            self._probed_at = loop.time()
            probe = self._probe = loop.create_task(self._connects())
        return await asyncio.shield(probe)

    async def _connects(self) -> bool:
        try:
            conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, connect_timeout=max(2, round(self.timeout + 0.5))
            )
        except psycopg.Error as exc:
            return is_busy(exc)
        await conn.close()
        return True

    async def _connection(self, deadline: float) -> psycopg.AsyncConnection[Any]:
        """A pooled connection by ``deadline`` (loop time): waiting past it while the
        server accepts connections is busy; a server refusing them is down."""
        loop = asyncio.get_running_loop()
        while True:
            wait = deadline - loop.time()
            if wait <= 0:
                raise BackendBusyError(
                    "postgres", f"no pooled connection free within {self.queue_timeout:g}s"
                )
            try:
                return await self._pool.getconn(timeout=min(wait, 0.5))
            except PoolTimeout:
                stats = self._pool.get_stats()
                if stats.get("pool_size", 0) >= self.max_connections:
                    continue  # every connection is in use: the pool is busy
                if not await self._reachable():
                    raise self._down(ConnectionError("the server refuses connections")) from None

    async def _ensure(self) -> None:
        if self._migrated:
            return
        async with self._open_lock:
            if not self._opened:
                await self._pool.open(wait=False)
                self._opened = True
            if not self._migrated:
                deadline = asyncio.get_running_loop().time() + max(self.queue_timeout, 30.0)
                conn = await self._connection(deadline)
                try:
                    await migrate_connection(conn)
                    await self._configure(conn)
                    await self._log_capacity(conn)
                finally:
                    await self._pool.putconn(conn)
                self._migrated = True

    async def _log_capacity(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Say at startup how many replicas of this pool size the server allows."""
        cur = await conn.execute(
            "SELECT current_setting('max_connections')::int, "
            "current_setting('superuser_reserved_connections')::int, "
            "(SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
        )
        row = await cur.fetchone()
        if row is None:  # pragma: no cover - the query always returns a row
            return
        most, reserved, in_use = (int(v) for v in row)
        fit = replicas_allowed(most, reserved, self.max_connections)
        say = log.warning if fit < 2 else log.info
        say(
            "postgres %s: max_connections=%d (%d reserved), %d in use now; a pool of %d "
            "per replica lets %d replicas share it (docs/postgres.md)",
            redact(self.url), most, reserved, in_use, self.max_connections, fit,
        )  # fmt: skip

    async def _run(
        self, query: str, params: Sequence[Any], *, fetch: str = "one", long: float = 0.0
    ) -> Any:
        """One statement through a pooled connection: its first value (``fetch="one"``)
        or its rows. ``long`` (seconds): batch work, the server's statement bound lifted
        to it."""

        async def statement(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
            if not long:
                return await (await conn.execute(query, params)).fetchall()
            async with conn.transaction():
                await conn.execute(
                    "SELECT set_config('statement_timeout', %s, true)", (str(round(long * 1000)),)
                )
                return await (await conn.execute(query, params)).fetchall()

        rows = await self._on_connection(statement, long)
        if fetch == "one":
            return rows[0][0] if rows else None
        return rows

    async def _on_connection(
        self, step: Callable[[psycopg.AsyncConnection[Any]], Awaitable[_T]], long: float = 0.0
    ) -> _T:
        """``step`` on a pooled connection: the round trip bounded from the moment it is
        sent (the pool's queue has its own bound), ``long`` seconds for batch work, and
        any failure raised as the backend's busy or unavailable error (:meth:`_failed`)."""
        loop = asyncio.get_running_loop()
        try:
            if not self._migrated:
                await self._ensure()
            conn = await self._connection(loop.time() + max(self.queue_timeout, long))
            try:
                async with asyncio.timeout(max(long, self.timeout) + REPLY_GRACE):
                    return await step(conn)
            finally:
                await self._pool.putconn(conn)
        except Exception as exc:
            failed = self._failed(exc)
            if failed is exc:
                raise
            raise failed from exc

    async def _call(self, query: str, params: Sequence[Any]) -> Any:
        """One statement's first value, bounded as a check is."""
        return await self._run(query, params)

    async def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = await self._run(query, params, fetch="all", long=5.0)
        return rows

    async def _call_long(self, query: str, params: Sequence[Any]) -> Any:
        """:meth:`_call` for batch work (apply, rewrite): a longer bound than the hot path's."""
        return await self._run(query, params, long=max(self.timeout, 30.0))

    async def migrate(self) -> int:
        """Apply every pending migration now; the schema version afterwards."""
        try:
            await self._ensure()
        except Exception as exc:
            failed = self._failed(exc)
            if failed is exc:
                raise
            raise failed from exc
        return latest()

    # -- the hot path -------------------------------------------------------

    async def charge_many(self, checks: Sequence[_Check]) -> list[list[int]]:
        """One ``mcpbg_charge_many`` call for ``checks``: each one's reply, in order.

        The arrays go as array literals built here (:func:`texts`, :func:`numbers`):
        psycopg's per-element dumping of 17 lists cost more than the round trip."""
        if len(checks) == 1:
            check = checks[0]
            head: tuple[Any, ...] = (
                "{" + _quoted(check.event_id) + "}", "{" + _quoted(check.op_id) + "}",
                "{t}" if check.want_used else "{f}", "{t}" if check.resolve else "{f}",
                f"{{{len(check.ops)}}}",
            )  # fmt: skip
            per_op = ["{" + e + "}" for e in self._op_elements(check.ops)]
        else:
            head = (
                texts(c.event_id for c in checks), texts(c.op_id for c in checks),
                flags(c.want_used for c in checks), flags(c.resolve for c in checks),
                numbers(len(c.ops) for c in checks),
            )  # fmt: skip
            each = [self._op_elements(c.ops) for c in checks if c.ops]
            per_op = ["{" + ",".join(column) + "}" for column in zip(*each, strict=True)]
            if not each:
                per_op = ["{}"] * len(_OP_LITERALS)
        return await self._charge_call((self.require_epoch, *head, *per_op))

    async def _charge_call(self, params: Sequence[str | bool]) -> list[list[int]]:
        """:data:`_CHARGE_MANY` with ``params``, bounded and mapped as :meth:`_run` does
        a call, through libpq directly: a statement prepared once per connection, the
        parameters sent as the text they already are, the rows read as text. psycopg's
        execute (a cursor, the query's conversion, every parameter's dump, the rows'
        load) took more time here than the rest of the check's Python."""
        values = [(b"t" if p else b"f") if isinstance(p, bool) else p.encode() for p in params]

        async def prepared(conn: psycopg.AsyncConnection[Any]) -> pq.abc.PGresult:
            if conn not in self._prepared_on:  # made before the schema was (a new database)
                await self._configure(conn)
            pgconn = conn.pgconn
            pgconn.send_query_prepared(_CHARGE_MANY_NAME, values)
            return _succeeded(conn, await conn.wait(generators.execute(pgconn)))

        result = await self._on_connection(prepared)
        return [_bigints(result.get_value(i, 0)) for i in range(result.ntuples)]

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Ready a new pooled connection before a caller gets it (the pool's
        ``configure``): warm its functions and prepare the hot path's statement, so
        that a check on it is one round trip, never a prepare's and then its own."""
        await _warm(conn)
        if conn in self._prepared_on:
            return
        # Not migrated yet (a new database): _ensure configures its connection again.
        with contextlib.suppress(pg_errors.UndefinedFunction, pg_errors.UndefinedTable):
            await conn.execute(_PREPARE_HOT)
            self._prepared_on.add(conn)

    def _op_elements(self, ops: Sequence[CounterOp]) -> tuple[str, ...]:
        """The elements of each per-op array of ``mcpbg_charge_many`` for ``ops`` (an
        array literal's inside, in :func:`op_columns` order), made once per ops tuple:
        the governor reuses one per context and minute (keyed by identity and checked
        with ``is``, as ``RedisScripts._prepare`` caches a charge's arguments)."""
        hit = self._elements.get(id(ops))
        if hit is not None and hit[0] is ops:
            return hit[1]
        elements = tuple(
            write(column)[1:-1] for write, column in zip(_OP_LITERALS, op_columns(ops), strict=True)
        )
        if len(self._elements) >= 8192:
            self._elements.clear()
        self._elements[id(ops)] = (ops, elements)
        return elements

    def _batcher(self) -> _Coalescer:
        """This event loop's coalescer (a new one on another loop)."""
        loop = asyncio.get_running_loop()
        co = self._coalescer
        if co is None or co.loop is not loop:
            co = self._coalescer = _Coalescer(self, loop)
        return co

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
        c = Charge(ops, event_id, want_used, op_id, lease, lease_ttl, ticket)
        resolve = any(op.ref is not None for op in ops)
        if any(op.key.startswith(LEASE_PREFIX) for op in ops):  # leases: mcpbg_charge, alone
            reply: list[int] = await self._call(
                _CHARGE,
                charge_params(c, require_epoch=self.require_epoch, leases=True, resolve=resolve),
            )
        else:
            reply = await self._batcher().charge(c, resolve)
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
        roles, held = [], []  # each event's reservation role (sql/0007, counters.Holds)
        spent = []  # each event's spent approvals (sql/0008)
        for event in events:
            spent.append(",".join(f"{once}:{int(until)}" for once, until in event.spent))
            roles.append("o" if event.opens else "-" if event.closes is None else "c")
            held.append(event.closes or "")
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
            spent, roles, held, partition, require_epoch, through, offsets, ids, days, day_expire,
            ncharges, nchanges, ckeys, camounts, cexpire, kinds, xkeys, xfields, xamounts, xuntils,
            xplans, xwhys,
        )  # fmt: skip
        try:
            applied = int(await self._call_long(_APPLY, params))
        except ValueError as exc:
            refused = refused_event(str(exc))
            if refused is not None:  # the call rolled back: nothing of the batch written
                raise refused from None
            raise
        if applied < 0:
            raise EpochMissingError("postgres counters not complete (no epoch): rebuild first")
        return applied

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
        # DDL is batch work: not bound by the hot path's statement_timeout.
        await conn.execute("SET LOCAL statement_timeout = 0")
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
