"""Postgres side of ``mcpbg replay`` and ``reconcile``: one snapshot, one rewrite transaction.

:meth:`PostgresStore.snapshot` reads every live counter with its in-flight
entries, the watermarks and the server clock in one ``REPEATABLE READ``
transaction: the same cut the Redis path takes with ``MULTI``, since a
projection's apply commits counters and watermark together. :meth:`rewrite`
stages the counters, the in-flight entries to drop and the seen ids with
``COPY`` and writes them with ``mcpbg_rewrite_staged`` (sql/0003_replay.sql)
under the store lock, with the watermarks, the run-time changes and the epoch
marker, in one transaction: nobody sees half-rebuilt counters.
:meth:`run_time` reads the run-time tables (caps, plans, grants) with the
watermarks and the clock the same way, for ``reconcile`` (:mod:`.changes_sync`).

>>> store = PostgresStore.connect("redis://localhost:6379/0")
Traceback (most recent call last):
...
mcp_budget_governor.errors.InvalidInputError: --postgres: expected \
postgresql://user@host:port/database (got 'redis://localhost:6379/0')
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from mcp_budget_governor.caps import Change, ChangeKind
from mcp_budget_governor.errors import BackendUnavailableError, GovernorError
from mcp_budget_governor.keys import INTERNAL_PREFIX
from mcp_budget_governor.sql import latest
from mcp_budget_governor.urls import check_postgres_url, redact

from .postgres import CHANGE_SQL, change_params, like_pattern
from .sync import ConcurrentProjectionError, RedisCounter, Snapshot

__all__ = ["PostgresStore", "RunTime"]


@dataclass(frozen=True, slots=True)
class RunTime:
    """The run-time tables as :meth:`PostgresStore.run_time` read them."""

    now: int
    watermarks: dict[str, int]
    caps: dict[str, dict[str, tuple[int, int, str]]]  # caps key -> field -> (cap, until, why)
    plans: dict[str, str]
    grants: dict[str, str | None]  # counter key -> its grant (None: none)


#: Run-time changes per ``mcpbg_change`` call (one statement each, same transaction).
_CHANGES_PER_CALL = 1000


class PostgresStore:
    """A synchronous connection to the counters' Postgres, for the operator commands."""

    def __init__(self, conn: psycopg.Connection[Any], url: str) -> None:
        self.conn = conn
        self.url = url

    @classmethod
    def connect(cls, url: str, *, field: str = "--postgres", timeout: int = 5) -> PostgresStore:
        """Connect and check the schema; a bad URL, an unreachable server or an unmigrated
        database is one line naming it."""
        check_postgres_url(url, field)
        try:
            conn = psycopg.connect(url, autocommit=True, connect_timeout=max(1, timeout))
        except psycopg.Error as exc:
            raise _down(url, exc) from None
        store = cls(conn, url)
        try:
            store._check_schema()
        except BaseException:
            conn.close()
            raise
        return store

    def _check_schema(self) -> None:
        need = f"run mcpbg migrate --postgres {redact(self.url)}"
        try:
            row = self.conn.execute("SELECT max(version) FROM mcpbg_migrations").fetchone()
        except pg_errors.UndefinedTable:
            raise GovernorError(
                f"postgres {redact(self.url)}: no mcpbg tables (not migrated): {need}"
            ) from None
        except psycopg.Error as exc:
            raise _down(self.url, exc) from None
        have = int(row[0]) if row and row[0] is not None else 0
        if have < latest():
            raise GovernorError(
                f"postgres {redact(self.url)}: schema version {have}, this mcpbg needs "
                f"{latest()}: {need}"
            )

    def close(self) -> None:
        self.conn.close()

    # -- reads --------------------------------------------------------------

    @contextlib.contextmanager
    def _one_instant(self) -> Iterator[tuple[float, dict[str, int]]]:
        """A read-only REPEATABLE READ transaction: the clock and the watermarks, then
        what the caller reads in the body, all at one instant (a connection lost on
        the way is one ``BackendUnavailableError``)."""
        try:
            with self.conn.transaction():
                self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                row = self.conn.execute("SELECT mcpbg_now()").fetchone()
                assert row is not None
                marks = self.conn.execute("SELECT partition, applied FROM mcpbg_watermark")
                yield float(row[0]), {p: int(a) for p, a in marks}
        except psycopg.OperationalError as exc:
            raise _down(self.url, exc) from None

    def snapshot(self, keys: Iterable[str] = ()) -> Snapshot:
        """Every live counter (and ``keys``, empty when absent), the watermarks and the
        clock, read at one instant."""
        internal = like_pattern(INTERNAL_PREFIX) + "%"
        with self._one_instant() as (now, marks):
            rows = self.conn.execute(
                "SELECT key, committed, in_flight, expire_at FROM mcpbg_counter "
                "WHERE expire_at > %s AND key NOT LIKE %s",
                (now, internal),
            ).fetchall()
            pending = self.conn.execute(
                "SELECT p.key, p.event_id, p.amount FROM mcpbg_pending p "
                "JOIN mcpbg_counter c USING (key) WHERE c.expire_at > %s",
                (now,),
            ).fetchall()
        counters: dict[str, RedisCounter] = {}
        for key, committed, in_flight, expire_at in rows:
            ttl = -1 if math.isinf(expire_at) else max(1, int(expire_at - now))
            counters[key] = RedisCounter(int(committed), int(in_flight), {}, ttl)
        for key, event_id, amount in pending:
            if key in counters:
                counters[key].pending[event_id] = int(amount)
        for key in keys:
            counters.setdefault(key, RedisCounter())
        return Snapshot(int(now), marks, counters)

    def run_time(self, keys: Iterable[str]) -> RunTime:
        """The clock, the watermarks, every run-time value cap and plan assignment, and
        the grant of each live counter of ``keys`` (None: none), read at one instant:
        what ``reconcile`` compares (:mod:`.changes_sync`)."""
        wanted = sorted(set(keys))
        with self._one_instant() as (now, marks):
            cap_rows = self.conn.execute(
                "SELECT caps_key, field, cap, until, why FROM mcpbg_cap"
            ).fetchall()
            plans = dict(self.conn.execute("SELECT field, plan FROM mcpbg_plan"))
            # A counter never granted (why NULL, grant 0) holds no grant, as a hash
            # without its grant field; an ended one is absent.
            grant_rows = self.conn.execute(
                "SELECT key, grant_amount, why FROM mcpbg_counter "
                "WHERE key = ANY(%s) AND expire_at > %s",
                (wanted, now),
            ).fetchall()
        caps: dict[str, dict[str, tuple[int, int, str]]] = {}
        for key, fld, cap, until, why in cap_rows:
            caps.setdefault(key, {})[fld] = (int(cap), int(until), why)
        grants: dict[str, str | None] = dict.fromkeys(wanted)
        for key, grant, why in grant_rows:
            if why is not None or grant:
                grants[key] = str(int(grant))
        return RunTime(int(now), marks, caps, plans, grants)

    # -- the one write ------------------------------------------------------

    def rewrite(
        self,
        counters: Sequence[tuple[str, int, int]],
        *,
        add: bool = False,
        expected: Mapping[str, int] | None = None,
        drop: Mapping[str, Sequence[str]] | None = None,
        seen: Mapping[str, tuple[Sequence[str], int]] | None = None,
        marks: Mapping[str, int] | None = None,
        changes: Sequence[Change] = (),
        epoch: str = "",
        progress: Callable[[str, int, int | None], None] | None = None,
    ) -> int:
        """In one transaction: set (``add``: correct) ``counters`` (``(key, amount,
        expire_at (0: keep))``), drop the in-flight ids ``drop``, add the ``seen`` ids
        (``day -> (ids, expire_at)``), set ``marks``, apply ``changes`` in order (the
        grants and resets they touch start from none) and set ``epoch``. Refused with
        :class:`ConcurrentProjectionError`, nothing written, when the watermarks are not
        ``expected`` any more."""
        report = progress or (lambda phase, done, total: None)
        seen = seen or {}
        drops = drop or {}
        total_seen = sum(len(ids) for ids, _ in seen.values())
        try:
            with self.conn.transaction(), self.conn.cursor() as cur:
                cur.execute("SELECT mcpbg_stage()")
                # Staged before the store lock: the lock is held only for the set-based write.
                with cur.copy(
                    "COPY mcpbg_stage_counter (key, amount, expire_at) FROM STDIN"
                ) as copy:
                    for n, counter in enumerate(counters, 1):
                        copy.write_row(counter)
                        if n % 5000 == 0:
                            report("counters", n, len(counters))
                report("counters", len(counters), len(counters))
                with cur.copy("COPY mcpbg_stage_drop (key, event_id) FROM STDIN") as copy:
                    for key, ids in drops.items():
                        for event_id in set(ids):
                            copy.write_row((key, event_id))
                with cur.copy(
                    "COPY mcpbg_stage_seen (day, event_id, expire_at) FROM STDIN"
                ) as copy:
                    done = 0
                    for day, (ids, expire_at) in sorted(seen.items()):
                        for event_id in ids:
                            copy.write_row((day, event_id, expire_at))
                        done += len(ids)
                        report("seen", done, total_seen)
                cur.execute(
                    "SELECT mcpbg_rewrite_staged(%s, %s::jsonb, %s::jsonb, %s)",
                    (
                        "add" if add else "set",
                        None if expected is None else json.dumps(dict(expected)),
                        json.dumps(dict(marks or {})),
                        epoch,
                    ),
                )
                reply = cur.fetchone()
                written = -1 if reply is None else int(reply[0])
                if written < 0:
                    raise ConcurrentProjectionError(
                        "a projector applied events meanwhile (the watermarks moved): "
                        "stop the workers, then run this again"
                    )
                self._restore(cur, changes)
                report("commit", 0, 1)  # everything written, nothing visible yet
        except psycopg.OperationalError as exc:
            raise _down(self.url, exc) from None
        report("commit", 1, 1)
        return written

    @staticmethod
    def _restore(cur: psycopg.Cursor[Any], changes: Sequence[Change]) -> None:
        """Run-time changes in ledger order through ``mcpbg_change``, as the projection
        applies them; a grant adds to its counter's, so the grants of the counters they
        touch start again from none (a replay onto live counters counts none twice)."""
        room = sorted({c.key for c in changes if c.kind in (ChangeKind.GRANTED, ChangeKind.RESET)})
        if room:
            cur.execute(
                "UPDATE mcpbg_counter SET grant_amount = 0, why = NULL WHERE key = ANY(%s)",
                (room,),
            )
        for start in range(0, len(changes), _CHANGES_PER_CALL):
            cur.execute(CHANGE_SQL, change_params(changes[start : start + _CHANGES_PER_CALL]))


def _down(url: str, exc: BaseException) -> BackendUnavailableError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return BackendUnavailableError(f"postgres {redact(url)} unreachable: {text}")
