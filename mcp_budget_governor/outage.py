"""The Governor's degraded mode: while the shared counters cannot be reached, each
limit's fail mode decides. A fail-closed limit refuses (503); a fail-open one with a
local fallback counts in process-local counters against the caps last seen; and in
inline mode (no ledger) the charges made meanwhile are kept, under the operation id
they were first sent with, and replayed once the counters answer again, so outage
spend is not lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from . import planning
from .counters import Backend, CounterOp
from .decision import Decision
from .errors import BackendUnavailableError, CounterOverflowError
from .limits import FailMode, Limit
from .memory_backend import MemoryBackend
from .planning import Slot

log = logging.getLogger("mcp_budget_governor")


def local(limit: Limit) -> bool:
    """Whether ``limit`` counts in the process-local fallback while the counters are down."""
    return limit.fail_mode is FailMode.OPEN and limit.local_fallback


class Outage:
    """What a governor knows of the counters being down, and what it does meanwhile."""

    def __init__(
        self,
        *,
        clock: Callable[[], Any],
        retry_interval: float,
        max_pending: int,
        local_fallback: bool,
    ) -> None:
        self._clock = clock
        self._retry_interval = retry_interval
        self._local_fallback = local_fallback
        # Process-local counters for fail-open limits while the backend is down.
        self.fallback = MemoryBackend(clock=clock)
        # Inline mode only: charges made while the backend was down, replayed
        # when it answers again so outage spend is not lost. Each keeps the
        # operation id it was first sent with: a charge whose reply came too
        # late had landed, and its replay then changes nothing (lua/charge.lua).
        self.pending: deque[tuple[str, tuple[CounterOp, ...]]] = deque()
        self._max_pending = max_pending
        # One replay at a time: concurrent checks at recovery wait for it, so each
        # outage charge is sent (and taken off the deque) by one task only.
        self._replaying = asyncio.Lock()
        self._marks = 0  # how often the backend was marked down (see flush)
        #: Until when (clock seconds) the counters count as down; 0: they answer.
        self.down_until = 0.0
        # Counter key -> its effective cap with grants, as the backend last answered:
        # what the fallback and the fail-open reads compare with while it is down
        # (a run-time cap or grant still applies, per replica, during an outage).
        self.caps_seen: dict[str, int] = {}

    @property
    def degraded(self) -> bool:
        """Whether the counters are marked unreachable now."""
        return bool(self.down_until) and self._clock() < self.down_until

    def mark_down(self) -> None:
        if not self.down_until:
            # The event names of mcp-budget-governor 0.1.0's log records.
            event = "degraded" if self._local_fallback else "unavailable"
            log.warning(
                "budget counters unreachable: applying each limit's fail mode",
                extra={"event": f"governor.backend_{event}"},
            )
        self.down_until = self._clock() + self._retry_interval
        self._marks += 1

    async def ready(self, backend: Backend) -> None:
        """Before a charge: raise while the counters are marked down, else replay what
        was kept for them first."""
        if self.down_until and self._clock() < self.down_until:
            raise BackendUnavailableError("backend marked down; retrying later")
        await self.flush(backend)

    async def flush(self, backend: Backend) -> None:
        """Replay outage charges, then resume normal enforcement.

        One task replays; checks arriving meanwhile wait for it, then find the
        deque empty (replayed once each), or, if the replay found the backend
        down again, take the fail mode without trying it themselves.
        """
        marks = self._marks
        async with self._replaying:
            if self._marks != marks:
                raise BackendUnavailableError("backend marked down; retrying later")
            await self._replay(backend)

    async def _replay(self, backend: Backend) -> None:
        while self.pending:
            item = self.pending[0]
            op_id, ops = item
            try:
                await backend.charge(ops, want_used=False, op_id=op_id)
            except BackendUnavailableError:
                self.mark_down()
                raise
            except CounterOverflowError as exc:
                log.error("outage charge dropped: %s", exc)  # it can never be counted
            if self.pending and self.pending[0] is item:  # (a full buffer drops its oldest)
                self.pending.popleft()
        if self.down_until:
            log.warning("budget counters reachable again: normal enforcement resumed")
            self.down_until = 0.0

    def keep_for_later(self, slots: Sequence[Slot], op_id: str | None, *, ledgered: bool) -> None:
        """Inline mode: remember charges made during an outage (under their operation
        id) for the backend."""
        if ledgered or op_id is None:
            return  # the ledger carries them; the projection will count them
        ops = tuple(
            CounterOp(s.key, s.amount, s.limit.cap, False, s.expire_at)
            for s in slots
            if s.amount and not s.limit.concurrent  # a lease is not spend to replay
        )
        if not ops:
            return
        if len(self.pending) >= self._max_pending:
            log.error("outage buffer full (%d charges): the oldest is dropped", self._max_pending)
            self.pending.popleft()
        self.pending.append((op_id, ops))

    async def check(
        self,
        slots: Sequence[Slot],
        now: float,
        op_id: str | None,
        lease: str | None,
        ticket: str | None,
        *,
        lease_ttl: float,
        ledgered: bool,
    ) -> Decision:
        """The check while the counters are down: each limit's fail mode decides."""
        for s in slots:
            if s.enforce and s.limit.fail_mode is FailMode.CLOSED:
                return planning.unavailable(s, self._retry_interval)
        kept = [s for s in slots if local(s.limit)]
        ops = [self.local_op(s) for s in kept]
        result = await self.fallback.charge(ops, lease=lease, lease_ttl=lease_ttl, ticket=ticket)
        caps = result.caps or [op.cap for op in ops]
        if not result.admitted:
            remaining = planning.headroom(kept, result.used, charged=False, caps=caps)
            return planning.refused(kept[result.refused], now, degraded=True, remaining=remaining)
        self.keep_for_later(slots, op_id, ledgered=ledgered)
        return planning.admitted(kept, result.used, degraded=True, caps=caps)

    async def charge_failed(
        self, slots: Sequence[Slot], op_id: str | None, *, ledgered: bool
    ) -> int | None:
        """The backend did not take a charge: fail-open limits count it locally, and
        inline mode keeps it for the backend. The first slot's local total, if local."""
        kept = [s.op for s in slots if local(s.limit)]
        before = None
        if kept:
            fallback = await self.fallback.charge(kept)
            if local(slots[0].limit):
                before = fallback.used[0]
        self.keep_for_later(slots, op_id, ledgered=ledgered)
        return before

    def saw_caps(self, ops: Sequence[CounterOp], caps: Sequence[int]) -> None:
        """Remember the effective caps the counters answered with, for an outage."""
        seen = self.caps_seen
        if len(seen) >= 65_536:
            seen.clear()
        for op, cap in zip(ops, caps, strict=True):
            seen[op.key] = cap

    def local_op(self, s: Slot) -> CounterOp:
        """The fallback's op of ``s``: against the effective cap last seen, else its default."""
        cap = self.caps_seen.get(s.key)
        if cap is None:
            return s.op
        return CounterOp(s.key, s.amount, cap, s.enforce, s.expire_at)
