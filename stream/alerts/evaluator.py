"""The evaluator: which levels a batch's counters newly crossed, claimed once, then sent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from mcp_budget_governor.counters import Backend
from mcp_budget_governor.errors import BackendUnavailableError
from mcp_budget_governor.forecast import projected_before_end
from mcp_budget_governor.keys import parse_key
from mcp_budget_governor.limits import Limit, OnExceed
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.windows import bucket_of

from .dedupe import Deduper, Mark
from .event import Alert
from .levels import FORECAST, AlertKind, alert_levels, crossed, marker_key
from .sinks import AlertDispatcher, AlertSink

log = logging.getLogger(__package__)  # the package's one logger: ...stream.alerts


class ChargeRef(Protocol):
    """What the evaluator reads of a charge: a :class:`~mcp_budget_governor.ledger.LedgerCharge`
    or a parsed event's :class:`~mcp_budget_governor.events.Charge`."""

    @property
    def limit(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def bucket(self) -> str: ...
    @property
    def expire_at(self) -> int: ...


def _scope_of(key: str, limit: str) -> str:
    """The scope segment of a counter key of ``limit``, read by ``keys.parse_key``.

    A key of another layout (a foreign producer) is named whole rather than guessed at.
    """
    parsed = parse_key(key)
    return parsed.scope if parsed is not None and parsed.limit == limit else key


class AlertEvaluator:
    """Finds the levels a batch's counters newly crossed, records and emits them.

    - ``policy``: the limits (caps, levels) the counters are compared with;
      a charge of a limit the policy does not name is ignored.
    - ``backend``: the counters (one ``usage`` call per evaluation).
    - ``dedupe``: where fired levels are claimed (shared by all workers).
    - ``sinks``: where alerts go, each through its own bounded queue
      (``queue_size`` alerts) and background task; see :class:`AlertDispatcher`.
    - ``clock``: the time alerts carry and expired charges are judged by.

    Levels this process has seen claimed (by itself or another worker) are
    remembered (up to ``remember`` markers) so that a hot counter above a
    level does not cost a store round trip per batch.
    """

    def __init__(
        self,
        policy: Policy,
        backend: Backend,
        *,
        dedupe: Deduper,
        sinks: Sequence[AlertSink] = (),
        clock: Callable[[], float] = time.time,
        queue_size: int = 10_000,
        remember: int = 100_000,
        forecast: bool = False,
    ) -> None:
        #: Also alert, once per period, a counter projected to reach its cap before
        #: its period ends (``forecast.py``), for the limits that have alert levels.
        self.forecast = forecast
        self.policy = policy
        self.backend = backend
        self.dedupe = dedupe
        self.dispatcher = AlertDispatcher(sinks, queue_size=queue_size)
        self._clock = clock
        self._levels = {limit.name: alert_levels(limit) for limit in policy}
        self._known: dict[str, int] = {}
        self._remember = remember
        #: Counts since creation: evaluations, alerts fired, evaluations that failed.
        self.evaluations = 0
        self.fired = 0
        self.failures = 0

    async def evaluate(self, charges: Iterable[ChargeRef]) -> list[Alert]:
        """The alerts newly fired by the counters ``charges`` touched, in key and level order.

        Never raises for an unreachable store (logs a warning and returns []):
        the next evaluation of those counters catches up.
        """
        self.evaluations += 1
        # One policy for the whole evaluation, though replace_policy may run during its awaits.
        policy, levels = self.policy, self._levels
        now = round(self._clock(), 6)  # what the JSON form keeps: it round-trips exactly
        targets: dict[str, tuple[Limit, str, int]] = {}
        for charge in charges:
            key = charge.key
            known = targets.get(key)
            if known is not None:
                if charge.expire_at > known[2]:  # the latest expiry the batch set
                    targets[key] = (known[0], known[1], charge.expire_at)
                continue
            if not levels.get(charge.limit) or charge.expire_at <= now:
                continue
            targets[key] = (policy[charge.limit], charge.bucket, charge.expire_at)
        if not targets:
            return []
        keys = sorted(targets)
        try:
            totals = await self.backend.usage(keys)
        except BackendUnavailableError as exc:
            self.failures += 1
            log.warning("alerts: cannot read %d counters (%s); skipped this batch", len(keys), exc)
            return []
        candidates: list[Alert] = []
        for key, used in zip(keys, totals, strict=True):
            limit, bucket, _ = targets[key]
            if self.forecast and self._projected(limit, bucket, used, now):
                remembered = self._known.get(marker_key(key, FORECAST))
                if remembered is None or remembered <= now:
                    percent = max(1, min(1000, used * 100 // max(limit.cap, 1)))
                    candidates.append(self._alert(FORECAST, limit, key, bucket, percent, used, now))
            for level, kind in levels[limit.name]:
                if not crossed(used, limit.cap, level):
                    break
                remembered = self._known.get(marker_key(key, level))
                if remembered is not None and remembered > now:
                    continue
                candidates.append(self._alert(kind, limit, key, bucket, level, used, now))
        if not candidates:
            return []
        marks = [Mark(a.marker, targets[a.key][2]) for a in candidates]
        try:
            won = await self.dedupe.claim(marks)
        except BackendUnavailableError as exc:
            self.failures += 1
            log.warning("alerts: cannot record %d alerts (%s); skipped", len(marks), exc)
            return []
        self._note(marks)
        fired = [alert for alert, first in zip(candidates, won, strict=True) if first]
        self.fired += len(fired)
        self.dispatcher.publish(fired)
        return fired

    @staticmethod
    def _alert(
        kind: AlertKind, limit: Limit, key: str, bucket: str, level: int, used: int, now: float
    ) -> Alert:
        shadow = limit.on_exceed is OnExceed.ALERT
        scope = _scope_of(key, limit.name)
        return Alert(
            kind, limit.name, scope, key, bucket, limit.window, level, used, limit.cap,
            limit.unit, shadow, now,
        )  # fmt: skip

    @staticmethod
    def _projected(limit: Limit, label: str, used: int, now: float) -> bool:
        """Whether the counter is on course to reach its cap before its period ends."""
        if limit.window is None or used >= limit.cap:
            return False  # a concurrency cap has no period; a spent one has its 100 % alert
        period = bucket_of(limit.window, label)
        return period is not None and projected_before_end(
            used, limit.cap, period.start, period.end, now
        )

    def replace_policy(self, policy: Policy) -> None:
        """Compare the counters with ``policy`` from the next evaluation on (a reload).

        Alerts already fired stay fired: their markers outlive the change of levels.
        """
        levels = {limit.name: alert_levels(limit) for limit in policy}
        self.policy, self._levels = policy, levels

    def _note(self, marks: Sequence[Mark]) -> None:
        if len(self._known) + len(marks) > self._remember:
            now = self._clock()
            self._known = {k: at for k, at in self._known.items() if at > now}
            if len(self._known) + len(marks) > self._remember:
                self._known.clear()
        for mark in marks:
            self._known[mark.key] = mark.expire_at

    async def flush(self) -> None:
        """Wait until every alert handed to the sinks so far was delivered or given up."""
        await self.dispatcher.flush()

    async def aclose(self, grace: float = 10.0) -> None:
        """Deliver what is queued (for at most ``grace`` s), then close the sinks.

        The backend and the deduper belong to the caller and stay open.
        """
        await self.dispatcher.aclose(grace)
