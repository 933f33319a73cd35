"""The storage contract of mcp-budget-governor 0.1.0, mapped onto ours.

The reference package's backends answer five calls on one plain counter per
key: ``consume`` (add if it fits the cap), ``accumulate`` (add always),
``release`` (give back, never below zero), ``peek`` and ``close``. Ours
charge several counters all or nothing in one step (``counters.Backend``).
Two adapters join them, each in one direction:

- :class:`KeyValueOps` gives every backend of ours those five calls, on our
  own counters (the same keys and scripts the governor uses);
- :class:`KeyValueAdapter` lets a backend written against the reference's
  protocol (:class:`KeyValueBackend`) serve our :class:`Governor`: a check's
  counters are consumed in order and given back when a later one refuses.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from mcp_budget_governor.counters import Backend as CounterBackend
from mcp_budget_governor.counters import ChargeResult, CounterOp, fits
from mcp_budget_governor.errors import BackendUnavailableError, GovernorError

log = logging.getLogger("mcp_budget_governor")


@dataclass(frozen=True, slots=True)
class ConsumeResult:
    """What a ``consume`` did: ``allowed`` (added), the ``total`` after it, and the
    ``remaining`` room under the cap."""

    allowed: bool
    total: int
    remaining: int


@dataclass(frozen=True, slots=True)
class AccumulateResult:
    """What an ``accumulate`` did: the ``total`` after it, whether it is ``within`` the
    cap (at most the cap), and whether this add ``crossed`` it (once per counter)."""

    within: bool
    total: int
    crossed: bool


@runtime_checkable
class KeyValueBackend(Protocol):
    """The reference package's ``Backend``: one atomic counter per key, its expiry
    given as seconds from now (``ttl``)."""

    async def consume(self, key: str, amount: int, cap: int, ttl: int) -> ConsumeResult:
        """Add ``amount`` only if the total stays at most ``cap``."""
        ...

    async def accumulate(self, key: str, amount: int, cap: int, ttl: int) -> AccumulateResult:
        """Add ``amount`` whatever the cap; report the total against it."""
        ...

    async def release(self, key: str, amount: int) -> None:
        """Give back up to ``amount`` (never below zero, never creating the key)."""
        ...

    async def peek(self, key: str) -> int:
        """The total, 0 for a missing key."""
        ...

    async def close(self) -> None:
        """Release connections; safe to call twice."""
        ...


#: The reference's name for its protocol, in the module it lived in. The package's
#: top-level ``Backend`` is ours (``counters.Backend``), what every backend here implements.
Backend = KeyValueBackend


def epoch_clock(clock: Callable[[], Any] | None) -> Callable[[], float]:
    """``clock`` as epoch seconds: a clock returning an aware ``datetime`` (the
    reference's) is wrapped; one returning numbers is returned as it is; None is
    ``time.time``."""
    if clock is None:
        return time.time
    if isinstance(clock(), datetime):
        return lambda: float(clock().timestamp())
    return clock


class _Host(CounterBackend, Protocol):
    """What :class:`KeyValueOps` needs of the class it is mixed into: one of our
    backends (``counters.Backend``, the one home of ``charge`` and ``usage``), its
    clock and its give-back."""

    def _kv_now(self) -> float:
        """The backend's clock, epoch seconds."""
        ...

    async def _kv_release(self, key: str, amount: int) -> None:
        """Give back up to ``amount`` on ``key``, never below zero."""
        ...

    async def _kv_expire(self, key: str, ttl: int) -> None:
        """Give ``key`` an expiry of ``ttl`` seconds if it has none."""
        ...


class KeyValueOps:
    """The reference's five calls, on a backend of ours (mixed into its class).

    Each is one charge of one counter through the backend's own ``charge``
    (lua/charge.lua on Redis), so a consume is as atomic as a check. The
    class using it is a :class:`_Host`.
    """

    async def _kv_expire(self, key: str, ttl: int) -> None:
        """Give ``key`` an expiry of ``ttl`` seconds if it has none (Redis: a lost one)."""

    async def consume(self: _Host, key: str, amount: int, cap: int, ttl: int) -> ConsumeResult:
        """Add ``amount`` to ``key`` if its total stays at most ``cap``; expires in ``ttl`` s."""
        op = CounterOp(key, amount, cap, True, int(self._kv_now()) + ttl)
        result = await self.charge([op], want_used=True)
        before = result.used[0] if result.used else 0
        total = before + amount if result.admitted else before
        await self._kv_expire(key, ttl)
        return ConsumeResult(result.admitted, total, max(cap - total, 0))

    async def accumulate(
        self: _Host, key: str, amount: int, cap: int, ttl: int
    ) -> AccumulateResult:
        """Add ``amount`` to ``key`` whatever ``cap``; ``crossed`` on the add that took
        the total from at most the cap to past it."""
        op = CounterOp(key, amount, cap, False, int(self._kv_now()) + ttl)
        result = await self.charge([op], want_used=True)
        before = result.used[0] if result.used else 0
        total = before + amount
        await self._kv_expire(key, ttl)
        return AccumulateResult(total <= cap, total, before <= cap < total)

    async def peek(self: _Host, key: str) -> int:
        """The total of ``key`` (0 when missing)."""
        (total,) = await self.usage([key])
        return total

    async def close(self: _Host) -> None:
        """``aclose()``, under the reference's name."""
        await self.aclose()


_NOT_STORED = "a backend written to the reference's protocol (consume/accumulate/...) "


class KeyValueAdapter:
    """A backend written against the reference's protocol, serving our governor.

    A charge consumes its enforcing counters in order (a zero amount, a spend
    limit or breaker read at check time, is a ``peek`` that refuses at the
    cap) and gives back what it took when a later one refuses or the store
    fails, then accumulates the others: all or nothing, as the reference's
    governor did it. Any exception the store raises (but our own errors)
    makes it unreachable, so each limit's fail mode applies. No ledger: the
    protocol has no in-flight amounts, so the governor must run inline.
    """

    def __init__(self, inner: KeyValueBackend, clock: Callable[[], float] = time.time) -> None:
        self.inner = inner
        self._clock = clock

    def _ttl(self, op: CounterOp, now: float) -> int:
        return max(1, math.ceil(op.expire_at - now))

    async def charge(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
    ) -> ChargeResult:
        if event_id is not None:
            raise GovernorError(_NOT_STORED + "keeps no in-flight amounts: run it without a ledger")
        now = self._clock()
        inner = self.inner
        used: list[int] = []
        taken: list[tuple[str, int]] = []
        try:
            for i, op in enumerate(ops):
                if not op.enforce:
                    continue
                if op.amount == 0:
                    total = await inner.peek(op.key)
                    if not fits(total, 0, op.cap):
                        await self._give_back(taken)
                        return ChargeResult(i, ())
                    continue
                consumed = await inner.consume(op.key, op.amount, op.cap, self._ttl(op, now))
                if not consumed.allowed:
                    await self._give_back(taken)
                    return ChargeResult(i, ())
                taken.append((op.key, op.amount))
            for op in ops:
                if op.enforce:
                    continue
                if op.amount == 0:
                    await inner.peek(op.key)
                else:
                    await inner.accumulate(op.key, op.amount, op.cap, self._ttl(op, now))
            if want_used:
                used = await self.usage([op.key for op in ops])
                used = [u - op.amount for u, op in zip(used, ops, strict=True)]
        except GovernorError:
            raise
        except Exception as exc:
            await self._give_back(taken)
            raise BackendUnavailableError(f"{type(inner).__name__}: {exc!r}") from exc
        return ChargeResult(-1, tuple(used))

    async def _give_back(self, taken: Sequence[tuple[str, int]]) -> None:
        """Release what a refused charge consumed; a failure is logged, never raised
        (the refusal stands; the counter holds the amount until its window ends)."""
        for key, amount in taken:
            try:
                await self.inner.release(key, amount)
            except Exception:
                log.warning(
                    "could not give back %d on %s after a refusal",
                    amount,
                    key,
                    exc_info=True,
                    extra={"event": "governor.rollback_failed"},
                )

    async def usage(self, keys: Sequence[str]) -> list[int]:
        try:
            return list(await asyncio.gather(*(self.inner.peek(k) for k in keys)))
        except Exception as exc:
            raise BackendUnavailableError(f"{type(self.inner).__name__}: {exc!r}") from exc

    async def aclose(self) -> None:
        await self.inner.close()


def adapted(backend: Any, clock: Callable[[], float]) -> Any:
    """``backend`` as the governor drives it: ours as it is, one written to the
    reference's protocol (``consume`` but no ``charge``) in a :class:`KeyValueAdapter`."""
    if backend is not None and not hasattr(backend, "charge") and hasattr(backend, "consume"):
        return KeyValueAdapter(backend, clock)
    return backend
