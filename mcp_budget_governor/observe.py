"""Hooks a governor calls when someone watches it: refusal logs here, metrics in ``otel``.

``Governor(policy, observer=Observer())`` logs each refusal once at INFO with
its limit, status and reason, at most one line per (limit, reason) every
``interval`` seconds (a runaway loop cannot flood the log: the next line says
how many were left out). :class:`mcp_budget_governor.integrations.otel.Telemetry`
(the ``[otel]`` extra) adds OpenTelemetry metrics and spans on top.

With no observer (the default) the governor does one ``is not None`` test per
call and nothing else: this module and OpenTelemetry are not even imported.

>>> import asyncio, logging
>>> from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window
>>> seen = []
>>> class Keep(Observer):
...     def decided(self, decision, ctx, seconds):
...         seen.append((decision.status, decision.limit))
>>> gov = Governor(
...     Policy.of(Limit("burst", cap=1, window=Window.MINUTE, scope=Scope.USER)),
...     observer=Keep(),
... )
>>> async def two():
...     return [(await gov.check(Context(user="u_1"))).status for _ in range(2)]
>>> asyncio.run(two()), seen
([200, 429], [(200, None), (429, 'burst')])
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from .context import Context
from .decision import Decision
from .ledger import Ledger

__all__ = ["Observer", "RefusalLog", "Watched"]

log = logging.getLogger("mcp_budget_governor.refusals")

#: What :meth:`Observer.observe_check` wraps: the governor's undecorated check.
CheckFn = Callable[[Context | None, int, Sequence[str]], Awaitable[Decision]]


class RefusalLog:
    """Refusals at INFO, one line per (limit, reason) per ``interval`` seconds at most.

    >>> from mcp_budget_governor.decision import Decision
    >>> r = RefusalLog(interval=60.0, clock=lambda: 0.0)
    >>> no = Decision(False, "burst", 429, reason="budget_exceeded:burst")
    >>> [r.note(no, Context(user="u")) for _ in range(3)]
    [True, False, False]
    >>> r.suppressed[("burst", "budget_exceeded:burst")]
    2
    """

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: dict[tuple[str | None, str], float] = {}
        self.suppressed: dict[tuple[str | None, str], int] = {}

    def note(self, decision: Decision, ctx: Context) -> bool:
        """Log ``decision`` (a refusal) unless its kind was logged less than ``interval``
        ago; True when a line was written."""
        key = (decision.limit, decision.reason)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return False
        if len(self._last) > 10_000:  # many limits x reasons: forget the old ones
            self._last.clear()
        self._last[key] = now
        skipped = self.suppressed.pop(key, 0)
        more = f" (+{skipped} more like it in the last {self.interval:g}s)" if skipped else ""
        log.info(
            "refused: limit=%s status=%d reason=%s user=%s tenant=%s tool=%s%s%s",
            decision.limit,
            decision.status,
            decision.reason,
            ctx.user,
            ctx.tenant,
            ctx.tool,
            " degraded" if decision.degraded else "",
            more,
        )
        return True


class Watched(Protocol):
    """What an observer reads of the governor it watches: a ``Governor``, which calls
    this module's hooks and so stands above it."""

    @property
    def degraded(self) -> bool: ...
    @property
    def pending_charges(self) -> int: ...
    @property
    def ledger(self) -> Ledger | None: ...


class Observer:
    """What a governor tells the one watching it; subclass to export it.

    - :meth:`attach`: called once by ``Governor(observer=...)``;
    - :meth:`observe_check`: wraps each ``check()`` (times it, then :meth:`decided`);
    - :meth:`decided`: each decision with the seconds the check took; the base
      class logs refusals through :class:`RefusalLog`.
    """

    def __init__(self, *, log_interval: float = 10.0) -> None:
        self.refusals = RefusalLog(log_interval)
        self.governor: Watched | None = None

    def attach(self, governor: Watched) -> None:
        self.governor = governor

    async def observe_check(
        self, check: CheckFn, ctx: Context | None, amount: int, approved: Sequence[str]
    ) -> Decision:
        t0 = time.perf_counter()
        decision = await check(ctx, amount, approved)
        self.decided(decision, ctx or Context(), time.perf_counter() - t0)
        return decision

    def decided(self, decision: Decision, ctx: Context, seconds: float) -> None:
        if not decision.admitted:
            self.refusals.note(decision, ctx)
