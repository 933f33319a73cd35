"""Fired-level markers: where each level of each counter's bucket is claimed once."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mcp_budget_governor.errors import BackendUnavailableError

if TYPE_CHECKING:
    import redis.asyncio as aioredis


@dataclass(frozen=True, slots=True)
class Mark:
    """A fired-level marker to claim: its key and when it expires (epoch seconds)."""

    key: str
    expire_at: int


@runtime_checkable
class Deduper(Protocol):
    """Where fired levels are recorded, shared by every worker that evaluates."""

    async def claim(self, marks: Sequence[Mark]) -> list[bool]:
        """Claim each marker unless it exists: True where this call created it.

        Atomic per marker (two concurrent claims of one marker: one True);
        a marker lives until its ``expire_at``. One round trip for all.
        Raises :class:`BackendUnavailableError` when the store is unreachable.
        """
        ...


class MemoryDeduper:
    """Markers in a dict: for one process (the embedded mode) and tests.

    A restarted process forgets them; use :class:`RedisDeduper` with a stream
    worker.
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.time, sweep_every: int = 10_000
    ) -> None:
        self._clock = clock
        self._marks: dict[str, int] = {}
        self._sweep_every = sweep_every
        self._since_sweep = 0

    async def claim(self, marks: Sequence[Mark]) -> list[bool]:
        now = self._clock()
        self._since_sweep += len(marks)
        if self._since_sweep >= self._sweep_every:
            self._since_sweep = 0
            self._marks = {k: at for k, at in self._marks.items() if at > now}
        out: list[bool] = []
        for mark in marks:
            expire_at = self._marks.get(mark.key)
            if (expire_at is not None and expire_at > now) or mark.expire_at <= now:
                out.append(False)
                continue
            self._marks[mark.key] = mark.expire_at
            out.append(True)
        return out

    def __len__(self) -> int:
        now = self._clock()
        return sum(1 for at in self._marks.values() if at > now)


class RedisDeduper:
    """Markers in Redis: ``SET <marker> <time> NX EXAT <expire_at>``, pipelined.

    ``EXAT`` in the ``SET`` itself (Redis 6.2 or newer) means a marker never
    exists without its expiry, not even between two commands. Give it the
    counters' client (``RedisBackend.client``) or any ``redis.asyncio.Redis``
    of the same database.
    """

    def __init__(self, client: aioredis.Redis, *, clock: Callable[[], float] = time.time) -> None:
        from redis import exceptions as redis_errors

        self.client = client
        self._clock = clock
        self._unavailable: tuple[type[BaseException], ...] = (
            redis_errors.ConnectionError,
            redis_errors.TimeoutError,
            redis_errors.BusyLoadingError,
            OSError,
        )

    async def claim(self, marks: Sequence[Mark]) -> list[bool]:
        if not marks:
            return []
        stamp = str(int(self._clock()))
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for mark in marks:
                    pipe.set(mark.key, stamp, nx=True, exat=mark.expire_at)
                replies: list[Any] = await pipe.execute()
        except self._unavailable as exc:
            raise BackendUnavailableError.redis(exc) from exc
        return [bool(reply) for reply in replies]
