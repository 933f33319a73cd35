"""Process-local counters: the same model as the Redis scripts, in a dict.

Pure, so the core may use it: ``Governor(policy)`` counts here by default
(``projections.counters.memory`` names it beside the other stores).

Correct for one replica and in tests, and the per-replica fallback a fail-open
limit uses while Redis is unreachable. Operations never await, so under
asyncio each one is atomic just as a Lua script is in Redis.

Expired entries (counters, operation markers, seen-id sets) are evicted as
Redis expires keys: each write first drops whatever a heap of expiry times
says has ended, so memory follows the live buckets, never every bucket ever
written, without a background task (amortised O(log n) per entry).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mcp_budget_governor.backends.base import KeyValueOps
from mcp_budget_governor.caps import Change, ChangeKind, Effective, effective, why_token
from mcp_budget_governor.counters import (
    AppliedEvent,
    ChargeResult,
    CounterOp,
    CounterState,
    apply_problem,
    fits,
    grant_problem,
    hold_problem,
    overflow,
    owners,
    stays_exact,
)
from mcp_budget_governor.errors import EpochMissingError, EventRefusedError, InvalidInputError
from mcp_budget_governor.keys import (
    INTERNAL_PREFIX,
    LEASE_PREFIX,
    OP_HORIZON_SECONDS,
    SPENT_PREFIX,
    pattern_regex,
)

# What an expiry-heap entry names.
_COUNTER, _OP, _SEEN = 0, 1, 2


@dataclass(slots=True)
class _Counter:
    committed: int = 0
    in_flight: int = 0
    pending: dict[str, int] = field(default_factory=dict)
    expire_at: float = float("inf")
    grant: int = 0


class MemoryBackend(KeyValueOps):
    """In-process counters with expiry, for a single replica or tests.

    ``clock`` (epoch seconds): a backend made without one follows the clock of
    the :class:`Governor` it is given to (``adopt_clock``), so the windows the
    governor picks and the expiries they carry agree. It also answers the
    calls of mcp-budget-governor 0.1.0's backends (``backends.base``).

    >>> import asyncio
    >>> from mcp_budget_governor import Governor, Limit, Policy, Window
    >>> gov = Governor(Policy.of(Limit("calls", cap=1, window=Window.DAY)), MemoryBackend())
    >>> [asyncio.run(gov.check()).admitted for _ in range(2)]
    [True, False]
    """

    #: One charge may admit a call and charge its fixed price under two event ids
    #: (counters.with_cost): Governor.admitted(price=) then takes one round trip.
    prices_at_admission = True

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = time.time if clock is None else clock
        self._own_clock = clock is not None
        self._counters: dict[str, _Counter] = {}
        self._watermarks: dict[str, int] = {}
        # day -> (applied event ids, expire_at): the seen-id sets of apply.lua
        self._seen: dict[str, tuple[set[str], int]] = {}
        # reservation id -> (counter key -> estimate, expire_at): the open reservations
        # the projection holds (counters.Holds; lua/apply.lua keeps the same)
        self._holds: dict[str, tuple[dict[str, int], int]] = {}
        # operation id -> expire_at: the markers of applied inline charges (lua/charge.lua)
        self._ops: dict[str, float] = {}
        # (expire_at, kind, key) min-heap: what may be evicted when. An entry whose
        # target has since moved its expiry is stale and skipped when popped.
        self._expiry: list[tuple[float, int, str]] = []
        self._epoch: str | None = None
        # caps hash key -> scope field -> (cap, until): the run-time value caps
        self._caps: dict[str, dict[str, tuple[int, int]]] = {}
        # assignment field -> plan: the run-time plan assignments
        self._plans: dict[str, str] = {}
        # caps key or counter key -> field ("" for a grant) -> why (caps.why_token)
        self._why: dict[tuple[str, str], str] = {}
        # lease set key -> lease id -> expiry (epoch seconds): lua/lib.lua's lease sets
        self._leases: dict[str, dict[str, float]] = {}
        # lease set key -> waiting ticket -> (arrival, deadline): lib.lua's queues,
        # in arrival order (dicts keep insertion order)
        self._queues: dict[str, dict[str, tuple[float, float]]] = {}

    def _now(self) -> float:
        return self._clock()

    def _kv_now(self) -> float:
        return self._now()

    def adopt_clock(self, clock: Callable[[], float]) -> None:
        """Use ``clock`` from now on, unless this backend was made with its own."""
        if not self._own_clock:
            self._clock = clock

    async def _kv_release(self, key: str, amount: int) -> None:
        counter = self._get(key, self._now())
        if counter is not None:  # in one step: nothing else runs in between
            counter.committed -= min(max(amount, 0), max(counter.committed, 0))

    def _live(self, key: str, now: float) -> dict[str, float]:
        """The live leases of a set, the expired ones dropped (lib.lua live_leases)."""
        held = self._leases.get(key)
        if held is None:
            return {}
        for lease_id in [i for i, until in held.items() if until <= now]:
            del held[lease_id]
        if not held:
            del self._leases[key]
        return held

    def _ahead(self, key: str, ticket: str | None, room: int, now: float) -> int:
        """Live waiters before ``ticket`` (None: all) in the queue of lease set ``key``,
        at most ``room`` (lib.lua waiters_ahead)."""
        queue = self._queues.get(key)
        if not queue:
            return 0
        for t in [t for t, (_, until) in queue.items() if until <= now]:
            del queue[t]
        ahead = 0
        for t in queue:
            if t == ticket or ahead >= room:
                break
            ahead += 1
        return ahead

    def _evict(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, kind, key = heapq.heappop(heap)
            if kind == _COUNTER:
                counter = self._counters.get(key)
                if counter is not None and counter.expire_at <= now:
                    del self._counters[key]
            elif kind == _OP:
                if self._ops.get(key, now) <= now:
                    self._ops.pop(key, None)
            else:
                entry = self._seen.get(key)
                if entry is not None and entry[1] <= now:
                    del self._seen[key]

    def _get(self, key: str, now: float) -> _Counter | None:
        counter = self._counters.get(key)
        if counter is not None and counter.expire_at <= now:
            del self._counters[key]
            return None
        return counter

    def _used(self, key: str, now: float) -> int:
        counter = self._get(key, now)
        return 0 if counter is None else counter.committed + counter.in_flight

    def _add(self, key: str, amount: int, event_id: str | None, expire_at: int, now: float) -> None:
        counter = self._get(key, now)
        if counter is None:
            counter = self._counters[key] = _Counter()
        if event_id is None:
            counter.committed += amount
        else:
            counter.in_flight += amount
            counter.pending[event_id] = counter.pending.get(event_id, 0) + amount
        if counter.expire_at != expire_at:
            counter.expire_at = expire_at
            heapq.heappush(self._expiry, (expire_at, _COUNTER, key))

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
        now = self._now()
        self._evict(now)
        if op_id is not None and event_id is None:
            if self._ops.get(op_id, now) > now:
                return ChargeResult(-1, ())  # applied before: a replay changes nothing
        else:
            op_id = None
        # As lua/charge.lua: exactness first, then the refusal, then the admitted amounts.
        inline = event_id is None
        parts = []
        for op in ops:
            if lease is not None and op.key.startswith(LEASE_PREFIX):
                parts.append((len(self._live(op.key, now)), 0))
                continue
            counter = self._get(op.key, now)
            c, f = (0, 0) if counter is None else (counter.committed, counter.in_flight)
            if not stays_exact(c, f, 0, inline=inline):
                raise overflow(op.key, op.amount)
            parts.append((c, f))
        used = tuple(c + f for c, f in parts)
        room = [self._effective(op, now).room_cap for op in ops]
        # As the script's reply: the caps come back only when some op asked for resolving.
        caps = tuple(room) if any(op.ref is not None for op in ops) else ()
        queued = [lease is not None and op.key.startswith(LEASE_PREFIX) for op in ops]
        refused = -1
        for i, (op, total) in enumerate(zip(ops, used, strict=True)):
            waiting = 0
            if queued[i] and room[i] > total:
                waiting = self._ahead(op.key, ticket, room[i] - total, now)
            if refused < 0 and op.enforce and not fits(total + waiting, op.amount, room[i]):
                refused = i
        if refused >= 0:
            if ticket is not None and queued[refused]:
                wait_s = int(ticket.rsplit("/", 1)[1]) / 1000
                for op, q in zip(ops, queued, strict=True):
                    if q:
                        self._queues.setdefault(op.key, {}).setdefault(ticket, (now, now + wait_s))
            return ChargeResult(refused, used, caps)
        leased = lease is not None
        for op, (c, f) in zip(ops, parts, strict=True):
            if not (leased and op.key.startswith(LEASE_PREFIX)) and not stays_exact(
                c, f, op.amount, inline=inline
            ):
                raise overflow(op.key, op.amount)
        wrote = False
        # An admission charging the call's price too: ops from cost_from on are the
        # cost event's in-flight amounts (lua/charge.lua, counters.with_cost).
        cost_id, cost_from = None, None
        if event_id is not None:
            event_id, cost_id, cost_from = owners(event_id)
        for i, op in enumerate(ops):
            if lease is not None and op.key.startswith(LEASE_PREFIX):
                self._leases.setdefault(op.key, {})[lease] = now + lease_ttl
                if ticket is not None:
                    self._queues.get(op.key, {}).pop(ticket, None)
            elif op.amount:
                owner = cost_id if cost_from is not None and i >= cost_from else event_id
                self._add(op.key, op.amount, owner, op.expire_at, now)
                wrote = True
        if op_id is not None and wrote:
            until = now + OP_HORIZON_SECONDS
            self._ops[op_id] = until
            heapq.heappush(self._expiry, (until, _OP, op_id))
        return ChargeResult(-1, used, caps)

    def _effective(self, op: CounterOp, now: float) -> Effective:
        """The op's effective cap and grant (``caps.effective``, as lua/charge.lua)."""
        if op.ref is None:  # nothing to resolve: the script reads no grant either
            return Effective(op.cap, 0, "default")
        counter = self._get(op.key, now)
        grant = 0 if counter is None else counter.grant
        runtime = self._caps.get(op.ref.caps_key, {}).get(op.ref.field) if op.ref.field else None
        return effective(
            op.ref, op.cap, runtime=runtime, assigned=self._plans, grant=grant, now=now
        )

    def _change(self, change: Change, now: float) -> None:
        """Apply one run-time change (lua/lib.lua: apply_change)."""
        kind = change.kind
        why = why_token(change.actor, change.reason)
        if kind in (ChangeKind.CAP_SET, ChangeKind.GRANTED, ChangeKind.RESET):
            self._why[(change.key, change.field)] = why
        if kind is ChangeKind.CAP_SET:
            self._caps.setdefault(change.key, {})[change.field] = (change.amount, change.until)
        elif kind is ChangeKind.CAP_UNSET:
            self._caps.get(change.key, {}).pop(change.field, None)
        elif kind is ChangeKind.PLAN_ASSIGNED:
            if change.plan is None:
                self._plans.pop(change.field, None)
            else:
                self._plans[change.field] = change.plan
        elif change.until > now:  # a grant or reset of a bucket still alive
            counter = self._get(change.key, now)
            if counter is None:
                counter = self._counters[change.key] = _Counter()
            if kind is ChangeKind.GRANTED:
                counter.grant += change.amount
            else:
                counter.grant = change.amount
            if counter.expire_at != change.until:
                counter.expire_at = change.until
                heapq.heappush(self._expiry, (change.until, _COUNTER, change.key))

    async def change(self, changes: Sequence[Change]) -> None:
        """Apply run-time changes directly (no ledger), all in one step."""
        self.change_at(changes, self._now())

    def change_at(self, changes: Sequence[Change], now: float) -> None:
        """:meth:`change` at clock ``now`` (epoch seconds), synchronously: what
        ``mcpbg reconcile`` folds the ledger's run-time changes with."""
        self._evict(now)
        why = self._grants_problem(changes, now)
        if why is not None:  # all or none: nothing is written
            raise InvalidInputError("change", why[1], why[0])
        for c in changes:
            self._change(c, now)

    def _grants_problem(
        self, changes: Sequence[Change], now: float, grants: dict[str, int] | None = None
    ) -> tuple[str, int] | None:
        """Why ``changes`` would take a counter's grant past the exact range, and the
        amount (None: they fit); ``grants`` carries a batch's grants so far."""
        grants = {} if grants is None else grants
        for c in changes:
            if c.kind not in (ChangeKind.GRANTED, ChangeKind.RESET) or c.until <= now:
                continue
            if c.key not in grants:
                counter = self._get(c.key, now)
                grants[c.key] = 0 if counter is None else counter.grant
            if c.kind is ChangeKind.RESET:
                grants[c.key] = c.amount
                continue
            why = grant_problem(c.key, grants[c.key], c.amount)
            if why is not None:
                return why, c.amount
            grants[c.key] += c.amount
        return None

    async def overrides(self) -> tuple[dict[str, dict[str, tuple[int, int, str]]], dict[str, str]]:
        """The run-time value caps (caps key -> field -> (cap, until, why)) and assignments."""
        return self.overrides_now()

    def overrides_now(self) -> tuple[dict[str, dict[str, tuple[int, int, str]]], dict[str, str]]:
        """:meth:`overrides`, synchronously."""
        caps = {
            k: {f: (c, u, self._why.get((k, f), "-")) for f, (c, u) in v.items()}
            for k, v in self._caps.items()
            if v
        }
        return caps, dict(self._plans)

    def granted(self, now: float) -> dict[str, tuple[int, int, str]]:
        """The counters alive at ``now`` that a grant or reset wrote: key -> (grant,
        expire_at, why token of the last one)."""
        return {
            key: (c.grant, int(c.expire_at), self._why[(key, "")])
            for key, c in self._counters.items()
            if c.expire_at > now and (key, "") in self._why
        }

    async def grants_of(self, keys: Sequence[str]) -> list[int]:
        """Each counter's grant (0 when none)."""
        now = self._now()
        return [0 if (c := self._get(k, now)) is None else c.grant for k in keys]

    async def grant_reason(self, key: str) -> str:
        """The why token (``caps.why_token``) of the counter's last grant or reset."""
        return self._why.get((key, ""), "-")

    async def release(self, keys: Sequence[str] | str, lease: str | int) -> int:
        """Give lease ``lease`` back on every set in ``keys``; how many held it.

        ``release(key, amount)`` (one key, an amount): mcp-budget-governor 0.1.0's
        give-back, never below zero nor creating the key; returns 0."""
        if isinstance(keys, str):
            await self._kv_release(keys, int(lease))
            return 0
        assert isinstance(lease, str)
        now = self._now()
        found = 0
        for key in keys:
            held = self._live(key, now)
            if held.pop(lease, None) is not None:
                found += 1
            if not held:
                self._leases.pop(key, None)
        return found

    async def renew(self, keys: Sequence[str], lease: str, ttl: float) -> int:
        """Extend lease ``lease`` to now + ``ttl`` where it is still alive; how many."""
        now = self._now()
        renewed = 0
        for key in keys:
            held = self._live(key, now)
            if lease in held:
                held[lease] = now + ttl
                renewed += 1
        return renewed

    async def leave(self, keys: Sequence[str], ticket: str) -> int:
        """Take waiting ticket ``ticket`` out of the queues of lease sets ``keys``."""
        return sum(self._queues.get(k, {}).pop(ticket, None) is not None for k in keys)

    async def in_progress(self, keys: Sequence[str]) -> list[int]:
        """How many live leases each set holds (calls in progress)."""
        now = self._now()
        return [len(self._live(key, now)) for key in keys]

    async def lease_keys(self, limit: int) -> list[str]:
        """Up to ``limit`` lease sets holding a live lease, sorted."""
        now = self._now()
        return sorted(k for k in list(self._leases) if self._live(k, now))[: max(limit, 0)]

    async def usage(self, keys: Sequence[str]) -> list[int]:
        now = self._now()
        return [self._used(key, now) for key in keys]

    async def apply(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool = False,
        through: int = -1,
    ) -> int:
        if require_epoch and self._epoch is None:
            raise EpochMissingError("the counters were reset (no epoch marker): rebuild first")
        now = self._now()
        self._evict(now)
        mark = self._watermarks.get(partition, -1)
        refused = self._refusal(events, mark, now)
        if refused is not None:  # all or none: nothing of the batch is written
            raise refused
        applied = 0
        for event in events:
            if event.offset <= mark:
                continue
            mark = event.offset
            if not self._first_sight(event, now):
                continue
            for charge in event.charges:
                counter = self._get(charge.key, now)
                if counter is not None and event.event_id in counter.pending:
                    counter.in_flight -= counter.pending.pop(event.event_id)
                if charge.expire_at > now:
                    self._add(charge.key, charge.amount, None, charge.expire_at, now)
            for once, until in event.spent:  # approval.spend_op's marker, now committed
                marker = f"{SPENT_PREFIX}:{once}"
                counter = self._get(marker, now)
                if counter is not None and event.event_id in counter.pending:
                    counter.in_flight -= counter.pending.pop(event.event_id)
                if until + 1 > now:
                    self._add(marker, 1, None, until + 1, now)
            live = [c for c in event.charges if c.expire_at > now]
            if event.opens and live:
                ends = max(c.expire_at for c in live)
                if len(self._holds) >= 65_536:  # reservations never closed: dropped when over
                    self._holds = {r: h for r, h in self._holds.items() if h[1] > now}
                self._holds[event.event_id] = ({c.key: c.amount for c in live}, ends)
            elif event.closes:
                self._holds.pop(event.closes, None)
            for change in event.changes:
                self._change(change, now)
            applied += 1
        if events or through >= 0:
            self._watermarks[partition] = max(mark, through)
        return applied

    def _refusal(
        self, events: Sequence[AppliedEvent], mark: int, now: float
    ) -> EventRefusedError | None:
        """The first fresh event of a batch whose sums would leave the range
        (counters.apply_problem, grant_problem), as lua/apply.lua checks it first."""
        committed: dict[str, int] = {}
        flight: dict[str, int] = {}
        grants: dict[str, int] = {}
        holds: dict[str, dict[str, int] | None] = {}  # opened or closed in this batch
        spent: set[str] = set()  # approvals the batch spends
        ids: set[str] = set()
        for event in events:
            if event.offset <= mark:
                continue
            mark = event.offset
            entry = self._seen.get(event.seen_day)
            if event.event_id in ids or (
                entry is not None and entry[1] > now and event.event_id in entry[0]
            ):
                continue
            ids.add(event.event_id)
            live = [c for c in event.charges if c.expire_at > now]
            if event.closes is not None:
                held = holds.get(event.closes, self._held(event.closes, now))
                why = hold_problem(event.closes, held, live)
                if why is not None:
                    return EventRefusedError(event.offset, why)
                if event.closes:
                    holds[event.closes] = None
            if event.opens and live:
                holds[event.event_id] = {c.key: c.amount for c in live}
            for once, _until in event.spent:
                marker = self._get(f"{SPENT_PREFIX}:{once}", now)
                if once in spent or (marker is not None and marker.committed > 0):
                    return EventRefusedError(event.offset, f"approval {once}: spent already")
                spent.add(once)
            for charge in event.charges:
                key = charge.key
                counter = self._get(key, now)
                if key not in committed:
                    committed[key] = 0 if counter is None else counter.committed
                    flight[key] = 0 if counter is None else counter.in_flight
                if counter is not None and event.event_id in counter.pending:
                    flight[key] -= counter.pending[event.event_id]
                if charge.expire_at > now:
                    why = apply_problem(key, committed[key], flight[key], charge.amount)
                    if why is not None:
                        return EventRefusedError(event.offset, why)
                    committed[key] += charge.amount
            found = self._grants_problem(event.changes, now, grants)
            if found is not None:
                return EventRefusedError(event.offset, found[0])
        return None

    def _held(self, reservation: str, now: float) -> dict[str, int] | None:
        found = self._holds.get(reservation)
        if found is None or found[1] <= now:
            self._holds.pop(reservation, None)
            return None
        return found[0]

    def _first_sight(self, event: AppliedEvent, now: float) -> bool:
        day = event.seen_day
        entry = self._seen.get(day)
        if entry is None or entry[1] <= now:
            entry = self._seen[day] = (set(), event.seen_expire_at)
            heapq.heappush(self._expiry, (entry[1], _SEEN, day))
        if event.event_id in entry[0]:
            return False
        entry[0].add(event.event_id)
        return True

    async def state(self, key: str) -> CounterState:
        counter = self._get(key, self._now())
        if counter is None:
            return CounterState(0, 0, {})
        return CounterState(
            counter.committed, counter.in_flight, dict(counter.pending), counter.grant
        )

    async def watermark(self, partition: str) -> int:
        """The last applied offset of a partition, -1 when none."""
        return self._watermarks.get(partition, -1)

    def keys(self) -> list[str]:
        """Every live counter key (for reports and tests)."""
        now = self._now()
        return [k for k in list(self._counters) if self._get(k, now) is not None]

    async def counter_keys(self, limit: int, *, match: str | None = None) -> list[str]:
        """Up to ``limit`` live counter keys, sorted; ``match``: a ``keys.key_pattern``."""
        keys = (k for k in self.keys() if not k.startswith(INTERNAL_PREFIX))
        if match is not None:
            regex = pattern_regex(match)
            keys = (k for k in keys if regex.fullmatch(k))
        return sorted(keys)[: max(limit, 0)]

    async def has_epoch(self) -> bool:
        """Whether the counters are declared complete (see :meth:`mark_ready`)."""
        return self._epoch is not None

    async def mark_ready(self, epoch: str) -> None:
        """Declare the counters complete after a rebuild."""
        self._epoch = epoch

    async def aclose(self) -> None:
        """Drop every counter (nothing outlives an in-process store once closed)."""
        self._counters.clear()
        self._leases.clear()
        self._queues.clear()
