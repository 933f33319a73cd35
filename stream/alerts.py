"""Budget alerts: threshold crossings and breaker trips, once per limit, scope, bucket and level.

The stream worker calls :meth:`AlertEvaluator.evaluate` with the charges of a
batch it has just applied. For the distinct counters the batch touched it
reads the totals in **one** ``backend.usage`` call and compares each with its
limit's levels:

- every percentage of ``Limit.alert_at`` is a ``threshold`` level, crossed
  when ``used * 100 >= level * cap`` (integer arithmetic, so 80 % of a
  ``usd(10)`` cap is exactly 8,000,000 micros);
- a ``breaker`` limit trips at 100 % (``used >= cap``, the point where
  ``check()`` starts shedding): that level is reported as kind ``breaker``,
  and replaces a ``threshold`` at 100 the same limit may list;
- a shadow limit (``on_exceed=OnExceed.ALERT``) always has the 100 % level,
  alert_at or not: "admit and report" must report somewhere. Its alerts
  carry ``shadow=True`` (the calls were admitted anyway);
- a limit with none of these stays silent, and its counters are not even read.

**Every level crossed fires, in ascending order.** A counter that jumps from
10 % to 120 % in one batch fires 50, 80 and 100 (MAQPNA fires
``budget.threshold`` per level and ``budget.exceeded`` at 100), each once.
Firing only the highest would make what a receiver sees depend on how the
ledger happened to be batched; per level, the set of alerts of a bucket is
the same however the events were grouped. A receiver that wants only the
worst can keep the highest level per ``key`` of what arrives together.

**Once per bucket, across restarts and workers.** Before an alert goes out its
marker ``mcpbg:v1:_alerted:<limit>:<scope>:<bucket>:<level>`` is claimed in
the shared store (:class:`RedisDeduper`: ``SET ... NX EXAT <counter expiry>``,
one pipelined round trip for the whole batch), so of several workers, or a
restarted one, exactly one fires each level; the marker expires with the
counter, so the next bucket (another key) fires again. Evaluation is
level-triggered: it compares the current totals, not a delta, so a batch
whose evaluation failed (Redis unreachable: logged, nothing raised) is caught
up the next time any event touches the counter. Levels once fired stay fired
for the bucket even if a refund brings the counter back below them.

Delivery is at most once per sink: the marker is claimed before the sinks are
called, so a process that dies in between, or a sink that gives up, loses
that alert (it is logged). Each alert's ``id`` is derived from its marker
(UUIDv5), so should a marker be lost (Redis restarted empty, then rebuilt
from the ledger) and the alert fire again, receivers can drop the repeat.

**Sinks never slow or stop the evaluator.** :meth:`evaluate` hands new alerts
to one bounded queue per sink and returns; a background task per sink
delivers them in order (:class:`LogSink`, :class:`WebhookSink` with bounded
retries and a timeout, :class:`TopicSink` for the alerts topic). A failure is
logged and the next alert is tried; a full queue drops (and logs) rather than
grow without bound. :meth:`AlertEvaluator.flush` waits for the queues,
:meth:`AlertEvaluator.aclose` drains them (bounded) and closes the sinks.

The JSON form is a CloudEvents 1.0 structured event of type
``mcpbg.alert.v1``, in the envelope style of the ledger events.

Known limit: a SESSION counter lives a day past its last write, but its
markers a day past the charge that crossed the level; a session still being
charged more than a day after crossing a level may see that level once more.

Wiring (the worker, after each applied batch; ``backend`` a ``RedisBackend``)::

    evaluator = AlertEvaluator(
        policy, backend, dedupe=RedisDeduper(backend.client),
        sinks=[LogSink(), WebhookSink("https://hooks.example/budget"), TopicSink(produce)],
    )
    fired = await evaluator.evaluate(charge for event in batch for charge in event.data.charges)
    ...
    await evaluator.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, runtime_checkable
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from mcp_budget_governor.counters import Backend
from mcp_budget_governor.errors import BackendUnavailableError, GovernorError, InvalidInputError
from mcp_budget_governor.events import LimitName, MalformedEventError
from mcp_budget_governor.keys import PREFIX
from mcp_budget_governor.limits import Limit, OnExceed
from mcp_budget_governor.money import Unit
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.windows import Window

if TYPE_CHECKING:
    import aiohttp
    import redis.asyncio as aioredis

__all__ = [
    "ALERTED_PREFIX",
    "ALERT_SOURCE",
    "ALERT_TYPE",
    "DEFAULT_ALERT_TOPIC",
    "Alert",
    "AlertDeliveryError",
    "AlertDispatcher",
    "AlertEvaluator",
    "AlertEvent",
    "AlertKind",
    "AlertSink",
    "ChargeRef",
    "Deduper",
    "LogSink",
    "Mark",
    "MemoryDeduper",
    "RedisDeduper",
    "TopicProducer",
    "TopicSink",
    "WebhookSink",
    "alert_levels",
    "marker_key",
    "parse_alert",
]

log = logging.getLogger(__name__)

#: The CloudEvents ``type`` of an alert.
ALERT_TYPE = "mcpbg.alert.v1"
#: The CloudEvents ``source`` of the alerts this module emits.
ALERT_SOURCE = "/mcpbg/alerts"
#: The Kafka topic alerts go to unless the worker names another.
DEFAULT_ALERT_TOPIC = "mcpbg.alerts"
#: Prefix of the fired-level markers (``<prefix>:<limit>:<scope>:<bucket>:<level>``).
ALERTED_PREFIX = f"{PREFIX}:_alerted"
#: UUIDv5 namespace of alert ids: an alert's id is a function of its marker.
_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:mcpbg:alert")

AlertKind = Literal["threshold", "breaker"]


def marker_key(counter_key: str, level: int) -> str:
    """The store key recording that ``level`` fired for ``counter_key``.

    >>> marker_key("mcpbg:v1:spend:user=alice:20261129", 80)
    'mcpbg:v1:_alerted:spend:user=alice:20261129:80'
    """
    rest = counter_key.removeprefix(f"{PREFIX}:")
    return f"{ALERTED_PREFIX}:{rest}:{level}"


def alert_levels(limit: Limit) -> tuple[tuple[int, AlertKind], ...]:
    """The levels (percent, ascending) at which ``limit`` alerts, with their kind.

    >>> from mcp_budget_governor import Limit, Window
    >>> alert_levels(Limit("spend", cap=10, window=Window.DAY, breaker=True, alert_at=[50]))
    ((50, 'threshold'), (100, 'breaker'))
    """
    levels = set(limit.alert_at)
    if limit.breaker or limit.on_exceed is OnExceed.ALERT:
        levels.add(100)
    return tuple(
        (level, "breaker" if limit.breaker and level == 100 else "threshold")
        for level in sorted(levels)
    )


def crossed(used: int, cap: int, level: int) -> bool:
    """Whether a counter at ``used`` has reached ``level`` percent of ``cap``.

    Nothing is crossed at zero use (a cap of 0 is not an alert until used).

    >>> crossed(799, 1000, 80), crossed(800, 1000, 80), crossed(0, 0, 100), crossed(1, 0, 100)
    (False, True, False, True)
    """
    return used > 0 and used * 100 >= level * cap


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="microseconds")[:-6] + "Z"


@dataclass(frozen=True, slots=True)
class Alert:
    """One crossing of one level by one counter.

    - ``kind``: ``threshold`` (an ``alert_at`` level, or the 100 % of a shadow
      limit) or ``breaker`` (a breaker limit reached its cap).
    - ``limit``, ``scope`` (the key's scope segment, ``user=alice`` or
      ``global``), ``key`` (the counter), ``bucket`` and ``window``: which
      counter; ``level``: the percentage crossed.
    - ``used`` and ``cap`` in ``unit`` (integer USD micros for money): the
      total read when the crossing was seen, and the limit's cap.
    - ``shadow``: the limit never refuses (``on_exceed=ALERT``).
    - ``at``: when the evaluator saw it (epoch seconds, to the microsecond).
    """

    kind: AlertKind
    limit: str
    scope: str
    key: str
    bucket: str
    window: Window
    level: int
    used: int
    cap: int
    unit: Unit
    shadow: bool
    at: float

    @property
    def marker(self) -> str:
        """The store key that makes this alert fire once (see :func:`marker_key`)."""
        return marker_key(self.key, self.level)

    @property
    def id(self) -> str:
        """A UUIDv5 of the marker: the same alert always has the same id."""
        return str(uuid.uuid5(_ID_NAMESPACE, self.marker))

    def data(self) -> dict[str, Any]:
        """The CloudEvent's ``data``: every field but ``at`` (which is its ``time``)."""
        return {
            "kind": self.kind,
            "limit": self.limit,
            "scope": self.scope,
            "key": self.key,
            "bucket": self.bucket,
            "window": self.window.value,
            "level": self.level,
            "used": self.used,
            "cap": self.cap,
            "unit": self.unit.value,
            "shadow": self.shadow,
        }

    def to_cloudevent(self, source: str = ALERT_SOURCE) -> dict[str, Any]:
        """The structured CloudEvents 1.0 form, as a dict."""
        return {
            "specversion": "1.0",
            "id": self.id,
            "source": source,
            "type": ALERT_TYPE,
            "time": _rfc3339(self.at),
            "subject": self.key,
            "datacontenttype": "application/json",
            "data": self.data(),
        }

    def to_json(self, source: str = ALERT_SOURCE) -> bytes:
        """:meth:`to_cloudevent` as compact UTF-8 JSON (what the sinks send)."""
        return orjson.dumps(self.to_cloudevent(source))

    def describe(self) -> str:
        """A short human name: ``threshold 80% of spend user=alice 20261129``."""
        return f"{self.kind} {self.level}% of {self.limit} {self.scope} {self.bucket}"


# -- the schema (for consumers: webhook receivers, alert-topic readers) -------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AlertData(_Model):
    """The ``data`` of an ``mcpbg.alert.v1`` event."""

    kind: Literal["threshold", "breaker"]
    limit: LimitName
    scope: Annotated[str, StringConstraints(min_length=1)]
    key: Annotated[str, StringConstraints(pattern=f"^{PREFIX}:")]
    bucket: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    window: Window
    level: Annotated[int, Field(strict=True, ge=1, le=1000)]
    used: Annotated[int, Field(strict=True)]
    cap: Annotated[int, Field(strict=True, ge=0)]
    unit: Unit
    shadow: bool


class AlertEvent(_Model):
    """An alert as a CloudEvents 1.0 structured event."""

    specversion: Literal["1.0"]
    id: Annotated[str, StringConstraints(min_length=1)]
    source: Annotated[str, StringConstraints(min_length=1)]
    type: Literal["mcpbg.alert.v1"]
    time: datetime
    subject: str | None = None
    datacontenttype: Literal["application/json"] = "application/json"
    data: AlertData


def parse_alert(raw: bytes | str) -> Alert:
    """Read back what :meth:`Alert.to_json` wrote; raises :class:`MalformedEventError`."""
    try:
        event = AlertEvent.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "event"
        raise MalformedEventError(f"{where}: {first['msg']}", raw) from None
    d = event.data
    return Alert(
        d.kind,
        d.limit,
        d.scope,
        d.key,
        d.bucket,
        d.window,
        d.level,
        d.used,
        d.cap,
        d.unit,
        d.shadow,
        event.time.timestamp(),
    )


# -- deduplication ------------------------------------------------------------


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
            raise BackendUnavailableError(f"redis unreachable: {exc}") from exc
        return [bool(reply) for reply in replies]


# -- evaluation ---------------------------------------------------------------


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
    """The scope segment of ``mcpbg:v1:<limit>:<scope>:<bucket>`` (no part holds a ``:``).

    A key of another layout (a foreign producer) is named whole rather than guessed at.
    """
    parts = key.split(":")
    return parts[3] if len(parts) == 5 and parts[2] == limit and parts[3] else key


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
    ) -> None:
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
        now = round(self._clock(), 6)  # what the JSON form keeps: it round-trips exactly
        targets: dict[str, tuple[Limit, str, int]] = {}
        for charge in charges:
            key = charge.key
            known = targets.get(key)
            if known is not None:
                if charge.expire_at > known[2]:  # the latest expiry the batch set
                    targets[key] = (known[0], known[1], charge.expire_at)
                continue
            if not self._levels.get(charge.limit) or charge.expire_at <= now:
                continue
            targets[key] = (self.policy[charge.limit], charge.bucket, charge.expire_at)
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
            for level, kind in self._levels[limit.name]:
                if not crossed(used, limit.cap, level):
                    break
                remembered = self._known.get(marker_key(key, level))
                if remembered is not None and remembered > now:
                    continue
                candidates.append(
                    Alert(
                        kind,
                        limit.name,
                        _scope_of(key, limit.name),
                        key,
                        bucket,
                        limit.window,
                        level,
                        used,
                        limit.cap,
                        limit.unit,
                        limit.on_exceed is OnExceed.ALERT,
                        now,
                    )
                )
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


# -- sinks ----------------------------------------------------------------------


class AlertDeliveryError(GovernorError):
    """A sink could not deliver an alert (after its retries)."""


@runtime_checkable
class AlertSink(Protocol):
    """Somewhere alerts go. ``send`` raises when the alert could not be delivered."""

    @property
    def name(self) -> str:
        """How logs name this sink (never with secrets)."""
        ...

    async def send(self, alert: Alert) -> None: ...

    async def aclose(self) -> None: ...


class AlertDispatcher:
    """Fans alerts out to sinks: one bounded queue and one delivery task per sink.

    A sink receives alerts in the order they were published, one at a time;
    sinks do not wait for one another. :meth:`publish` never blocks: when a
    sink's queue is full the alert is dropped for that sink (ERROR logged,
    counted in ``dropped``). Failures are logged (ERROR) and counted in
    ``failed``; ``delivered`` counts successes. Tasks start on the first publish.
    """

    def __init__(self, sinks: Sequence[AlertSink], *, queue_size: int = 10_000) -> None:
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise InvalidInputError("queue_size", queue_size, "expected a positive integer")
        self.sinks = tuple(sinks)
        self._queue_size = queue_size
        self._queues: list[asyncio.Queue[Alert]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.delivered = 0
        self.failed = 0
        self.dropped = 0

    def _start(self) -> None:
        for sink in self.sinks:
            queue: asyncio.Queue[Alert] = asyncio.Queue(self._queue_size)
            self._queues.append(queue)
            self._tasks.append(
                asyncio.get_running_loop().create_task(
                    self._deliver(sink, queue), name=f"mcpbg-alerts {sink.name}"
                )
            )

    def publish(self, alerts: Sequence[Alert]) -> None:
        """Queue ``alerts`` for every sink (call from the event loop)."""
        if not alerts or not self.sinks:
            return
        if not self._tasks:
            self._start()
        for sink, queue in zip(self.sinks, self._queues, strict=True):
            for alert in alerts:
                try:
                    queue.put_nowait(alert)
                except asyncio.QueueFull:
                    self.dropped += 1
                    log.error(
                        "alerts: %s is %d alerts behind; dropped %s (id %s)",
                        sink.name,
                        queue.qsize(),
                        alert.describe(),
                        alert.id,
                    )

    async def _deliver(self, sink: AlertSink, queue: asyncio.Queue[Alert]) -> None:
        while True:
            alert = await queue.get()
            try:
                await sink.send(alert)
                self.delivered += 1
            except Exception as exc:  # a sink must never stop the others, or the evaluator
                self.failed += 1
                log.error(
                    "alerts: %s could not deliver %s (id %s): %s",
                    sink.name,
                    alert.describe(),
                    alert.id,
                    exc,
                )
            finally:
                queue.task_done()

    async def flush(self) -> None:
        """Wait until every queued alert was delivered or given up."""
        await asyncio.gather(*(queue.join() for queue in self._queues))

    async def aclose(self, grace: float = 10.0) -> None:
        """Deliver what is queued (at most ``grace`` s), stop the tasks, close the sinks."""
        if self._tasks:
            try:
                await asyncio.wait_for(self.flush(), grace)
            except TimeoutError:
                left = sum(queue.qsize() for queue in self._queues)
                log.warning("alerts: closing with %d alerts undelivered", left)
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()
            self._queues.clear()
        for sink in self.sinks:
            try:
                await sink.aclose()
            except Exception as exc:
                log.warning("alerts: closing %s failed: %s", sink.name, exc)


def _logfmt(value: object) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if not text or any(c in text for c in ' ="\\'):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    return text


class LogSink:
    """One structured (logfmt) line per alert, at WARNING by default.

    The alert's fields also travel as ``record.mcpbg_alert`` (a dict) for
    JSON log handlers::

        mcpbg.alert kind=threshold level=80 limit=spend scope="user=alice" bucket=20261129
        window=day used=800 cap=1000 unit=usd_micros shadow=false key="..." id=...
    """

    def __init__(
        self, logger: logging.Logger | None = None, *, level: int = logging.WARNING
    ) -> None:
        self.logger = logger or log
        self.level = level

    @property
    def name(self) -> str:
        return f"log {self.logger.name}"

    async def send(self, alert: Alert) -> None:
        fields = {
            "kind": alert.kind,
            "level": alert.level,
            "limit": alert.limit,
            "scope": alert.scope,
            "bucket": alert.bucket,
            "window": alert.window.value,
            "used": alert.used,
            "cap": alert.cap,
            "unit": alert.unit.value,
            "shadow": alert.shadow,
            "key": alert.key,
            "id": alert.id,
        }
        line = " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())
        self.logger.log(
            self.level,
            "mcpbg.alert %s",
            line,
            extra={"mcpbg_alert": {**alert.data(), "id": alert.id, "time": _rfc3339(alert.at)}},
        )

    async def aclose(self) -> None:
        return None


class TopicProducer(Protocol):
    """Sends one record and waits for the broker's ack; raises on failure.

    The worker wires it to its producer, e.g. with aiokafka::

        async def produce(topic: str, key: bytes, value: bytes) -> None:
            await producer.send_and_wait(topic, value, key=key)
    """

    def __call__(self, topic: str, key: bytes, value: bytes) -> Awaitable[None]: ...


class TopicSink:
    """Alerts to a Kafka topic (``mcpbg.alerts`` by default) through ``produce``.

    The record key is the counter key, so every alert of one counter lands in
    one partition, in level order; the value is the alert's CloudEvent JSON.
    The producer belongs to the caller (``aclose`` leaves it open).
    """

    def __init__(self, produce: TopicProducer, topic: str = DEFAULT_ALERT_TOPIC) -> None:
        if not topic:
            raise InvalidInputError("topic", topic, "must not be empty")
        self.produce = produce
        self.topic = topic

    @property
    def name(self) -> str:
        return f"topic {self.topic}"

    async def send(self, alert: Alert) -> None:
        await self.produce(self.topic, alert.key.encode(), alert.to_json())

    async def aclose(self) -> None:
        return None


#: Statuses worth another attempt: timeouts, throttling, server errors.
_RETRY_STATUSES = frozenset({408, 425, 429})


class WebhookSink:
    """POSTs each alert's CloudEvent JSON (``application/cloudevents+json``) to ``url``.

    - ``timeout``: seconds one attempt may take, connect to last byte.
    - ``retries``: further attempts after a connection error, a timeout, a
      408/425/429 or a 5xx (so at most ``retries + 1`` requests); any other
      non-2xx status (a 4xx, a redirect) is not retried.
    - ``backoff``: seconds before the first retry, doubled each time, at most
      ``max_backoff``.
    - ``headers``: extra request headers (an ``Authorization``, say).

    After the last attempt :meth:`send` raises :class:`AlertDeliveryError`
    (which the dispatcher logs). One send therefore lasts at most about
    ``(retries + 1) * timeout`` plus the pauses. Logs name the URL by scheme,
    host and port only: a webhook path often holds a secret token.

    Needs ``aiohttp`` (installed with the ``stream`` extra).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInputError("url", url, "expected an http:// or https:// URL")
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise InvalidInputError("timeout", timeout, "expected seconds > 0")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise InvalidInputError("retries", retries, "expected an integer from 0 to 100")
        for name, value in (("backoff", backoff), ("max_backoff", max_backoff)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidInputError(name, value, "expected seconds >= 0")
        self.url = url
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.headers = {"Content-Type": "application/cloudevents+json", **(headers or {})}
        port = f":{parts.port}" if parts.port else ""
        self._where = f"{parts.scheme}://{parts.hostname}{port}"
        self._session: aiohttp.ClientSession | None = None

    @property
    def name(self) -> str:
        return f"webhook {self._where}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            import aiohttp

            self._session = aiohttp.ClientSession()
        return self._session

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (1-based)."""
        return min(self.backoff * 2.0 ** (attempt - 1), self.max_backoff)

    async def send(self, alert: Alert) -> None:
        import aiohttp

        body = alert.to_json()
        session = self._client()
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        attempts = self.retries + 1
        problem = "not attempted"
        for attempt in range(1, attempts + 1):
            try:
                async with session.post(
                    self.url,
                    data=body,
                    headers=self.headers,
                    timeout=timeout,
                    allow_redirects=False,
                ) as response:
                    status = response.status
                    if 200 <= status < 300:
                        return
                    problem = f"HTTP {status}"
                    if status not in _RETRY_STATUSES and status < 500:
                        raise AlertDeliveryError(
                            f"{self.name}: {problem}, not retried (alert {alert.id})"
                        )
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = (
                    f"timed out after {self.timeout:g} s"
                    if isinstance(exc, TimeoutError)
                    else f"{type(exc).__name__}: {exc}"
                )
            if attempt < attempts:
                pause = self.delay(attempt)
                log.info(
                    "alerts: %s attempt %d of %d failed (%s); retrying in %.2f s",
                    self.name,
                    attempt,
                    attempts,
                    problem,
                    pause,
                )
                await asyncio.sleep(pause)
        raise AlertDeliveryError(f"{self.name}: gave up after {attempts} attempts ({problem})")

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            with contextlib.suppress(Exception):
                await session.close()
