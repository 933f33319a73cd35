"""Redis counters: the shared read model, driven only through the scripts in ``lua/``.

Each operation is one EVALSHA; a node that answers NOSCRIPT (restarted,
failed over, or a fresh cluster node: script caches are per node) gets the
same call as EVAL, which also caches the script there. No script reads Redis'
clock: the caller passes its own (``clock``, last argument; docs/clocks.md).
Connection failures and timeouts become
:class:`BackendUnavailableError` so the governor can apply each limit's fail
mode; a short socket timeout bounds how long a call can wait.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from mcp_budget_governor.backends.base import KeyValueOps
from mcp_budget_governor.caps import CAPS_PREFIX, PLANS_KEY, Change, ChangeKind, why_token
from mcp_budget_governor.counters import (
    SECONDS_PER_DAY,
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
from mcp_budget_governor.keys import (
    EPOCH_KEY,
    EPOCH_VALUE,
    HOLD_PREFIX,
    LEASE_PREFIX,
    PREFIX,
    SEEN_PREFIX,
    SPENT_PREFIX,
    WATERMARK_KEY,
    op_key,
    queue_key,
    slides,
)
from mcp_budget_governor.lua import many_source, source
from mcp_budget_governor.shielding import Held

from .autopipe import Address, Batched, Part, Pipe, pack, pack_args

_UNAVAILABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    OSError,
)

DEFAULT_TIMEOUT = 0.25
_OP_KEY_HEAD = op_key("").encode()  # op_key(op_id) is this, then the id


async def close_best_effort(closing: Awaitable[None]) -> None:
    """Await a client's close; a connection that outlasts its close timeout is dropped.

    redis-py closes each pooled connection within ``socket_connect_timeout``: after a
    burst that filled a pool (a cluster node's 1,024 connections), some closes outlast
    it on a loaded machine, and the caller's shutdown would fail on sockets that are
    being let go either way.
    """
    try:
        await closing
    except redis_errors.TimeoutError as exc:
        logging.getLogger(__name__).debug("redis: a connection outlasted its close: %s", exc)


def redis_failure(exc: BaseException) -> BackendBusyError | BackendUnavailableError:
    """Busy is not down: a pool with no free connection within its wait (``coalesce=False``;
    the coalesced default has no pool queue) and a server at its ``maxclients`` are
    overload, refused as busy; every other error of ``_UNAVAILABLE`` is unreachable.

    >>> redis_failure(redis_errors.ConnectionError("No connection available."))
    BackendBusyError('redis busy: No connection available.')
    >>> str(redis_failure(redis_errors.ConnectionError("Connection refused")))
    'redis unreachable: Connection refused'
    """
    if isinstance(exc, redis_errors.MaxConnectionsError | redis_errors.MaxClientsReachedError) or (
        isinstance(exc, redis_errors.ConnectionError) and str(exc) == "No connection available."
    ):
        return BackendBusyError("redis", str(exc))
    return BackendUnavailableError.redis(exc)


_ADMITTED = ChargeResult(-1, ())


def _ref_arg(op: CounterOp) -> bytes:
    """The argument by which lua/charge.lua resolves ``op``'s effective cap: its scope
    field, then only when the policy has any, its value cap, plan, plan fields, plan caps."""
    ref = op.ref
    if ref is None:
        return b""
    if ref.value_cap is None and not ref.plan_caps:
        return ref.field.encode()
    parts = [
        ref.field,
        "-" if ref.value_cap is None else str(ref.value_cap),
        ref.file_plan or "-",
        ",".join(ref.plan_fields),
        " ".join(f"{name} {cap}" for name, cap in ref.plan_caps),
    ]
    return " ".join(parts).rstrip().encode()


#: Seconds before a Redis that refused charge_many.lua is asked for it again.
MANY_RETRY = 60.0


class _Script:
    """One script of ``lua/``: its source and SHA1 (what EVALSHA names)."""

    __slots__ = ("script", "sha")

    def __init__(self, script: str) -> None:
        self.script = script
        self.sha = hashlib.sha1(self.script.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class _Prepared:
    """One op list's charge.lua arguments: as values (EVAL, redis-py) and packed."""

    ops: object
    head: list[Any]  # numkeys, the epoch marker
    counters: list[Any]  # with an operation marker: the keys after it, else empty
    flags: bytes
    tail: list[Any]  # per counter its arguments
    leases: int  # lease sets (their queues close KEYS)
    head_b: bytes
    counters_b: bytes
    flags_b: bytes
    tail_b: bytes
    count: int  # elements of the packed command, without lease arguments
    keys_b: bytes  # head_b without numkeys: the keys before an operation marker


def caps_value(raw: str) -> tuple[int, int, str]:
    """A caps-hash value as lua/lib.lua's apply_change writes it, ``"<cap> <until> <why>"``,
    as ``(cap, until, why token)``.

    >>> caps_value("60 0 ops%0Atrial")
    (60, 0, 'ops%0Atrial')
    """
    cap, until, why = ([*raw.split(" "), "0", "-"])[:3]
    return int(cap), int(until), why


def change_tokens(changes: Sequence[Change], keys: list[str], index: dict[str, int]) -> str:
    """The changes as lua/lib.lua's apply_change reads them, their keys added to ``keys``."""
    out = []
    for c in changes:
        pos = _position(keys, index, c.key)
        out.append(
            f"{c.kind.value} {pos} {c.field or '-'} {c.amount} {c.until} {c.plan or '-'} "
            f"{why_token(c.actor, c.reason)}"
        )
    return " ".join(out)


def _position(keys: list[str], index: dict[str, int], key: str) -> int:
    """The 1-based position of ``key`` in the script's KEYS, appended when new."""
    pos = index.get(key)
    if pos is None:
        keys.append(key)
        pos = index[key] = len(keys)
    return pos


#: What a reservation's id may be to name its hash (an event id: a UUID).
_HOLD_ID = re.compile(r"[0-9a-f-]{1,64}")

#: An approval's one-time id (approval.approval_state): what names its spent marker.
_ONCE = re.compile(r"[0-9a-f]{32}")

#: The changes that add room to a counter: their sums are checked exactly (apply.lua).
_ROOM_KINDS = frozenset({ChangeKind.GRANTED, ChangeKind.RESET})


def apply_args(
    partition: str,
    events: Sequence[AppliedEvent],
    *,
    require_epoch: bool,
    through: int,
    now_ms: str,
    tag: str = "",
) -> tuple[list[str], list[Any]]:
    """lua/apply.lua's KEYS and ARGV for ``events`` of ``partition``.

    ``tag``: a hash tag (``{...}``) appended to the watermark hash, the epoch
    marker and the seen-id sets, so that on Redis Cluster they share the slot
    of the counters they guard (projections/counters/cluster.py); "" on one Redis.
    """
    counters: list[str] = []
    index: dict[str, int] = {}
    seen_sets: list[str] = []
    hold_keys: list[str] = []  # the reservation hashes the batch opens or draws on
    hold_index: dict[str, int] = {}
    marker_keys: list[str] = []  # the approvals' spent markers (approval.spend_op)
    # The events travel as one space-separated string (see lua/apply.lua): a
    # batch of 500 events is 6 arguments for redis-py to pack, not ~5,500.
    tokens: list[str] = []
    days: dict[float, str] = {}  # UTC day -> "<seen-set position> <its expire_at>"
    # What spares apply.lua its exact check (surely_fits): per counter the sum of the
    # batch's amounts, unless a refund or a grant needs that check anyway.
    sums: dict[int, int] = {}
    doubt = False

    for event in events:
        event_id = event.event_id
        if not event_id or len(event_id.split()) != 1:
            raise ValueError(f"event id {event_id!r}: empty or holds whitespace")
        # Events of one UTC day share the seen-set entry (negative times: no sharing).
        day = event.time // SECONDS_PER_DAY if event.time >= 0 else event.time
        seen = days.get(day)
        if seen is None:
            seen_sets.append(f"{SEEN_PREFIX}:{event.seen_day}{tag}")
            seen = days[day] = f"{len(seen_sets)} {event.seen_expire_at}"
        # A reservation's hash holds its estimates (lua/apply.lua, counters.Holds).
        role = "-"
        held = event_id if event.opens else event.closes
        if held and _HOLD_ID.fullmatch(held):
            pos = hold_index.get(held)
            if pos is None:
                hold_keys.append(f"{HOLD_PREFIX}:{held}{tag}")
                pos = hold_index[held] = len(hold_keys)
            role = f"{'o' if event.opens else 'c'}{pos}"
        elif event.closes is not None:
            role = "c0"
        if event.closes is not None:
            doubt = True
        marks = "-"
        if event.spent:
            doubt = True
            found = []
            for once, until in event.spent:
                if not _ONCE.fullmatch(once):
                    raise ValueError(f"approval {once!r}: not a one-time id")
                marker_keys.append(f"{SPENT_PREFIX}:{once}")
                found.append(f"{len(marker_keys)}:{int(until)}")
            marks = ",".join(found)
        tokens.append(f"{event.offset} {event_id} {seen} {role} {marks} {len(event.charges)}")
        for charge in event.charges:
            pos = index.get(charge.key) or _position(counters, index, charge.key)
            tokens.append(f"{pos} {charge.amount} {charge.expire_at}")
            if charge.amount < 0:
                doubt = True
            else:
                sums[pos] = sums.get(pos, 0) + charge.amount
        changes = event.changes
        if any(c.kind in _ROOM_KINDS for c in changes):
            doubt = True
        tokens.append(str(len(changes)))
        for c in changes:
            pos = _position(counters, index, c.key)
            tokens.append(
                f"{pos} {c.kind.value} {c.field or '-'} {c.amount} {c.until} {c.plan or '-'} "
                f"{why_token(c.actor, c.reason)}"
            )
    keys = [WATERMARK_KEY + tag, EPOCH_KEY + tag, *seen_sets, *hold_keys, *marker_keys]
    keys += counters
    args: list[Any] = [
        partition,
        len(events),
        "1" if require_epoch else "0",
        " ".join(tokens),
        len(seen_sets),
        through,
        "1" if doubt else " ".join(["0", *(f"{p} {t}" for p, t in sums.items())]),
        now_ms,
        len(hold_keys),
        len(marker_keys),
    ]
    return keys, args


class RedisScripts(KeyValueOps):
    """:class:`~.redis.RedisBackend` on a redis-py client, all but ``from_url``: what
    ``cluster.py`` runs on each slot, apart from the URL dispatch that names
    ``ClusterBackend``, so that neither module imports the other back."""

    #: One charge may admit a call and charge its fixed price under two event ids
    #: (counters.with_cost): Governor.admitted(price=) then takes one round trip.
    prices_at_admission = True

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        require_epoch: bool = False,
        clock: Callable[[], float] = time.time,
        coalesce: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        resolved_caps: bool = False,
        epoch_key: Callable[[str], str] | None = None,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self._owns_client = owns_client
        # epoch_key: the epoch marker a charge checks, given its first counter's key
        # (Redis Cluster: the marker of that counter's slot, cluster.py); else EPOCH_KEY.
        self._epoch_key = epoch_key
        # resolved_caps: each op's cap is its effective cap already (the cluster
        # resolves run-time caps and plans on the client, cluster.py), so the
        # script only adds each counter's grant (lua/charge.lua 'g').
        self.resolved_caps = resolved_caps
        self.require_epoch = require_epoch
        self.clock = clock  # epoch seconds; the scripts get it in ms (lua/lib.lua caller_ms)
        self._charge = _Script(source("charge"))
        self._apply = _Script(source("apply"))
        self._usage = _Script(source("usage"))
        self._change = _Script(source("change"))
        self._lease = _Script(source("lease"))
        # One command, no per-call wrapper: the hot path's only round trip.
        self._execute: Any = client.execute_command
        self._prepared: dict[tuple[int, bool, bool], _Prepared] = {}
        # coalesce: scripts go through one shared, auto-pipelined connection per
        # event loop (autopipe.py), else through the client's pool.
        self.timeout = timeout
        self._address = Address.of_client(client) if coalesce else None
        self._pipe_now: Pipe | None = None
        # A turn's checks on the shared connection go to Redis as one call of
        # charge_many.lua once it is loaded (autopipe.Batched; _load_many).
        self._many = _Script(many_source())
        self._batched = Batched(self._charge.sha, self._many.sha)
        self._loading_many = False
        self._many_not_before = 0.0  # a refused load is tried again from then (loop time)

    @property
    def _client(self) -> aioredis.Redis:
        """:attr:`client`, as mcp-budget-governor 0.1.0 named it."""
        return self.client

    def _kv_now(self) -> float:
        return self.clock()

    async def _kv_expire(self, key: str, ttl: int) -> None:
        # charge.lua sets a counter's expiry when it creates it; a key that lost it
        # (PERSIST, a failover) gets one back here, as the reference's scripts did.
        try:
            await self._command("EXPIRE", key, ttl, "NX")
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc

    async def _kv_release(self, key: str, amount: int) -> None:
        # Never below zero: give back at most the total read. A counter that expires
        # in between is created by the charge with EXPIREAT 0, i.e. deleted at once.
        (total,) = await self.usage([key])
        give = min(max(amount, 0), total)
        if give > 0:
            await self.charge([CounterOp(key, -give, 0, False, 0)], want_used=False)

    async def peek(self, key: str) -> int:
        """The total of ``key``; 0 when missing or not a counter (a stray write)."""
        try:
            (total,) = await self.usage([key])
        except redis_errors.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            return 0
        return total

    def _now_ms(self) -> str:
        """The caller's clock as the scripts take it: epoch milliseconds."""
        return str(int(self.clock() * 1000))

    def _pipe(self) -> Pipe:
        """This event loop's shared connection (a new one on another loop)."""
        pipe = self._pipe_now
        if pipe is None or pipe.loop is not asyncio.get_running_loop():
            assert self._address is not None
            if pipe is not None:
                pipe.abandon()  # its loop is gone (asyncio.run after asyncio.run)
            pipe = self._pipe_now = Pipe(self._address, self.timeout)
        return pipe

    async def _command(self, *args: Any) -> Any:
        if self._address is None:
            return await self._execute(*args)
        return await self._pipe().call(pack(args))

    async def _eval(self, script: _Script, args: Sequence[Any]) -> Any:
        """EVALSHA ``args`` (numkeys, keys, argv); EVAL where the node lacks the script."""
        try:
            try:
                return await self._command("EVALSHA", script.sha, *args)
            except redis_errors.NoScriptError:
                return await self._command("EVAL", script.script, *args)
        except _UNAVAILABLE as exc:
            raise redis_failure(exc) from exc

    async def _run(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self._eval(script, [len(keys), *keys, *args])

    def _prepare(self, ops: Sequence[CounterOp], want_used: bool, with_op: bool) -> _Prepared:
        """The charge.lua arguments of ``ops`` around the event id, encoded (and
        packed, for the shared connection) once per op list.

        The governor reuses one ops tuple per context and minute, so the cache
        is keyed by its identity (the entry keeps the tuple alive, so the id
        cannot be reused while cached) and checked with ``is``.
        """
        cache_key = (id(ops), want_used, with_op)
        hit = self._prepared.get(cache_key)
        if hit is not None and hit.ops is ops:
            return hit
        keys: list[Any] = []
        if self.require_epoch:
            epoch = EPOCH_KEY if self._epoch_key is None or not ops else self._epoch_key(ops[0].key)
            keys.append(epoch.encode())
        counters: list[Any] = []
        tail: list[Any] = []
        resolve = any(op.ref is not None for op in ops)
        caps_keys: list[Any] = []
        for op in ops:
            counters.append(op.key.encode())
            tail += (
                str(op.amount).encode(),
                str(op.cap).encode(),
                b"1" if op.enforce else b"0",
                str(op.expire_at).encode(),
            )
            if resolve:
                tail.append(_ref_arg(op))
                caps_keys.append(PLANS_KEY.encode() if op.ref is None else op.ref.caps_key.encode())
        if resolve:
            counters += (*caps_keys, PLANS_KEY.encode())
        # Every lease set's queue comes last (lua/charge.lua 'l'): waiting calls go first.
        queues = [queue_key(op.key).encode() for op in ops if op.key.startswith(LEASE_PREFIX)]
        counters += queues
        leases = len(queues)
        flags = (
            ("l" if leases else "")
            + ("e" if self.require_epoch else "")
            + ("u" if want_used else "")
            + ("o" if with_op else "")
            + ("c" if resolve else "")
            + ("g" if self.resolved_caps and not resolve else "")
            + ("s" if any(slides(op.key) for op in ops) else "")
        )
        numkeys = len(keys) + len(counters) + (1 if with_op else 0)
        if with_op:
            head = [numkeys, *keys]
        else:
            head, counters = [numkeys, *keys, *counters], []
        entry = _Prepared(
            ops,
            head,
            counters,
            flags.encode() or b"-",
            tail,
            leases,
            pack_args(head),
            pack_args(counters),
            pack_args([flags.encode() or b"-"]),
            pack_args(tail),
            # EVALSHA, sha, head, [op marker, counters,] event id, flags, tail, clock
            4 + len(head) + len(counters) + len(tail) + (1 if with_op else 0) + 1,
            pack_args(head[1:]),
        )
        if len(self._prepared) >= 8192:
            self._prepared.clear()
        self._prepared[cache_key] = entry
        return entry

    def charge_args(self, c: Charge) -> list[Any]:
        """What :meth:`charge` sends after ``EVALSHA <sha>``: numkeys, KEYS, ARGV
        (the one builder of lua/charge.lua's arguments; benchmarks use it too)."""
        op_id = c.inline_op
        p = self._prepare(c.ops, c.want_used, op_id is not None)
        lease_args = self._lease_args(p, c)
        if op_id is not None:
            first: list[Any] = [op_key(op_id).encode(), *p.counters, op_id]
        else:
            first = [c.event_id or ""]
        return [*p.head, *first, p.flags, *lease_args, *p.tail, self._now_ms()]

    @staticmethod
    def _lease_args(p: _Prepared, c: Charge) -> list[Any]:
        """After the flags: the lease id, its time to live, the waiting ticket ('-'
        when the call does not wait) and the number of lease sets (lua/charge.lua 'l')."""
        if not p.leases:
            return []
        return [c.lease_id(True), str(c.lease_ttl_ms), c.ticket or "-", str(p.leases)]

    def _packed_charge(self, c: Charge) -> bytes:
        """:meth:`charge_args` as one packed EVALSHA."""
        return self._batched.one(self._charge_part(c))

    def _charge_part(self, c: Charge) -> Part:
        """:meth:`charge_args` packed, keys and arguments apart (autopipe.Part): the
        cached pieces spliced around what varies per call (event or operation
        id, lease, clock)."""
        op_id = c.inline_op
        p = self._prepare(c.ops, c.want_used, op_id is not None)
        lease_args = self._lease_args(p, c)
        now = str(int(self.clock() * 1000)).encode()  # _now_ms, packed in one step
        nkeys = p.head[0]
        if op_id is not None:
            # op_key(op_id) and the counters, then op_id: formatted in one step (the
            # hot path of a check without a ledger; the rest is cached in ``p``).
            ob = op_id.encode()
            kb = _OP_KEY_HEAD + ob
            keys = b"%s$%d\r\n%s\r\n%s" % (p.keys_b, len(kb), kb, p.counters_b)
            first = b"$%d\r\n%s\r\n" % (len(ob), ob)
        else:
            keys = p.keys_b
            eid = (c.event_id or "").encode()
            first = b"$%d\r\n%s\r\n" % (len(eid), eid)
        args = b"".join(
            (
                first,
                p.flags_b,
                pack_args(lease_args) if lease_args else b"",
                p.tail_b,
                b"$%d\r\n%s\r\n" % (len(now), now),
            )
        )
        return keys, nkeys, args, p.count - 3 - nkeys + len(lease_args)

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
        """Charge ``ops`` all or nothing (lua/charge.lua); ``lease``: the id concurrency
        caps hold for ``lease_ttl`` seconds; ``ticket``: the place of a call waiting for a
        slot (``"<id>/<wait ms>"``, keys.queue_key), which a refusal queues."""
        return await self.charge_with(
            Charge(ops, event_id, want_used, op_id, lease, lease_ttl, ticket)
        )

    async def charge_with(self, c: Charge) -> ChargeResult:
        """:meth:`charge` of one :class:`~mcp_budget_governor.counters.Charge`."""
        if self._address is None:
            return self._charged(c.ops, await self._eval(self._charge, self.charge_args(c)))
        return await self._reply_of(self._pipe().call(self._packed_charge(c)), c)

    def charge_sent(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
    ) -> Awaitable[ChargeResult] | None:
        """Write the charge now, on this loop's shared connection, and return what
        awaits its reply; None when it cannot be written at once (coalescing off,
        or not connected: then :meth:`charge` it).

        Once this returns, any later call of this process on the connection
        reaches Redis after the charge (one connection keeps its order), so
        the next check sees it without anyone waiting for its reply.
        """
        if self._address is None:
            return None
        pipe = self._pipe()
        c = Charge(ops, event_id, want_used, op_id)
        fut = pipe.send(self._packed_charge(c))
        if fut is None:
            return None
        return self._reply_of(fut, c)

    def charge_held(self, c: Charge) -> Held[Any] | None:
        """Write the charge ``c`` now, on this loop's shared connection: the future
        of its raw reply, which its awaiter's cancellation does not drop
        (:class:`~mcp_budget_governor.shielding.Held`), for :meth:`held_result`;
        None when it cannot be written at once (then :meth:`charge` it)."""
        if self._address is None:
            return None
        pipe = self._pipe()
        if not self._batched.ready:
            self._load_many(pipe)
        return pipe.send_part(self._charge_part(c), self._batched, Held)  # type: ignore[return-value]

    def _load_many(self, pipe: Pipe) -> None:
        """Load charge_many.lua on ``pipe`` (once at a time), and batch once it is
        in. A Redis that refuses it (an ACL, a managed service, a server still
        loading its data) is asked again after :data:`MANY_RETRY` seconds, not on
        every check; one whose connection was lost, at the next check."""
        if self._loading_many or pipe.loop.time() < self._many_not_before:
            return
        fut = pipe.send(pack(["SCRIPT", "LOAD", self._many.script]))
        if fut is None:
            return
        self._loading_many = True

        def loaded(f: asyncio.Future[Any]) -> None:
            self._loading_many = False
            error = asyncio.CancelledError() if f.cancelled() else f.exception()
            if error is None:
                sha = f.result()
                self._batched.ready = (sha.decode() if isinstance(sha, bytes) else sha) == (
                    self._many.sha
                )
            if not self._batched.ready and not isinstance(error, (OSError, asyncio.CancelledError)):
                self._many_not_before = pipe.loop.time() + MANY_RETRY

        fut.add_done_callback(loaded)

    def held_result(self, reply: Held[Any], c: Charge) -> ChargeResult | Awaitable[ChargeResult]:
        """The :class:`ChargeResult` of :meth:`charge_held`'s ``reply``, done: read at
        once from a reply, or (an error: lost scripts, a dropped connection) what
        :meth:`charge` would give, to await."""
        if reply.exception() is None:
            return self._charged(c.ops, reply.result())
        return self._reply_of(reply, c)

    async def _reply_of(self, pending: Awaitable[Any], c: Charge) -> ChargeResult:
        try:
            reply = await pending
        except redis_errors.NoScriptError:  # this node lost its scripts: EVAL, same arguments
            reply = await self._eval(self._charge, self.charge_args(c))
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return self._charged(c.ops, reply)

    @staticmethod
    def _charged(ops: Sequence[CounterOp], reply: Any) -> ChargeResult:
        """The :class:`ChargeResult` of charge.lua's reply."""
        head_value = int(reply[0])
        if head_value == 0 and len(reply) == 1:
            return _ADMITTED
        if head_value == -2:
            op = ops[int(reply[1]) - 1]
            raise overflow(op.key, op.amount)
        if head_value < 0:
            raise BackendUnavailableError("redis lost its state (epoch marker missing): rebuilding")
        values = tuple(map(int, reply[1:]))
        # Flagged 'c' or 'g' the reply carries each counter's cap after its total.
        if ops and len(values) == 2 * len(ops):
            n = len(ops)
            return ChargeResult(head_value - 1, values[:n], values[n:])
        return ChargeResult(head_value - 1, values)

    async def _leases(self, keys: Sequence[str], *args: Any) -> list[int]:
        if not keys:
            return []
        return [int(v) for v in await self._run(self._lease, keys, (*args, self._now_ms()))]

    async def release(self, keys: Sequence[str] | str, lease: str | int) -> int:
        """Give lease ``lease`` back on every set in ``keys`` (one round trip); how many held it.

        ``release(key, amount)`` (one key, an amount): mcp-budget-governor 0.1.0's
        give-back, never below zero nor creating the key; returns 0."""
        if isinstance(keys, str):
            await self._kv_release(keys, int(lease))
            return 0
        assert isinstance(lease, str)
        return sum(await self._leases(keys, "r", lease))

    async def renew(self, keys: Sequence[str], lease: str, ttl: float) -> int:
        """Extend lease ``lease`` to Redis' now + ``ttl`` seconds where it is still alive."""
        return sum(await self._leases(keys, "n", lease, str(max(1, round(ttl * 1000)))))

    async def leave(self, keys: Sequence[str], ticket: str) -> int:
        """Take waiting ticket ``ticket`` out of the queues of lease sets ``keys``."""
        return sum(await self._leases([queue_key(k) for k in keys], "q", ticket))

    async def in_progress(self, keys: Sequence[str]) -> list[int]:
        """How many live leases each set holds (calls in progress)."""
        return await self._leases(keys, "c")

    async def lease_keys(self, limit: int) -> list[str]:
        """Up to ``limit`` lease sets, sorted (each expires with its last lease)."""
        return await self._scan(f"{LEASE_PREFIX}:*", limit)

    async def usage(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        reply = await self._run(self._usage, keys, ())
        return [int(reply[i]) + int(reply[i + 1]) for i in range(0, len(reply), 2)]

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
        keys, args = apply_args(
            partition, events, require_epoch=require_epoch, through=through, now_ms=self._now_ms()
        )
        return await self.run_apply(keys, args)

    async def run_apply(self, keys: Sequence[str], args: Sequence[Any]) -> int:
        """Run lua/apply.lua with what :func:`apply_args` built; the number applied."""
        try:
            applied = int(await self._run(self._apply, keys, args))
        except redis_errors.ResponseError as exc:
            if "mcpbg apply:" not in str(exc):
                raise
            refused = refused_event(str(exc))
            if refused is not None:  # checked before the first write: nothing written
                raise refused from None
            raise ValueError(str(exc)) from None  # a key of no counter's shape: nothing written
        if applied < 0:
            raise EpochMissingError("redis lost its state (epoch marker missing): rebuild first")
        return applied

    async def has_epoch(self) -> bool:
        """Whether Redis holds a complete projection: the marker the worker sets, as a
        string of its shape (``keys.EPOCH_VALUE``; the scripts check the same in ``epoch_ok``)."""
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.type(EPOCH_KEY)
                pipe.getrange(EPOCH_KEY, 0, 64)  # WRONGTYPE on a hash: returned, not raised
                kind, value = await pipe.execute(raise_on_error=False)
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        if kind not in (b"string", "string") or isinstance(value, Exception):
            return False
        text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        return EPOCH_VALUE.fullmatch(text) is not None

    async def mark_ready(self, epoch: str) -> None:
        """Declare the counters complete: the hot path may admit from them again."""
        if not isinstance(epoch, str) or EPOCH_VALUE.fullmatch(epoch) is None:
            raise InvalidInputError("epoch", epoch, f"expected {EPOCH_VALUE.pattern}")
        try:
            await self.client.set(EPOCH_KEY, epoch)
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc

    async def state(self, key: str) -> CounterState:
        try:
            raw = await self.client.hgetall(key)
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        fields = {
            name: int(v)
            for k, v in raw.items()
            if (name := k.decode() if isinstance(k, bytes) else k) != "w"  # w: the why, text
        }
        pending = {k[2:]: v for k, v in fields.items() if k.startswith("e:")}
        return CounterState(fields.get("c", 0), fields.get("f", 0), pending, fields.get("g", 0))

    async def grants_of(self, keys: Sequence[str]) -> list[int]:
        """Each counter's grant (0 when none), in one round trip."""
        if not keys:
            return []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hget(key, "g")
                replies = await pipe.execute()
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return [0 if r is None else int(r) for r in replies]

    async def grants(self, limit: int) -> list[tuple[str, int, str]]:
        """Up to ``limit`` counters holding a grant: ``(key, grant, why token)``, sorted."""
        keys = await self.counter_keys(limit)
        if not keys:
            return []
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hmget(key, "g", "w")
                replies = await pipe.execute()
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        out = []
        for key, (g, w) in zip(keys, replies, strict=True):
            if g is not None:
                why = "-" if w is None else w.decode() if isinstance(w, bytes) else str(w)
                out.append((key, int(g), why))
        return out

    async def grant_reason(self, key: str) -> str:
        """The why token (``caps.why_token``) of the counter's last grant or reset."""
        raw = await self.client.hget(key, "w")
        return "-" if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    async def change(self, changes: Sequence[Change]) -> None:
        """Apply run-time changes directly (no ledger), all in one script call."""
        if not changes:
            return
        keys: list[str] = []
        tokens = change_tokens(changes, keys, {})
        try:
            await self._run(self._change, keys, (tokens, self._now_ms()))
        except redis_errors.ResponseError as exc:
            if "mcpbg change:" not in str(exc):
                raise
            raise ValueError(str(exc)) from None

    async def overrides(self) -> tuple[dict[str, dict[str, tuple[int, int, str]]], dict[str, str]]:
        """The run-time value caps (caps key -> field -> (cap, until, why)) and assignments;
        ``why`` is the token of :func:`caps.why_token`."""

        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        caps: dict[str, dict[str, tuple[int, int, str]]] = {}
        try:
            async for raw in self._scan_iter(f"{CAPS_PREFIX}:*"):
                entries = await self.client.hgetall(raw)
                values = {}
                for f, v in entries.items():
                    values[text(f)] = caps_value(text(v))
                if values:
                    caps[text(raw)] = values
            plans = {text(f): text(v) for f, v in (await self.client.hgetall(PLANS_KEY)).items()}
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return caps, plans

    async def counter_keys(self, limit: int, *, match: str | None = None) -> list[str]:
        """Up to ``limit`` counter keys, sorted, by an incremental SCAN (never KEYS,
        which would block Redis) that stops once it has found ``limit``.

        Redis does the matching; a ``keys.key_pattern`` starts with a limit
        name, which never starts with "_", so internal keys cannot match it.
        """
        # [^_]: the projection's own keys (mcpbg:v1:_*) never come back.
        return await self._scan(f"{PREFIX}:[^_]*" if match is None else match, limit)

    async def _scan(self, pattern: str, limit: int) -> list[str]:
        """Up to ``limit`` keys matching ``pattern``, sorted, by an incremental SCAN."""
        found: set[str] = set()
        if limit <= 0:
            return []
        try:
            async for raw in self._scan_iter(pattern):
                found.add(raw.decode() if isinstance(raw, bytes) else raw)
                if len(found) >= limit:
                    break
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return sorted(found)

    def _scan_iter(self, pattern: str) -> AsyncIterator[Any]:
        """Every key matching ``pattern``, by an incremental SCAN (on Redis Cluster,
        ``cluster._SlotScripts`` walks every master)."""
        return self.client.scan_iter(match=pattern, count=1000)

    async def watermark(self, partition: str) -> int:
        """The last applied offset of a partition, -1 when none."""
        raw = await self.client.hget(WATERMARK_KEY, partition)
        return -1 if raw is None else int(raw)

    async def aclose(self) -> None:
        if self._pipe_now is not None:
            self._pipe_now.close()
            self._pipe_now = None
        # The pool was passed in (from_url), so Redis.aclose alone would leave its
        # connections open (ResourceWarning: unclosed Connection). A borrowed
        # client is its owner's to close.
        if self._owns_client:
            await close_best_effort(self.client.aclose(close_connection_pool=True))
