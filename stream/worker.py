"""The stream worker: an aiokafka consumer-group member that projects the ledger into Redis.

``mcpbg worker --kafka-url kafka://host:9092 --redis-url redis://host:6379/0``
(or the same settings as ``MCPBG_*`` environment variables, see
:class:`WorkerConfig`) runs one member of the consumer group ``--group``;
start several and they split the topic's partitions.

It is a plain ``AIOKafkaConsumer`` loop (DESIGN.md names faust-streaming; the
faust app this replaces spent about 70 us of CPU per event in its per-record
stream machinery, more than the projection itself, and fixed its fetch wait at
1.5 s; see ``benchmarks/README.md``, section bench_worker.py). How it stays
exact (see also :mod:`.projector`):

- **State lives in Redis only.** The counters, the applied-offset watermark
  of every partition and the seen-id sets are in Redis; Kafka's committed
  offsets are kept for lag tools only.
- **Resume from the watermark.** When the group assigns partitions, the
  rebalance listener pauses them; before the next fetch is used the loop
  reads each one's Redis watermark, seeks to watermark + 1, commits that
  offset to the group and resumes the partition. Reading therefore resumes
  right after the last event the counters hold, whatever the group had
  committed: behind it (a worker killed between its Redis apply and its
  Kafka commit) nothing is read twice; ahead of it (a batch committed but
  not applied) the gap is read again instead of lost; a Redis found empty at
  an assignment (epoch marker gone) is rebuilt from the ledger first.
  Records fetched before that alignment are dropped, never applied.
- **Batches.** ``getmany(max_records=batch_size)`` returns what the fetcher
  holds (waiting up to ``batch_wait`` when nothing is there); each
  partition's share is applied in one ``backend.apply`` call (one Lua
  script, one round trip). The consumed offsets are committed to the group
  after the apply, at most once a second, on a revocation and at the stop.
- **Never skip a batch.** A failed apply (Redis unreachable) or dead-letter
  send (Kafka unreachable) is retried with backoff until it succeeds, or
  until the worker is told to stop: then the batch is simply not committed
  and is read again by whoever resumes from the watermark.
- **Revocation.** The listener waits for the batch in hand to be applied
  (the loop holds a lock while it applies), commits, and lets the rebalance
  go on; a new owner starts from the watermark anyway, so a batch that
  outlives the wait (Redis down) is harmless too: the ``apply`` script skips
  whatever the other side applied first.
- **Dead letters** go to ``<topic>.dlq`` (created with the ledger topic's
  partition count when missing): value = JSON with the reason, source topic,
  partition, offset and the original bytes in base64; the same facts as
  headers; key = ``<topic>:<partition>:<offset>``. A record is dead unless
  it is a valid event whose every charge a governor could have written
  (:mod:`mcp_budget_governor.provenance`). Each is sent once: the batch's
  apply moves the watermark past it, so a restart does not send it again.
- **Shutdown.** SIGTERM (or SIGINT) stops the loop after the batch in hand,
  commits the consumed offsets, leaves the group, and exits 0.
- **Progress.** Every ``progress_interval`` seconds one INFO line: events/s
  since the last line, totals, and per partition the lag (the highwater mark
  the last fetch reported minus the next offset to process) and the last
  offset processed.

Settings for the test broker (tansu), which this worker must not lean on:
no transactions or idempotent producer are used (delivery is at-least-once,
exactness comes from the watermark), nothing reads ``end_offsets`` (the lag
uses fetched highwater marks), and ``fetch_max_wait_ms`` is short (50 ms by
default): tansu answers a fetch that waits for data late rather than when the
data arrives, so a long wait becomes projection lag.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import IllegalStateError, KafkaError, TopicAlreadyExistsError
from aiokafka.structs import ConsumerRecord

from mcp_budget_governor.errors import EpochMissingError, InvalidInputError
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.ledger import DEFAULT_TOPIC
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.policy_file import load_policy
from mcp_budget_governor.policy_reload import watcher_for
from mcp_budget_governor.producers.kafka_ledger import parse_bootstrap
from mcp_budget_governor.projections.redis_counters import RedisBackend
from mcp_budget_governor.urls import check_redis_url
from mcp_budget_governor.urls import redact as redact_url

from . import metrics
from .alerts import AlertEvaluator, AlertSink, LogSink, RedisDeduper, TopicSink, WebhookSink
from .archiver import Archiver
from .projector import DeadLetter, Projector, ProjectorResult, Record, dead_letter_topic
from .rebuild import rebuild

__all__ = ["ENV", "ProjectionWorker", "WorkerConfig", "load_policy", "prepare_topics", "run"]

log = logging.getLogger(__name__)


#: Environment variable of each setting (an option of ``mcpbg worker`` wins over it).
ENV: Mapping[str, str] = {
    "kafka_url": "MCPBG_KAFKA_URL",
    "redis_url": "MCPBG_REDIS_URL",
    "topic": "MCPBG_TOPIC",
    "group": "MCPBG_GROUP",
    "batch_size": "MCPBG_BATCH_SIZE",
    "batch_wait": "MCPBG_BATCH_WAIT",
    "fetch_max_wait_ms": "MCPBG_FETCH_MAX_WAIT_MS",
    "session_timeout_ms": "MCPBG_SESSION_TIMEOUT_MS",
    "heartbeat_interval_ms": "MCPBG_HEARTBEAT_INTERVAL_MS",
    "progress_interval": "MCPBG_PROGRESS_INTERVAL",
    "redis_timeout": "MCPBG_REDIS_TIMEOUT",
    "topic_wait": "MCPBG_TOPIC_WAIT",
    "log_level": "MCPBG_LOG_LEVEL",
    "policy": "MCPBG_POLICY",
    "alert_webhook": "MCPBG_ALERT_WEBHOOK",
    "alert_topic": "MCPBG_ALERT_TOPIC",
    "archive_dir": "MCPBG_ARCHIVE_DIR",
    "metrics_port": "MCPBG_METRICS_PORT",
    "partitions": "MCPBG_PARTITIONS",
    "concurrency": "MCPBG_CONCURRENCY",
}

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: The longest pause between two retries of a failed batch.
MAX_BACKOFF = 5.0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What a worker needs; :meth:`from_env` fills it from ``MCPBG_*`` variables.

    - ``kafka_url``: ``kafka://host:port[,host:port]`` (or without the scheme).
    - ``redis_url``: the counters' Redis, ``redis://host:port/db``.
    - ``topic``: the ledger topic; dead letters go to ``<topic>.dlq``.
    - ``group``: the consumer group the workers share.
    - ``batch_size``: most records taken from the consumer at once (each
      partition's share is one ``apply`` call); ``batch_wait``: seconds the
      consumer waits for records when none are fetched yet.
    - ``fetch_max_wait_ms``: how long the broker may hold a fetch that has
      no data yet (Kafka's ``fetch.max.wait.ms``); short keeps the lag low
      on brokers that answer a held fetch late.
    - ``session_timeout_ms`` / ``heartbeat_interval_ms``: group membership;
      a killed worker's partitions move after the session timeout.
    - ``progress_interval``: seconds between progress lines (0: none).
    - ``redis_timeout``: seconds one Redis call may take (a batch is one call).
    - ``topic_wait``: seconds to wait at start for the ledger topic to exist.
    - ``policy``: a TOML policy file or ``package.module:attribute``, naming
      the :class:`~mcp_budget_governor.Policy` whose ``alert_at`` levels,
      breakers and shadow limits raise alerts; empty: no alerts.
    - ``alert_webhook``: an http(s) URL each alert is POSTed to (optional).
    - ``alert_topic``: the Kafka topic alerts go to (default ``mcpbg.alerts``;
      empty: none). Alerts are always logged (WARNING).
    - ``archive_dir``: where each batch is written as Parquet (see
      :mod:`.archiver`) *before* it is applied; empty: no archive.
    - ``metrics_port``: serve Prometheus metrics on this port (0: off).
    - ``partitions``: create the ledger topic with this many partitions when
      it does not exist (0, the default: wait ``topic_wait`` for a producer
      or an operator to create it).
    - ``concurrency``: how many partitions' batches of one fetch are applied
      at once (default 1). Each partition has its own watermark, so their
      applies are independent; more than one keeps Redis busy while a batch
      is in flight, which pays off when Redis is a network hop away.
    """

    kafka_url: str
    redis_url: str
    topic: str = DEFAULT_TOPIC
    group: str = "mcpbg-projector"
    batch_size: int = 500
    batch_wait: float = 0.2
    fetch_max_wait_ms: int = 50
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    progress_interval: float = 10.0
    redis_timeout: float = 5.0
    topic_wait: float = 60.0
    log_level: str = "info"
    policy: str = ""
    alert_webhook: str = ""
    alert_topic: str = "mcpbg.alerts"
    archive_dir: str = ""
    metrics_port: int = 0
    partitions: int = 0
    concurrency: int = 1
    bootstrap: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "bootstrap", parse_bootstrap(self.kafka_url))
        check_redis_url(self.redis_url, "redis_url")
        for name in ("topic", "group"):
            if not getattr(self, name):
                raise InvalidInputError(name, getattr(self, name), "must not be empty")
        for name in (
            "batch_size",
            "fetch_max_wait_ms",
            "session_timeout_ms",
            "heartbeat_interval_ms",
            "concurrency",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(name, value, "expected a positive integer")
        for name in ("batch_wait", "redis_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(name, getattr(self, name), "expected seconds > 0")
        if isinstance(self.partitions, bool) or not isinstance(self.partitions, int):
            raise InvalidInputError("partitions", self.partitions, "expected an integer >= 0")
        if self.partitions < 0:
            raise InvalidInputError("partitions", self.partitions, "expected an integer >= 0")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise InvalidInputError("log_level", self.log_level, f"one of {', '.join(_LOG_LEVELS)}")
        for name in ("progress_interval", "topic_wait"):
            if not getattr(self, name) >= 0:
                raise InvalidInputError(name, getattr(self, name), "expected seconds >= 0")
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise InvalidInputError(
                "heartbeat_interval_ms",
                self.heartbeat_interval_ms,
                f"must be below session_timeout_ms ({self.session_timeout_ms})",
            )

    @property
    def dlq_topic(self) -> str:
        return dead_letter_topic(self.topic)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> WorkerConfig:
        """Settings from ``MCPBG_*`` variables, then ``overrides`` (not None) on top."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            if not f.init:
                continue
            raw = env.get(ENV[f.name], "").strip()
            if raw:
                values[f.name] = _convert(f.name, ENV[f.name], raw, f.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for required in ("kafka_url", "redis_url"):
            if required not in values:
                raise InvalidInputError(
                    required, None, f"give --{required.replace('_', '-')} or set {ENV[required]}"
                )
        return cls(**values)


def _convert(name: str, var: str, raw: str, kind: Any) -> Any:
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise InvalidInputError(var, raw, f"expected a number for {name}") from None
    return raw


#: The worker process's gen-0 garbage collection threshold (Python's default: 700).
GC_GEN0_THRESHOLD = 50_000
#: Seconds between two commits of consumed offsets (they serve lag tools only).
COMMIT_INTERVAL = 1.0


class _Stopping(Exception):
    """The worker was told to stop while a batch was being retried."""


# -- the worker ---------------------------------------------------------------


class ProjectionWorker:
    """One consumer-group member projecting the ledger topic into Redis.

    :meth:`serve` runs it until :meth:`stop` (``run`` wires SIGTERM and
    SIGINT to it); connections are made inside ``serve``, in its event loop.

    >>> worker = ProjectionWorker(WorkerConfig("kafka://k:9092", "redis://r:6379/0"))
    >>> # await worker.serve()  in one task; worker.stop() from another
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._policy = load_policy(config.policy) if config.policy else None
        self._watcher = watcher_for(config.policy, self.replace_policy, self._policy)
        self._backend: RedisBackend | None = None
        self._projector: Projector | None = None
        self._alerts: AlertEvaluator | None = None
        self._archiver: Archiver | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._stopping = asyncio.Event()
        # Held while a batch is applied; a revocation waits for it.
        self._lock = asyncio.Lock()
        # One rebuild at a time: concurrent partition applies may all find Redis empty.
        self._rebuilding = asyncio.Lock()
        # Partitions assigned but not yet moved to their watermark (paused until then).
        self._unaligned: set[TopicPartition] = set()
        self._assignments = 0
        self._to_commit: dict[TopicPartition, int] = {}
        self._committed_at = time.monotonic()
        #: The last offset processed (applied or dead-lettered) per partition; -1: none.
        self.last_offset: dict[int, int] = {}
        self._tick_records = 0
        self._tick_at = time.monotonic()

    # -- lifecycle ----------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`serve` to finish the batch in hand, commit, leave the group and return."""
        self._stopping.set()

    async def serve(self) -> None:
        """Consume and project until :meth:`stop`; connections are released on return."""
        reporter: asyncio.Task[None] | None = None
        watcher = self._watcher
        try:
            await self._start()
            if watcher is not None:
                watcher.start()  # SIGHUP and MCPBG_POLICY_POLL reload the alert levels
            if self.config.progress_interval:
                reporter = asyncio.create_task(self._report_every(self.config.progress_interval))
            await self._consume()
        finally:
            if watcher is not None:
                await watcher.stop()
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
            await self._close()

    def replace_policy(self, policy: Policy) -> None:
        """Compare the counters with ``policy`` from the next batch on (a reload)."""
        self._policy = policy
        if self._alerts is not None:
            self._alerts.replace_policy(policy)

    async def _start(self) -> None:
        config = self.config
        self._backend = RedisBackend.from_url(
            config.redis_url, timeout=config.redis_timeout, max_connections=4
        )
        self._projector = Projector(
            self._backend,
            config.topic,
            dlq=self.send_dead_letter,
            require_epoch=True,
            archive=self._archive_batch if config.archive_dir else None,
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=config.bootstrap, acks="all", enable_idempotence=False
        )
        await self._producer.start()
        if self._policy is not None:
            self._alerts = AlertEvaluator(
                self._policy,
                self._backend,
                dedupe=RedisDeduper(self._backend.client),
                sinks=self._alert_sinks(),
            )
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=config.bootstrap,
            group_id=config.group,
            enable_auto_commit=False,
            # Every assignment seeks to the Redis watermark + 1; the reset policy only
            # matters when that offset is no longer on the topic (retention).
            auto_offset_reset="earliest",
            session_timeout_ms=config.session_timeout_ms,
            heartbeat_interval_ms=config.heartbeat_interval_ms,
            fetch_max_wait_ms=config.fetch_max_wait_ms,
            max_poll_records=config.batch_size,
        )
        self._consumer.subscribe([config.topic], listener=_Listener(self))
        await self._consumer.start()

    async def _close(self) -> None:
        """Commit what was consumed, leave the group, log the totals, release everything."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await self._commit(consumer)
            await consumer.stop()
        p = self._projector
        log.info(
            "projector: stopped after %d records, %d applied, %d dead letters",
            0 if p is None else p.records,
            0 if p is None else p.applied,
            0 if p is None else p.dead,
        )
        if self._alerts is not None:
            await self._alerts.aclose()
            self._alerts = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        if self._backend is not None:
            await self._backend.aclose()
            self._backend = None

    @property
    def projector(self) -> Projector:
        """The projector (exists once :meth:`serve` has started)."""
        assert self._projector is not None, "serve() has not started"
        return self._projector

    @property
    def backend(self) -> RedisBackend:
        assert self._backend is not None, "serve() has not started"
        return self._backend

    # -- the loop -----------------------------------------------------------

    async def _consume(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        wait_ms = round(self.config.batch_wait * 1000)
        limit = self.config.batch_size
        try:
            while not self._stopping.is_set():
                if self._unaligned:
                    await self._align(consumer)
                    continue
                batch = await consumer.getmany(timeout_ms=wait_ms, max_records=limit)
                if batch:
                    async with self._lock:
                        await self._process(consumer, batch)
                if self._to_commit and time.monotonic() - self._committed_at >= COMMIT_INTERVAL:
                    await self._commit(consumer)
        except _Stopping:
            log.info("projector: stopping with a batch not applied (it is read again later)")

    async def _process(
        self, consumer: AIOKafkaConsumer, batch: Mapping[TopicPartition, list[ConsumerRecord]]
    ) -> None:
        assigned = consumer.assignment()
        # Fetched before a partition was moved to its watermark (or after it was
        # taken away): not ours to apply; it is fetched again from the right place.
        work = [
            (tp, [(m.offset, m.value) for m in messages])
            for tp, messages in batch.items()
            if messages and tp in assigned and tp not in self._unaligned
        ]
        if self.config.concurrency > 1 and len(work) > 1:
            gate = asyncio.Semaphore(self.config.concurrency)

            async def one(partition: int, records: list[Record]) -> ProjectorResult:
                async with gate:
                    return await self._apply_until_done(partition, records)

            results = await asyncio.gather(*(one(tp.partition, recs) for tp, recs in work))
        else:
            results = [await self._apply_until_done(tp.partition, recs) for tp, recs in work]
        for (tp, _), result in zip(work, results, strict=True):
            await self.evaluate_alerts(result)
            partition = tp.partition
            self.last_offset[partition] = result.last_offset
            self._to_commit[tp] = result.last_offset + 1
            self._tick_records += result.records
            metrics.RECORDS.inc(result.records)
            metrics.APPLIED.inc(result.applied)
            metrics.DEAD.inc(result.dead)
            metrics.LAST_OFFSET.labels(str(partition)).set(result.last_offset)

    async def _apply_until_done(self, partition: int, records: Sequence[Record]) -> ProjectorResult:
        attempt = 0
        while True:
            try:
                return await self.projector.apply_batch(partition, records)
            except EpochMissingError:
                # Redis lost its state mid-run: rebuild every partition from the
                # ledger first; this batch then lands on complete counters.
                await self.rebuild_until_done()
                continue
            except Exception as exc:  # every failure: retry, never skip the batch
                attempt += 1
                delay = min(0.1 * 2**attempt, MAX_BACKOFF)
                log.warning(
                    "projector: batch of partition %d (offsets %d-%d) failed (attempt %d: "
                    "%s: %s); retrying in %.1f s",
                    partition,
                    records[0][0],
                    records[-1][0],
                    attempt,
                    type(exc).__name__,
                    exc,
                    delay,
                    exc_info=attempt == 1 and not isinstance(exc, (ConnectionError, KafkaError)),
                )
                await self._sleep_unless_stopping(delay)

    async def _sleep_unless_stopping(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)
        if self._stopping.is_set():
            raise _Stopping

    async def _commit(self, consumer: AIOKafkaConsumer) -> bool:
        """Commit the consumed offsets of partitions still assigned; False when refused."""
        assigned = consumer.assignment()
        offsets = {tp: off for tp, off in self._to_commit.items() if tp in assigned}
        self._to_commit.clear()
        self._committed_at = time.monotonic()
        if not offsets:
            return True
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # a rebalance under way: the next owner commits
            log.info("projector: offset commit refused (%s: %s)", type(exc).__name__, exc)
            return False
        return True

    # -- rebalances -----------------------------------------------------------

    def assigned(self, partitions: set[TopicPartition]) -> None:
        """Listener: hold the new partitions until the loop has moved them to their watermark."""
        mine = {tp for tp in partitions if tp.topic == self.config.topic}
        self._assignments += 1
        self._unaligned = mine
        self._to_commit.clear()
        if mine and self._consumer is not None:
            self._consumer.pause(*mine)

    async def revoked(self, partitions: set[TopicPartition]) -> None:
        """Listener: let the batch in hand finish (bounded wait), then commit what it consumed."""
        consumer = self._consumer
        self._unaligned -= partitions  # no longer ours to align
        if consumer is None or not partitions:
            return
        wait = max(self.config.session_timeout_ms / 1000, 1.0)
        try:
            await asyncio.wait_for(self._lock.acquire(), wait)
        except TimeoutError:
            log.warning("projector: the batch in hand outlasted the rebalance wait (%.0f s)", wait)
            await self._commit(consumer)
            return
        try:
            await self._commit(consumer)
        finally:
            self._lock.release()

    async def _align(self, consumer: AIOKafkaConsumer) -> None:
        """Seek, commit and resume each newly assigned partition at its watermark + 1."""
        generation = self._assignments
        mine = sorted(self._unaligned)
        offsets: dict[TopicPartition, int] = {}
        attempt = 0
        while True:
            try:
                if not await self.backend.has_epoch():
                    await self.rebuild_until_done()
                for tp in mine:
                    offsets[tp] = await self.projector.resume_offset(tp.partition)
                break
            except _Stopping:
                raise
            except Exception as exc:  # Redis down at a rebalance: wait for it
                attempt += 1
                log.warning("projector: cannot read watermarks (%s); retrying", exc)
                await self._sleep_unless_stopping(min(0.1 * 2**attempt, MAX_BACKOFF))
        if generation != self._assignments:
            return  # reassigned meanwhile: align the new assignment instead
        try:
            for tp, offset in offsets.items():
                consumer.seek(tp, offset)
        except IllegalStateError:  # revoked meanwhile; the next assignment is aligned anew
            await asyncio.sleep(0.05)
            return
        self._to_commit = dict(offsets)
        committed = await self._commit(consumer)
        if generation != self._assignments:
            return  # reassigned during the commit: align the new assignment instead
        consumer.resume(*mine)
        self._unaligned = set()
        for tp, offset in offsets.items():  # the watermark, until this worker applies more
            self.last_offset[tp.partition] = offset - 1
        log.info(
            "projector: assigned %s; resuming at %s%s",
            ",".join(str(tp.partition) for tp in mine),
            ", ".join(f"p{tp.partition}@{off}" for tp, off in offsets.items()),
            "" if committed else " (commit refused: a new rebalance follows)",
        )

    async def rebuild_until_done(self) -> None:
        """Replay the ledger into an emptied Redis, retrying until it is complete."""
        async with self._rebuilding:
            await self._rebuild_until_done()

    async def _rebuild_until_done(self) -> None:
        backend = self.backend
        attempt = 0
        while True:
            try:
                if await backend.has_epoch():
                    return  # another worker finished the rebuild meanwhile
                metrics.REBUILDS.inc()
                await rebuild(
                    backend,
                    self.config.bootstrap,
                    self.config.topic,
                    batch=max(self.config.batch_size, 500),
                )
                return
            except Exception as exc:  # Kafka or Redis away mid-rebuild: start over
                attempt += 1
                delay = min(0.1 * 2**attempt, MAX_BACKOFF)
                log.warning(
                    "rebuild: failed (%s: %s); retrying in %.1f s", type(exc).__name__, exc, delay
                )
                await self._sleep_unless_stopping(delay)

    # -- side outputs ---------------------------------------------------------

    def _alert_sinks(self) -> list[AlertSink]:
        sinks: list[AlertSink] = [LogSink()]
        if self.config.alert_webhook:
            sinks.append(WebhookSink(self.config.alert_webhook))
        if self.config.alert_topic:
            sinks.append(TopicSink(self._produce_alert, self.config.alert_topic))
        return sinks

    async def _produce_alert(self, topic: str, key: bytes, value: bytes) -> None:
        assert self._producer is not None
        await self._producer.send_and_wait(topic, value, key=key)

    async def evaluate_alerts(self, result: ProjectorResult) -> None:
        """Alerts for the counters a batch touched; never fails the batch (it is applied)."""
        if self._alerts is None or not result.charges:
            return
        try:
            await self._alerts.evaluate(result.charges)
        except Exception as exc:  # alerts are best effort: the next batch catches up
            log.warning("alerts: evaluation failed (%s: %s)", type(exc).__name__, exc)

    async def _archive_batch(
        self, partition: int, records: Sequence[tuple[int, LedgerEvent]]
    ) -> None:
        if self._archiver is None:
            self._archiver = Archiver(self.config.archive_dir, topic=self.config.topic)
            self._archiver.remove_stale_temp_files()
        # Parquet encoding and fsync off the event loop; the batch waits for it.
        await asyncio.to_thread(self._archiver.write_batch, partition, records)

    async def send_dead_letter(self, letter: DeadLetter) -> None:
        """Produce one poison record to ``<topic>.dlq`` and wait for the broker's ack."""
        log.warning(
            "projector: %s partition %d offset %d is not a valid event (%s): sent to %s",
            letter.topic,
            letter.partition,
            letter.offset,
            letter.reason,
            self.config.dlq_topic,
        )
        assert self._producer is not None
        await self._producer.send_and_wait(
            self.config.dlq_topic,
            letter.to_json(),
            key=f"{letter.topic}:{letter.partition}:{letter.offset}".encode(),
            headers=letter.headers(),
        )

    # -- progress ---------------------------------------------------------

    async def _report_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.report()
            except Exception as exc:  # a log line must never stop the worker
                log.warning("projector: progress report failed: %s", exc)

    def report(self) -> None:
        """One INFO line: events/s, totals, per partition lag and last offset."""
        now = time.monotonic()
        rate = self._tick_records / max(now - self._tick_at, 1e-9)
        self._tick_records, self._tick_at = 0, now
        consumer = self._consumer
        parts = []
        mine = [] if consumer is None else consumer.assignment()
        for tp in sorted(tp for tp in mine if tp.topic == self.config.topic):
            assert consumer is not None
            high: int | None = consumer.highwater(tp)
            last = self.last_offset.get(tp.partition)
            lag = "?"
            if high is not None and last is not None and tp not in self._unaligned:
                lag = str(max(high - (last + 1), 0))
                metrics.LAG.labels(str(tp.partition)).set(int(lag))
            parts.append(f"p{tp.partition} lag={lag} last={'-' if last is None else last}")
        p = self._projector
        log.info(
            "projector: %.0f events/s; %d records, %d applied, %d dead letters; %s",
            rate,
            0 if p is None else p.records,
            0 if p is None else p.applied,
            0 if p is None else p.dead,
            "; ".join(parts) or "no partitions assigned",
        )


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Hands aiokafka's rebalance callbacks to the worker."""

    def __init__(self, worker: ProjectionWorker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.worker.revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.worker.assigned(set(assigned))


# -- start-up -----------------------------------------------------------------


async def prepare_topics(config: WorkerConfig) -> int:
    """Wait for the ledger topic (up to ``topic_wait`` s, or create it with ``partitions``);
    create its DLQ if missing.

    Returns the ledger topic's partition count. Waiting first avoids a
    subscription to a topic that does not exist yet, which costs a
    rebalance (slow on some brokers) when it appears.
    """
    # Creating the topic gets a few seconds of its own, even with topic_wait 0.
    deadline = time.monotonic() + config.topic_wait + (10.0 if config.partitions else 0.0)
    admin = await _admin(config.bootstrap, deadline)
    try:
        said = 0.0
        while True:
            count = await _partition_count(admin, config.topic)
            if count:
                break
            if time.monotonic() >= deadline:
                raise InvalidInputError(
                    "topic",
                    config.topic,
                    f"not found on {config.bootstrap} within {config.topic_wait:g} s",
                )
            if config.partitions:
                with contextlib.suppress(TopicAlreadyExistsError):
                    await admin.create_topics([NewTopic(config.topic, config.partitions, 1)])
                    log.info(
                        "projector: created %s (%d partitions)", config.topic, config.partitions
                    )
                await asyncio.sleep(0.1)  # until the broker lists it
                continue
            if time.monotonic() - said > 5:
                log.info("projector: waiting for topic %s on %s", config.topic, config.bootstrap)
                said = time.monotonic()
            await asyncio.sleep(0.2)
        if config.dlq_topic not in await admin.list_topics():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(config.dlq_topic, count, 1)])
                log.info("projector: created %s (%d partitions)", config.dlq_topic, count)
        return count
    finally:
        await admin.close()


async def _partition_count(admin: AIOKafkaAdminClient, topic: str) -> int:
    """How many partitions ``topic`` has, 0 when the broker does not know it."""
    try:
        # Listed first: describing a missing topic is a metadata request that a
        # broker with auto-creation on answers by creating it with its default
        # partition count (tansu: 4), behind the operator's back.
        if topic not in await admin.list_topics():
            return 0
        described = await admin.describe_topics([topic])
    except KafkaError:
        return 0
    if not described or described[0].get("error_code", 0) != 0:
        return 0
    return len(described[0].get("partitions") or ())


async def _admin(bootstrap: str, deadline: float) -> AIOKafkaAdminClient:
    """A started admin client, retrying (a fresh client each time) until ``deadline``."""
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        try:
            await admin.start()
            return admin
        except (KafkaError, OSError) as exc:
            with contextlib.suppress(Exception):
                await admin.close()
            if time.monotonic() >= deadline:
                raise
            log.info("projector: Kafka at %s not reachable yet (%s); retrying", bootstrap, exc)
            await asyncio.sleep(0.5)


def run(config: WorkerConfig) -> int:
    """Run one worker until SIGTERM/SIGINT; returns the exit code (0 after a clean stop)."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s",
    )
    # A batch keeps hundreds of parsed events (pydantic models, tracked by the
    # cyclic GC) alive at once; at the default gen-0 threshold (700) the
    # collector ran every few dozen events and cost more than the parse itself
    # (benchmarks/README.md, bench_worker.py). The process is this loop alone.
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    return asyncio.run(_main(config))


async def _main(config: WorkerConfig) -> int:
    try:
        partitions = await prepare_topics(config)
    except (KafkaError, OSError) as exc:
        log.error("projector: Kafka at %s unreachable: %s", config.bootstrap, exc)
        return 1
    log.info(
        "projector: group %s, topic %s (%d partitions), Redis %s, batches of %d",
        config.group,
        config.topic,
        partitions,
        redact_url(config.redis_url),
        config.batch_size,
    )
    if config.metrics_port:
        metrics.serve(config.metrics_port)
        log.info("projector: Prometheus metrics on :%d/metrics", config.metrics_port)
    worker = ProjectionWorker(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    await worker.serve()
    return 0
