"""Counters on Redis Cluster: a check spread over slots, charged per slot group.

Counter keys carry no hash tag, so they spread over the cluster's slots as
they do on one Redis. A charge whose counters fall in several slots runs
``lua/charge.lua`` once per slot group, all groups in parallel (one round trip
of wall time); when any group refuses (or fails), the groups that admitted are
taken back by a compensating charge, so a check never admits past a cap and a
refused check leaves no lasting charge. In between, its holds can refuse
someone else: docs/cluster.md bounds that window.

Run-time value caps and plan assignments (``caps.caps_key`` hashes, the
``caps.PLANS_KEY`` hash) live in slots of their own, so the slot scripts
cannot read them: the client resolves each counter's effective cap with the
one rule (``caps.effective``) from a copy of the entries its checks need,
each re-read at most every ``caps_refresh`` seconds (:class:`_RunTime`, one
pipelined read per refresh, grouped per node by redis-py), and the script
adds the counter's grant, which lives in the counter's own hash
(``lua/charge.lua`` flag 'g'). docs/cluster.md states the staleness bound.

The operation marker of an inline charge (``keys.op_key``) gets a hash tag
that puts it in its group's slot (:func:`slot_tag`), so each group's charge
stays idempotent on its own.

Every slot has an epoch marker of its own (:func:`epoch_key`), checked by each
slot group's apply (and, with ``require_epoch``, its charge) in the same
script: a shard that restarted empty has lost the markers of its slots, so
its applies refuse and :meth:`ClusterBackend.lost` names the slots to rebuild,
leaving the others untouched.

>>> backend = RedisBackend.from_url("redis+cluster://h1:7000,h2:7001")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence, Set
from functools import cache
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

from mcp_budget_governor.caps import PLANS_KEY, Change, effective
from mcp_budget_governor.counters import (
    AppliedCharge,
    AppliedEvent,
    ApplyOnly,
    Charge,
    ChargeResult,
    CounterOp,
    CounterState,
    owners,
    refused_event,
    with_cost,
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
    LEASE_PREFIX,
    SPENT_PREFIX,
    WATERMARK_KEY,
)
from mcp_budget_governor.settings import SETTINGS, checked
from mcp_budget_governor.urls import CLUSTER_SCHEME, parse_cluster_url

from .redis_scripts import (
    _UNAVAILABLE,
    DEFAULT_TIMEOUT,
    RedisScripts,
    apply_args,
    change_tokens,
    close_best_effort,
    redis_failure,
)

log = logging.getLogger("mcp_budget_governor")

SCHEME = CLUSTER_SCHEME
# A slot group's charge waits this long at most for one of the client's connections
# (busy past it: 503, never the fail mode), as PostgresBackend's checks wait for theirs.
QUEUE_TIMEOUT = 5.0
#: Slot charges one process has in flight at once (all nodes together, and never
#: more than a node's pool holds). More only opens connections (a connect and a
#: HELLO each) without more replies a second: a 1,500-check burst took 4.9-5.7 s
#: at 1,024 and 2.6-2.8 s at 128 on one machine (8.9-9.9 s and 5.5-5.9 s under
#: coverage), so its last charges waited less for their slot.
IN_FLIGHT = 128

#: A check refused by one slot group while another admitted it is tried again
#: this many times (each attempt taken back first): the refusal may have come
#: from other checks' transient holds, which would otherwise under-admit.
RETRIES = 2

#: Seconds a run-time value cap or plan assignment read from the cluster is used
#: before it is read again: how long a run-time change that reached the cluster
#: may go unenforced by a process (docs/cluster.md). 0: read before every charge.
#: The setting ``caps_refresh`` (``MCPBG_CAPS_REFRESH``) of the settings table.
CAPS_REFRESH: float = SETTINGS["caps_refresh"].default

#: A (hash, field) the run-time rule reads: a value cap or a plan assignment.
_Entry = tuple[str, str]

# A taken-back hold's in-flight entries, once they net to zero (ARGV: e:<event id> of
# each event the hold was under: two for a price charged with its admission).
_FORGET = """
for _, key in ipairs(KEYS) do
  for _, field in ipairs(ARGV) do
    if redis.call('HGET', key, field) == '0' then redis.call('HDEL', key, field) end
  end
end
return 1
"""

# The resume watermark only moves forward (a rebuild re-applies from offset 0).
_RAISE_WATERMARK = """
local was = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > was then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""


@cache
def _slot_tags() -> tuple[str, ...]:
    """For each of the 16384 slots a short string that hashes to it."""
    tags: list[str | None] = [None] * 16384
    missing, i = 16384, 0
    while missing:
        tag = format(i, "x")
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        i += 1
    return tuple(t for t in tags if t is not None)


def slot_tag(slot: int) -> str:
    """A hash tag (``{...}``) that puts a key in ``slot``.

    >>> key_slot(("mcpbg:v1:_op:x" + slot_tag(key_slot(b"mcpbg:v1:a:global:d1"))).encode()) == \
key_slot(b"mcpbg:v1:a:global:d1")
    True
    """
    return "{" + _slot_tags()[slot] + "}"


#: How many slots a Redis Cluster has.
SLOTS = 16384


def in_slots(slots: Set[int] | None, key: str) -> bool:
    """Whether ``key`` hashes into ``slots`` (None: every slot), for a rebuild of some.

    >>> in_slots(None, "k"), in_slots({key_slot(b"k")}, "k"), in_slots(set(), "k")
    (True, True, False)
    """
    return slots is None or key_slot(key.encode()) in slots


def epoch_key(slot: int) -> str:
    """The epoch marker of ``slot`` (each slot has one: a shard that restarted empty
    lost those of its slots, and only those are rebuilt; docs/cluster.md).

    >>> key_slot(epoch_key(7).encode())
    7
    """
    return EPOCH_KEY + slot_tag(slot)


def _epoch_of(key: str) -> str:
    """The epoch marker of the slot ``key`` hashes to."""
    return epoch_key(key_slot(key.encode()))


def _whole(value: Any) -> bool:
    """Whether a marker's GET reply is a whole epoch (``keys.EPOCH_VALUE``, lua epoch_ok)."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return isinstance(value, str) and EPOCH_VALUE.fullmatch(value) is not None


def _refresh(value: Any) -> float:
    """``caps_refresh`` checked as the settings table checks it (seconds >= 0)."""
    return float(checked("caps_refresh", value))


def _policy_capped(op: CounterOp) -> CounterOp:
    """``op`` compared with its cap by the policy alone (caps.effective, nothing at run time)."""
    if op.ref is None:
        return op
    cap = effective(op.ref, op.cap, runtime=None, assigned={}, grant=0, now=0.0).cap
    return dataclasses.replace(op, cap=cap, ref=None)


def _wanted(ops: Sequence[CounterOp]) -> tuple[_Entry, ...]:
    """The run-time entries the effective caps of ``ops`` depend on: each scoped
    counter's value cap, and where a plan caps its limit, its plan assignments."""
    out: dict[_Entry, None] = {}
    for op in ops:
        ref = op.ref
        if ref is None or not ref.field:  # no ref, or a global limit: no run-time lookup
            continue
        out[(ref.caps_key, ref.field)] = None
        if ref.plan_caps:
            for f in ref.plan_fields:
                out[(PLANS_KEY, f)] = None
    return tuple(out)


def _runtime_cap(raw: str | None) -> tuple[int, int] | None:
    """A caps-hash value, ``"<cap> <until> <why>"`` (lua/lib.lua apply_change), as (cap, until)."""
    if raw is None:
        return None
    cap, _, rest = raw.partition(" ")
    until = rest.partition(" ")[0]
    if not cap.isdigit() or not (until or "0").isdigit():
        return None  # not of the shape apply_change writes: ignored, as effective_cap does
    return int(cap), int(until or 0)


def _resolved(
    ops: Sequence[CounterOp], values: dict[_Entry, str | None], now: float
) -> tuple[tuple[int, ...], float]:
    """Each op's effective cap (caps.effective, without its grant: the script adds
    it) and until when those hold (a run-time cap's until-date ends it)."""
    caps, holds = [], float("inf")
    for op in ops:
        ref = op.ref
        if ref is None:
            caps.append(op.cap)
            continue
        runtime = _runtime_cap(values.get((ref.caps_key, ref.field))) if ref.field else None
        assigned = {}
        if ref.plan_caps:
            for f in ref.plan_fields:
                plan = values.get((PLANS_KEY, f))
                if plan is not None:
                    assigned[f] = plan
        caps.append(
            effective(ref, op.cap, runtime=runtime, assigned=assigned, grant=0, now=now).cap
        )
        if runtime is not None and runtime[1] > now:
            holds = min(holds, float(runtime[1]))
    return tuple(caps), holds


def _event_of(event_id: str | None, positions: Sequence[int]) -> str | None:
    """The event id argument of the slot charge of the ops at ``positions`` (ascending)
    of a whole charge made under ``event_id``: a fixed price charged with its
    admission (counters.with_cost) names its cost's first counter within the slot's
    ops, or only one of the two events when the slot holds counters of one.

    >>> _event_of(with_cost("a1", "c2", 2), [0, 3]), _event_of(with_cost("a1", "c2", 2), [1])
    ('a1 c2 2', 'a1')
    >>> _event_of(with_cost("a1", "c2", 2), [2, 4]), _event_of("a1", [2])
    ('a1 c2 1', 'a1')
    """
    if event_id is None:
        return None
    admission, cost, first = owners(event_id)
    if cost is None or first is None:
        return event_id
    at = next((i for i, pos in enumerate(positions) if pos >= first), None)
    return admission if at is None else with_cost(admission, cost, at)


def _broadest(groups: Sequence[_Group]) -> int:
    """The index of the group holding the counter most checks share: the key with
    the fewest scope dimensions (a global limit's has none; ``user=..,tool=..`` two).

    >>> op = lambda key: CounterOp(key, 1, 9, True, 0)
    >>> _broadest([_Group(1, (0,), (op("mcpbg:v1:u:user=a:d"),)),
    ...            _Group(2, (1,), (op("mcpbg:v1:g:global:d"),))])
    1
    """
    return min(range(len(groups)), key=lambda i: min(op.key.count("=") for op in groups[i].ops))


async def _in_two_steps(
    groups: Sequence[_Group],
    one: Callable[[_Group, str | None], Awaitable[ChargeResult]],
    tag_op: str | None,
) -> list[ChargeResult | BaseException | None]:
    """A retry's slot charges: every group but the broadest at once, then the broadest
    alone, only when they all admitted: a hold on the counter every check shares is
    then never taken back, so it refuses no other check (None: a group not sent)."""
    last = _broadest(groups)
    outcomes: list[ChargeResult | BaseException | None] = [None] * len(groups)
    first = [i for i in range(len(groups)) if i != last]
    got = await asyncio.gather(*(one(groups[i], tag_op) for i in first), return_exceptions=True)
    for i, o in zip(first, got, strict=True):
        outcomes[i] = o
    if all(isinstance(o, ChargeResult) and o.admitted for o in got):
        (outcomes[last],) = await asyncio.gather(one(groups[last], tag_op), return_exceptions=True)
    return outcomes


class _RunTime:
    """The run-time entries (value caps, plan assignments) this process's checks
    need, as last read from the cluster, each re-read once ``refresh`` seconds old.

    Stale entries are read in one pipeline (redis-py groups it per node: one
    round trip of wall time); concurrent checks needing the same entries share
    one read. A change written through this backend drops the copy at once.
    """

    def __init__(self, client: RedisCluster, refresh: float) -> None:
        self.client = client
        self.refresh = refresh
        self.generation = 0  # moves when the copy is dropped (a change written here)
        self._seen: dict[_Entry, tuple[float, str | None]] = {}  # read at (epoch s), value
        self._reading: dict[_Entry, asyncio.Future[None]] = {}

    def drop(self) -> None:
        self._seen.clear()
        self.generation += 1

    async def read(
        self, wanted: Sequence[_Entry], now: float
    ) -> tuple[dict[_Entry, str | None], float]:
        """The values of ``wanted`` and until when they are fresh."""
        seen = self._seen
        stale = [e for e in wanted if (hit := seen.get(e)) is None or now >= hit[0] + self.refresh]
        if stale:
            await self._fetch(stale, now)
        values: dict[_Entry, str | None] = {}
        fresh = float("inf")
        for e in wanted:
            at, value = seen.get(e, (-math.inf, None))  # dropped meanwhile: read it again next
            values[e] = value
            fresh = min(fresh, at + self.refresh)
        return values, fresh

    async def _fetch(self, stale: Sequence[_Entry], now: float) -> None:
        """Read ``stale`` (those no other check is reading already) in one pipeline."""
        todo = [e for e in stale if e not in self._reading]
        others = {self._reading[e] for e in stale if e in self._reading}
        if todo:
            generation = self.generation
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for e in todo:
                self._reading[e] = done
            try:
                async with self.client.pipeline() as pipe:
                    for key, field in todo:
                        pipe.hget(key, field)
                    got = await pipe.execute()
            except _UNAVAILABLE as exc:
                failed = redis_failure(exc)
                done.set_exception(failed)
                done.exception()  # retrieved: no other check may be waiting for it
                raise failed from exc
            except BaseException:
                done.cancel()  # the checks sharing this read fail with it
                raise
            finally:
                for e in todo:
                    if self._reading.get(e) is done:
                        del self._reading[e]
            if len(self._seen) >= 65_536:
                self._seen.clear()
            # A change written here during the read may postdate what it got: stale at once.
            at = now if generation == self.generation else -math.inf
            for e, raw in zip(todo, got, strict=True):
                self._seen[e] = (at, raw.decode() if isinstance(raw, bytes) else raw)
            done.set_result(None)
        for other in others:
            await asyncio.shield(other)


class _SlotScripts(RedisScripts):
    """The single-node scripts on a cluster client: redis-py routes each call to the
    master of its keys' slot. A listing (counters, lease sets, run-time caps) is a
    SCAN of every master in turn, each to its cursor's end."""

    async def _scan_iter(self, pattern: str) -> AsyncIterator[Any]:
        client: RedisCluster = self.client  # type: ignore[assignment]
        await client.initialize()
        for node in client.get_primaries():
            cursor = 0
            while True:
                # On a cluster client: ({node name: next cursor}, keys).
                reply: Any = await client.scan(cursor, match=pattern, count=1000, target_nodes=node)
                cursors, keys = reply
                for key in keys:
                    yield key
                cursor = int(cursors[node.name])
                if cursor == 0:
                    break


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    slot: int
    positions: tuple[int, ...]  # of its ops in the charge
    ops: tuple[CounterOp, ...]


@dataclasses.dataclass(slots=True)
class _Split:
    """One op list split by slot, with its ops capped as last resolved."""

    ops: Sequence[CounterOp]
    slots: tuple[tuple[int, tuple[int, ...]], ...]
    wanted: tuple[_Entry, ...]  # the run-time entries its caps depend on
    groups: tuple[_Group, ...]
    caps: tuple[int, ...] | None = None  # resolved with run-time entries (None: not yet)
    fresh_until: float = 0.0
    generation: int = -1


class ClusterBackend:
    """Counters on a Redis Cluster; see the module docstring."""

    #: One slot charge may admit a call and charge its fixed price under two event
    #: ids (counters.with_cost), the cost's first counter counted within each slot's
    #: group (:func:`_event_of`): Governor.admitted(price=) takes one round trip.
    prices_at_admission = True

    def __init__(
        self,
        client: RedisCluster,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        caps_refresh: float = CAPS_REFRESH,
        require_epoch: bool = False,
    ) -> None:
        refresh = _refresh(caps_refresh)
        self.client = client
        # The single-node charge, routed by redis-py to its slot's master; each op's
        # cap is resolved here, the script adds its grant (lua/charge.lua 'g').
        self._node = _SlotScripts(
            client,  # type: ignore[arg-type]
            coalesce=False,
            timeout=timeout,
            resolved_caps=True,
            # require_epoch: each group's charge checks its own slot's marker.
            require_epoch=require_epoch,
            epoch_key=_epoch_of,
        )
        self._runtime = _RunTime(client, refresh)
        self._splits: dict[int, _Split] = {}
        # Busy is not down: redis-py refuses a command at once when its node's pool is
        # full (MaxConnectionsError), so slot charges queue here, in arrival order, for
        # at most QUEUE_TIMEOUT, IN_FLIGHT at most at once (never more than one node's
        # pool holds).
        pool = int(getattr(client, "connection_kwargs", {}).get("max_connections") or 1024)
        self._most = min(IN_FLIGHT, pool)
        self._gate: asyncio.Semaphore | None = None
        self._gate_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        caps_refresh: float = CAPS_REFRESH,
        require_epoch: bool = False,
        **kwargs: Any,
    ) -> ClusterBackend:
        refresh = _refresh(caps_refresh)  # a bad value is the error to see, before any client
        nodes = [ClusterNode(host, port) for host, port in parse_cluster_url(url)]
        kwargs.setdefault("max_connections", 1024)  # per node: a burst must not run out
        client = RedisCluster(
            startup_nodes=nodes,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **kwargs,
        )
        return cls(client, timeout=timeout, caps_refresh=refresh, require_epoch=require_epoch)

    def _split(self, ops: Sequence[CounterOp]) -> _Split:
        """``ops`` by slot, cached by the op list's identity (the governor reuses one
        tuple per context and minute; the entry keeps it alive, checked with ``is``)."""
        hit = self._splits.get(id(ops))
        if hit is not None and hit.ops is ops:
            return hit
        by_slot: dict[int, list[int]] = {}
        for i, op in enumerate(ops):
            by_slot.setdefault(key_slot(op.key.encode()), []).append(i)
        slots = tuple((slot, tuple(pos)) for slot, pos in by_slot.items())
        # Until run-time entries are read: each counter against its cap by the policy.
        groups = tuple(
            _Group(slot, pos, tuple(_policy_capped(ops[i]) for i in pos)) for slot, pos in slots
        )
        split = _Split(ops, slots, _wanted(ops), groups)
        if len(self._splits) >= 8192:
            self._splits.clear()
        self._splits[id(ops)] = split
        return split

    @contextlib.asynccontextmanager
    async def _slot(self, *, bounded: bool = True) -> AsyncIterator[None]:
        """Hold one of the client's connections for a slot charge (a take-back waits
        as long as it takes: it undoes a hold and must not be refused)."""
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate_loop is not loop:
            self._gate, self._gate_loop = asyncio.Semaphore(self._most), loop
        gate = self._gate
        if not bounded:
            await gate.acquire()
        else:
            try:
                async with asyncio.timeout(QUEUE_TIMEOUT):
                    await gate.acquire()
            except TimeoutError:
                raise BackendBusyError(
                    "redis",
                    f"{self._most} slot charges in flight for {QUEUE_TIMEOUT:g}s; "
                    "this check was not sent",
                ) from None
        try:
            yield
        finally:
            gate.release()

    async def _groups_of(self, ops: Sequence[CounterOp]) -> tuple[_Group, ...]:
        """The slot groups of ``ops``, each op capped by its effective cap (caps.effective
        over run-time entries at most ``caps_refresh`` seconds old; the script adds grants)."""
        split = self._split(ops)
        if not split.wanted:  # nothing run-time: the policy's caps (and the grants) decide
            return split.groups
        now = self._node.clock()
        runtime = self._runtime
        if now < split.fresh_until and split.generation == runtime.generation:
            return split.groups
        generation = runtime.generation
        values, fresh = await runtime.read(split.wanted, now)
        caps, holds = _resolved(ops, values, now)
        if caps != split.caps:
            split.groups = tuple(
                _Group(
                    slot,
                    pos,
                    tuple(dataclasses.replace(ops[i], cap=caps[i], ref=None) for i in pos),
                )
                for slot, pos in split.slots
            )
            split.caps = caps
        split.fresh_until = min(fresh, holds)
        split.generation = generation
        return split.groups

    async def charge(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
        lease: str | None = None,
        lease_ttl: float = 0.0,
    ) -> ChargeResult:
        groups = await self._groups_of(ops)
        whole = Charge(ops, event_id, want_used, op_id, lease, lease_ttl)

        async def one(g: _Group, tag_op: str | None) -> ChargeResult:
            tagged = None if tag_op is None else tag_op + slot_tag(g.slot)
            event = _event_of(event_id, g.positions)
            async with self._slot():
                return await self._node.charge_with(
                    whole._replace(ops=g.ops, event_id=event, op_id=tagged)
                )

        if len(groups) == 1:
            result: ChargeResult = await one(groups[0], op_id)  # one slot: as on one Redis
            return result

        outcomes: list[ChargeResult | BaseException | None]
        for attempt in range(1 + RETRIES):
            # Each attempt (and its take-back) has operation markers of its own: a
            # marker left by a taken-back attempt must not make the next one a no-op.
            tag_op = op_id if op_id is None or attempt == 0 else f"{op_id}-{attempt}"
            if attempt == 0:  # all at once: one round trip of wall time
                outcomes = list(
                    await asyncio.gather(*(one(g, tag_op) for g in groups), return_exceptions=True)
                )
            else:  # contended: two round trips, no hold on the shared counter taken back
                outcomes = await _in_two_steps(groups, one, tag_op)
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            refused = [
                g.positions[o.refused]
                for g, o in zip(groups, outcomes, strict=True)
                if isinstance(o, ChargeResult) and not o.admitted
            ]
            if failed is None and not refused:
                break
            admitted = [
                g
                for g, o in zip(groups, outcomes, strict=True)
                if isinstance(o, ChargeResult) and o.admitted
            ]
            await self._take_back(admitted, event_id, tag_op, lease)
            if failed is not None:
                log.warning("a slot group's charge failed, the others taken back: %r", failed)
                raise failed
            if not admitted:
                break  # every group refused: no hold of ours was in anyone's way
            # Mixed: the refusing counter may have been full of other checks'
            # transient holds; once they are taken back it may fit (docs/cluster.md).
            await asyncio.sleep(0)
        if not want_used or None in outcomes:  # refused before the broadest was read
            return ChargeResult(min(refused) if refused else -1, ())
        used = [0] * len(ops)
        caps = [0] * len(ops)
        for g, o in zip(groups, outcomes, strict=True):
            assert isinstance(o, ChargeResult)
            for pos, u in zip(g.positions, o.used, strict=False):
                used[pos] = u
            for pos, c in zip(g.positions, o.caps, strict=False):
                caps[pos] = c  # the effective cap plus the grant, as the script compared
        return ChargeResult(min(refused) if refused else -1, tuple(used), tuple(caps))

    async def _take_back(
        self, groups: Sequence[_Group], event_id: str | None, op_id: str | None, lease: str | None
    ) -> None:
        """Undo the charges of ``groups`` (their check was refused elsewhere)."""

        async def undo(g: _Group) -> None:
            kept = [
                (pos, op)
                for pos, op in zip(g.positions, g.ops, strict=True)
                if op.amount and not op.key.startswith(LEASE_PREFIX)
            ]
            back = tuple(
                dataclasses.replace(op, amount=-op.amount, enforce=False) for _, op in kept
            )
            leases = [op.key for op in g.ops if op.key.startswith(LEASE_PREFIX)]
            if back:
                async with self._slot(bounded=False):
                    await self._node.charge(
                        back,
                        event_id=_event_of(event_id, [pos for pos, _ in kept]),
                        want_used=False,
                        op_id=None if op_id is None else f"{op_id}-back{slot_tag(g.slot)}",
                    )
                if event_id is not None:
                    # The take-back leaves the event's in-flight entries at 0: drop them,
                    # or a refused check (in the ledger, charging nothing here) would
                    # leave entries no apply ever moves (stale in reconcile's eyes).
                    ids = [e for e in owners(event_id)[:2] if e is not None]
                    await self.client.eval(
                        _FORGET, len(back), *(op.key for op in back), *(f"e:{e}" for e in ids)
                    )
            if leases and lease is not None:
                await self._node.release(leases, lease)

        outcomes = await asyncio.gather(*(undo(g) for g in groups), return_exceptions=True)
        for g, o in zip(groups, outcomes, strict=True):
            if isinstance(o, BaseException):
                log.error(
                    "could not take back a refused check's hold on slot %d (%s): %s",
                    g.slot,
                    ", ".join(op.key for op in g.ops),
                    o,
                )

    async def change(self, changes: Sequence[Change]) -> None:
        """Apply run-time changes directly (no ledger): one lua/change.lua call per slot
        of the keys they write, all at once. This process's copy of the run-time
        entries is dropped, so its next check reads them again."""
        if not changes:
            return
        by_slot: dict[int, list[Change]] = {}
        for c in changes:
            by_slot.setdefault(key_slot(c.key.encode()), []).append(c)

        async def one(share: Sequence[Change]) -> None:
            keys: list[str] = []
            tokens = change_tokens(share, keys, {})
            await self._node._run(self._node._change, keys, (tokens, self._node._now_ms()))

        try:
            await asyncio.gather(*(one(share) for share in by_slot.values()))
        except redis_errors.ResponseError as exc:
            if "mcpbg change:" not in str(exc):
                raise
            raise ValueError(str(exc)) from None
        finally:
            self._runtime.drop()

    async def grants_of(self, keys: Sequence[str]) -> list[int]:
        """Each counter's grant (0 when none)."""
        return await self._node.grants_of(keys)

    async def grant_reason(self, key: str) -> str:
        """The why token (``caps.why_token``) of the counter's last grant or reset."""
        return await self._node.grant_reason(key)

    async def grants(self, limit: int) -> list[tuple[str, int, str]]:
        """Up to ``limit`` counters holding a grant, on every master (``mcpbg caps list``)."""
        return await self._node.grants(limit)

    async def overrides(self) -> tuple[dict[str, dict[str, tuple[int, int, str]]], dict[str, str]]:
        """The run-time value caps and plan assignments as they are now (read from every
        master, not this process's copy): ``mcpbg budgets`` and ``caps list``."""
        return await self._node.overrides()

    async def lease_keys(self, limit: int) -> list[str]:
        """Up to ``limit`` lease sets, on every master."""
        return await self._node.lease_keys(limit)

    async def usage(self, keys: Sequence[str]) -> list[int]:
        by_slot: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_slot.setdefault(key_slot(key.encode()), []).append(i)
        out = [0] * len(keys)
        parts = await asyncio.gather(
            *(self._node.usage([keys[i] for i in pos]) for pos in by_slot.values())
        )
        for pos, got in zip(by_slot.values(), parts, strict=True):
            for i, v in zip(pos, got, strict=True):
                out[i] = v
        return out

    async def release(self, keys: Sequence[str], lease: str) -> int:
        return sum(await asyncio.gather(*(self._node.release([k], lease) for k in keys)))

    async def renew(self, keys: Sequence[str], lease: str, ttl: float) -> int:
        return sum(await asyncio.gather(*(self._node.renew([k], lease, ttl) for k in keys)))

    async def in_progress(self, keys: Sequence[str]) -> list[int]:
        return [n for k in keys for n in await self._node.in_progress([k])]

    async def apply(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool = False,
        through: int = -1,
    ) -> int:
        """Project ``events`` exactly once per slot group, then move the resume watermark.

        Each event's charges (and run-time changes) are split by the slot of
        their keys; each slot's share is one ``lua/apply.lua`` call with a
        watermark hash, an epoch marker and seen-id sets of that slot
        (:func:`slot_tag`), so a slot skips what it applied before on its own,
        and a retried batch that landed on some slots only lands on the rest.
        With ``require_epoch`` a slot whose marker is missing (its shard
        restarted empty) applies nothing and :class:`EpochMissingError` is
        raised once the others landed; the resume watermark
        (``keys.WATERMARK_KEY``, where the worker reads from) moves only after
        every slot's share landed. Returns the most events any slot applied.
        """
        return await self._project(partition, events, require_epoch=require_epoch, through=through)

    async def _project(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool,
        through: int,
        only: Set[int] | None = None,
    ) -> int:
        """:meth:`apply`; ``only``: apply the share of these slots alone and, unless they
        are every slot, leave the resume watermark as it is (the rebuild of lost
        slots, :class:`LostSlots`)."""
        if not events and through < 0:
            return 0
        by_slot: dict[int, list[AppliedEvent]] = {}
        for event in events:
            parts: dict[int, tuple[list[AppliedCharge], list[Change]]] = {}
            for charge in event.charges:
                parts.setdefault(key_slot(charge.key.encode()), ([], []))[0].append(charge)
            for change in event.changes:
                parts.setdefault(key_slot(change.key.encode()), ([], []))[1].append(change)
            # An approval's spent marker is applied in its own slot (lua/apply.lua).
            spent: dict[int, list[tuple[str, int]]] = {}
            for once, until in event.spent:
                slot = key_slot(f"{SPENT_PREFIX}:{once}".encode())
                parts.setdefault(slot, ([], []))
                spent.setdefault(slot, []).append((once, until))
            for slot, (charges, changes) in parts.items():
                if only is not None and slot not in only:
                    continue
                by_slot.setdefault(slot, []).append(
                    dataclasses.replace(
                        event,
                        charges=tuple(charges),
                        changes=tuple(changes),
                        spent=tuple(spent.get(slot, ())),
                    )
                )
        now_ms = str(int(self._node.clock() * 1000))
        calls = [
            apply_args(
                partition,
                share,
                require_epoch=require_epoch,
                through=-1,
                now_ms=now_ms,
                tag=slot_tag(slot),
            )
            for slot, share in by_slot.items()
        ]
        applied = await self._apply_slots(calls)
        lost = sorted(slot for slot, n in zip(by_slot, applied, strict=True) if n < 0)
        if lost:
            raise EpochMissingError(
                f"{len(lost)} slot(s) of the cluster lost their state (epoch marker missing; "
                f"slot {lost[0]} first): rebuild them"
            )
        if only is not None and len(only) < SLOTS:
            return max(applied, default=0)  # the other slots have not applied this batch
        last = max([through, *(e.offset for e in events)])
        try:
            await self.client.eval(_RAISE_WATERMARK, 1, WATERMARK_KEY, partition, last)
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return max(applied, default=0)

    async def _apply_slots(self, calls: Sequence[tuple[list[str], list[Any]]]) -> list[int]:
        """Run lua/apply.lua once per slot, pipelined: one round trip per master, one
        connection each (a batch may touch thousands of slots)."""
        script = self._node._apply
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for command, body in (("EVALSHA", script.sha), ("EVAL", script.script)):
            if not todo:
                break
            try:
                async with self.client.pipeline() as pipe:
                    for i in todo:
                        keys, args = calls[i]
                        pipe.execute_command(command, body, len(keys), *keys, *args)
                    got = await pipe.execute(raise_on_error=False)
            except _UNAVAILABLE as exc:
                raise BackendUnavailableError.redis(exc) from exc
            for i, reply in zip(todo, got, strict=True):
                replies[i] = reply
            # A node without the script (restarted, failed over): EVAL there.
            todo = [i for i in todo if isinstance(replies[i], redis_errors.NoScriptError)]
        out = []
        for reply in replies:
            if isinstance(reply, redis_errors.ResponseError) and "mcpbg apply:" in str(reply):
                refused = refused_event(str(reply))
                if refused is not None:  # that slot wrote nothing; the others' watermarks moved
                    raise refused
                raise ValueError(str(reply))  # a key of no counter's shape: that slot wrote nothing
            if isinstance(reply, _UNAVAILABLE):
                raise BackendUnavailableError.redis(reply)
            if isinstance(reply, BaseException):
                raise reply
            out.append(int(reply))
        return out

    async def watermark(self, partition: str) -> int:
        """Where the worker resumes ``partition`` from, less one (-1: none)."""
        try:
            raw = await self.client.hget(WATERMARK_KEY, partition)
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return -1 if raw is None else int(raw)

    async def lost_slots(self) -> set[int]:
        """The slots whose epoch marker is missing or not whole: their shard restarted
        empty (or was flushed) since the last rebuild marked them ready."""
        try:
            async with self.client.pipeline() as pipe:
                for slot in range(SLOTS):
                    pipe.get(epoch_key(slot))
                got = await pipe.execute(raise_on_error=False)  # WRONGTYPE: not whole
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return {slot for slot, value in enumerate(got) if not _whole(value)}

    async def has_epoch(self) -> bool:
        """Whether every slot's epoch marker is whole (:meth:`lost_slots` is empty)."""
        return not await self.lost_slots()

    async def mark_ready(self, epoch: str, *, slots: Set[int] | None = None) -> None:
        """Declare the counters of ``slots`` (default: every slot) complete."""
        if not isinstance(epoch, str) or EPOCH_VALUE.fullmatch(epoch) is None:
            raise InvalidInputError("epoch", epoch, f"expected {EPOCH_VALUE.pattern}")
        try:
            async with self.client.pipeline() as pipe:
                for slot in sorted(range(SLOTS) if slots is None else slots):
                    pipe.set(epoch_key(slot), epoch)
                await pipe.execute()
        except _UNAVAILABLE as exc:
            raise BackendUnavailableError.redis(exc) from exc

    async def lost(self) -> LostSlots:
        """The slots to rebuild (:meth:`lost_slots`), as the backend a rebuild applies to."""
        return LostSlots(self, frozenset(await self.lost_slots()))

    async def state(self, key: str) -> CounterState:
        return await self._node.state(key)

    async def counter_keys(self, limit: int, *, match: str | None = None) -> list[str]:
        return await self._node.counter_keys(limit, match=match)

    async def aclose(self) -> None:
        await close_best_effort(self.client.aclose())


class LostSlots(ApplyOnly):
    """The slots of a cluster whose shard restarted empty, as the backend the worker's
    rebuild (``stream/rebuild.py``) replays the topic into.

    Only each event's share in these slots is applied (the other slots are
    neither read nor written), the resume watermark is left where it is (the
    intact slots have not applied what the rebuild reads past it; when every
    slot was lost it moves as in :meth:`ClusterBackend.apply`), and
    ``mark_ready`` sets the markers of these slots only.
    """

    def __init__(self, backend: ClusterBackend, slots: frozenset[int]) -> None:
        self.backend = backend
        self.slots = slots

    async def apply(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool = False,
        through: int = -1,
    ) -> int:
        return await self.backend._project(
            partition, events, require_epoch=False, through=-1, only=self.slots
        )

    async def has_epoch(self) -> bool:
        return not (await self.backend.lost_slots()) & self.slots

    async def mark_ready(self, epoch: str) -> None:
        await self.backend.mark_ready(epoch, slots=self.slots)

    async def state(self, key: str) -> CounterState:
        return await self.backend.state(key)

    async def counter_keys(self, limit: int, *, match: str | None = None) -> list[str]:
        return await self.backend.counter_keys(limit, match=match)

    async def aclose(self) -> None:
        return None  # the backend is the worker's
