"""Process-local counters: the same model as the Redis scripts, in a dict.

Correct for one replica and in tests, and the per-replica fallback a fail-open
limit uses while Redis is unreachable. Operations never await, so under
asyncio each one is atomic just as a Lua script is in Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mcp_budget_governor.counters import (
    AppliedEvent,
    ChargeResult,
    CounterOp,
    CounterState,
    fits,
)
from mcp_budget_governor.errors import EpochMissingError
from mcp_budget_governor.keys import INTERNAL_PREFIX, pattern_regex


@dataclass(slots=True)
class _Counter:
    committed: int = 0
    in_flight: int = 0
    pending: dict[str, int] = field(default_factory=dict)
    expire_at: float = float("inf")


class MemoryBackend:
    """In-process counters with expiry, for a single replica or tests.

    >>> import asyncio
    >>> from mcp_budget_governor import Governor, Limit, Policy, Window
    >>> gov = Governor(Policy.of(Limit("calls", cap=1, window=Window.DAY)), MemoryBackend())
    >>> [asyncio.run(gov.check()).admitted for _ in range(2)]
    [True, False]
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counters: dict[str, _Counter] = {}
        self._watermarks: dict[str, int] = {}
        # day -> (applied event ids, expire_at): the seen-id sets of apply.lua
        self._seen: dict[str, tuple[set[str], int]] = {}
        self._epoch: str | None = None

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
        counter.expire_at = expire_at

    async def charge(
        self, ops: Sequence[CounterOp], *, event_id: str | None = None, want_used: bool = True
    ) -> ChargeResult:
        now = self._clock()
        used = tuple(self._used(op.key, now) for op in ops)
        for i, (op, total) in enumerate(zip(ops, used, strict=True)):
            if op.enforce and not fits(total, op.amount, op.cap):
                return ChargeResult(i, used)
        for op in ops:
            if op.amount:
                self._add(op.key, op.amount, event_id, op.expire_at, now)
        return ChargeResult(-1, used)

    async def usage(self, keys: Sequence[str]) -> list[int]:
        now = self._clock()
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
        now = self._clock()
        mark = self._watermarks.get(partition, -1)
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
            applied += 1
        if events or through >= 0:
            self._watermarks[partition] = max(mark, through)
        return applied

    def _first_sight(self, event: AppliedEvent, now: float) -> bool:
        day = event.seen_day
        entry = self._seen.get(day)
        if entry is None or entry[1] <= now:
            entry = self._seen[day] = (set(), event.seen_expire_at)
        if event.event_id in entry[0]:
            return False
        entry[0].add(event.event_id)
        return True

    async def state(self, key: str) -> CounterState:
        counter = self._get(key, self._clock())
        if counter is None:
            return CounterState(0, 0, {})
        return CounterState(counter.committed, counter.in_flight, dict(counter.pending))

    async def watermark(self, partition: str) -> int:
        """The last applied offset of a partition, -1 when none."""
        return self._watermarks.get(partition, -1)

    def keys(self) -> list[str]:
        """Every live counter key (for reports and tests)."""
        now = self._clock()
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
        return None
