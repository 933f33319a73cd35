"""The stream worker: a faust-streaming app that projects the ledger topic into Redis.

``mcpbg worker --kafka-url kafka://host:9092 --redis-url redis://host:6379/0``
(or the same settings as ``MCPBG_*`` environment variables, see
:class:`WorkerConfig`) runs one member of the consumer group ``--group``;
start several and they split the topic's partitions.

How it stays exact (see also :mod:`.projector`):

- **State lives in Redis only.** No faust tables (their recovery leans on end
  offsets, which the test broker reports wrongly, and they would be a second
  copy of the counters). The faust app is a plain agent over the topic.
- **Resume from the watermark.** Whenever the group hands this worker its
  partitions, the worker commits the Redis watermark + 1 of each as the
  group's offset and seeks there, just before faust seeks every partition to
  its committed offset. Reading therefore resumes right after the last event
  the counters hold, whatever the group had committed: behind it (a worker
  killed between its Redis apply and its Kafka commit) nothing is read
  twice; ahead of it (a batch acknowledged but not applied) the gap is read
  again instead of lost; a Redis found empty at an assignment (watermark
  gone) replays the topic from its start. Kafka's committed offsets are
  kept for lag tools only.
- **Batches.** ``stream.take_events(batch_size, within=batch_wait)`` hands
  the agent up to ``batch_size`` records; each partition's share is applied
  in one ``backend.apply`` call (one Lua script, one round trip). faust
  acknowledges the records after the agent's loop body returns, and commits
  acknowledged offsets to the group every ``broker_commit_interval``.
- **Never skip a batch.** A failed apply (Redis unreachable) or dead-letter
  send (Kafka unreachable) is retried with backoff until it succeeds: a batch
  body that raised would still be acknowledged by faust and its events would
  be skipped until the next rebalance.
- **Dead letters** go to ``<topic>.dlq`` (created with the ledger topic's
  partition count when missing): value = JSON with the reason, source topic,
  partition, offset and the original bytes in base64; the same facts as
  headers; key = ``<topic>:<partition>:<offset>``.
- **Shutdown.** SIGTERM (or SIGINT) lets faust stop gracefully: the fetcher
  stops, the batch in hand is finished and acknowledged, offsets are
  committed, and the process exits 0.
- **Progress.** Every ``progress_interval`` seconds one INFO line: events/s
  since the last line, totals, and per partition the lag (highwater reported
  by the last fetch minus the fetch position) and the last offset processed.

Settings for the test broker (tansu), which this worker must not lean on:
no transactions or idempotent producer are used (processing guarantee
at-least-once, exactness comes from the watermark), nothing reads
``end_offsets`` (the lag uses fetched highwater marks), and the faust web
server is off so several workers can share a machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

import faust
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError
from faust.types import TP, EventT, StreamT

from mcp_budget_governor.errors import EpochMissingError, InvalidInputError
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.producers.kafka_ledger import parse_bootstrap
from mcp_budget_governor.projections.redis_counters import RedisBackend

from . import metrics
from .alerts import AlertEvaluator, AlertSink, LogSink, RedisDeduper, TopicSink, WebhookSink
from .archiver import Archiver
from .projector import DeadLetter, Projector, ProjectorResult, dead_letter_topic
from .rebuild import rebuild

__all__ = ["ENV", "ProjectionWorker", "WorkerConfig", "build_app", "prepare_topics", "run"]

log = logging.getLogger(__name__)

#: Environment variable of each setting (an option of ``mcpbg worker`` wins over it).
ENV: Mapping[str, str] = {
    "kafka_url": "MCPBG_KAFKA_URL",
    "redis_url": "MCPBG_REDIS_URL",
    "topic": "MCPBG_TOPIC",
    "group": "MCPBG_GROUP",
    "batch_size": "MCPBG_BATCH_SIZE",
    "batch_wait": "MCPBG_BATCH_WAIT",
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
    - ``group``: the consumer group (and faust app id) the workers share.
    - ``batch_size``: most records handed to the projector at once;
      ``batch_wait``: seconds a smaller batch may wait to fill.
    - ``session_timeout_ms`` / ``heartbeat_interval_ms``: group membership;
      a killed worker's partitions move after the session timeout.
    - ``progress_interval``: seconds between progress lines (0: none).
    - ``redis_timeout``: seconds one Redis call may take (a batch is one call).
    - ``topic_wait``: seconds to wait at start for the ledger topic to exist.
    - ``policy``: ``package.module:attribute`` naming the :class:`Policy` whose
      ``alert_at`` levels, breakers and shadow limits raise alerts; empty: no alerts.
    - ``alert_webhook``: an http(s) URL each alert is POSTed to (optional).
    - ``alert_topic``: the Kafka topic alerts go to (default ``mcpbg.alerts``;
      empty: none). Alerts are always logged (WARNING).
    - ``archive_dir``: where each batch is written as Parquet (see
      :mod:`.archiver`) *before* it is applied; empty: no archive.
    - ``metrics_port``: serve Prometheus metrics on this port (0: off).
    """

    kafka_url: str
    redis_url: str
    topic: str = "mcpbg.ledger"
    group: str = "mcpbg-projector"
    batch_size: int = 500
    batch_wait: float = 0.2
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
    bootstrap: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "bootstrap", parse_bootstrap(self.kafka_url))
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidInputError("redis_url", self.redis_url, "expected redis://host:port/db")
        for name in ("topic", "group"):
            if not getattr(self, name):
                raise InvalidInputError(name, getattr(self, name), "must not be empty")
        for name in ("batch_size", "session_timeout_ms", "heartbeat_interval_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(name, value, "expected a positive integer")
        for name in ("batch_wait", "redis_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(name, getattr(self, name), "expected seconds > 0")
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


# -- the worker ---------------------------------------------------------------


class ProjectionWorker:
    """The faust app's state and callbacks: projector, alignment, progress.

    Created by :func:`build_app`; the Redis connection is made on first use,
    inside the app's event loop.
    """

    def __init__(self, config: WorkerConfig, app: faust.App) -> None:
        self.config = config
        self.app = app
        self._projector: Projector | None = None
        self._backend: RedisBackend | None = None
        self._alerts: AlertEvaluator | None = None
        self._archiver: Archiver | None = None
        self._policy = load_policy(config.policy) if config.policy else None
        #: The last offset processed (applied or dead-lettered) per partition; -1: none.
        self.last_offset: dict[int, int] = {}
        self._tick_records = 0
        self._tick_at = time.monotonic()

    @property
    def projector(self) -> Projector:
        if self._projector is None:
            self._backend = RedisBackend.from_url(
                self.config.redis_url, timeout=self.config.redis_timeout, max_connections=4
            )
            self._projector = Projector(
                self._backend,
                self.config.topic,
                dlq=self.send_dead_letter,
                require_epoch=True,
                archive=self._archive_batch if self.config.archive_dir else None,
            )
            if self._policy is not None:
                self._alerts = AlertEvaluator(
                    self._policy,
                    self._backend,
                    dedupe=RedisDeduper(self._backend.client),
                    sinks=self._alert_sinks(),
                )
        return self._projector

    def _alert_sinks(self) -> list[AlertSink]:
        sinks: list[AlertSink] = [LogSink()]
        if self.config.alert_webhook:
            sinks.append(WebhookSink(self.config.alert_webhook))
        if self.config.alert_topic:
            sinks.append(TopicSink(self._produce_alert, self.config.alert_topic))
        return sinks

    async def _produce_alert(self, topic: str, key: bytes, value: bytes) -> None:
        await self.app.producer.send_and_wait(topic, key, value, None, None, None)

    async def evaluate_alerts(self, result: ProjectorResult) -> None:
        """Alerts for the counters a batch touched; never fails the batch (it is applied)."""
        if self._alerts is None or not result.charges:
            return
        try:
            await self._alerts.evaluate(result.charges)
        except Exception as exc:  # alerts are best effort: the next batch catches up
            log.warning("alerts: evaluation failed (%s: %s)", type(exc).__name__, exc)

    async def aclose(self) -> None:
        """Log the totals and release the Redis connections (at the app's stop)."""
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
        if self._backend is not None:
            await self._backend.aclose()
            self._backend = None
            self._projector = None

    # -- the agent --------------------------------------------------------

    async def consume(self, stream: StreamT[bytes]) -> None:
        """The agent body: batches of events, split by partition, each applied once.

        faust acknowledges a batch's records when this loop asks for the
        next batch, so everything in it must be applied by then.
        """
        # take_events is on faust's Stream, not on the StreamT interface agents get.
        batches = cast(faust.Stream[bytes], stream).take_events(
            self.config.batch_size, self.config.batch_wait
        )
        async for events in batches:
            for partition, records in _by_partition(events).items():
                result = await self._apply_until_done(partition, records)
                await self.evaluate_alerts(result)
                self.last_offset[partition] = result.last_offset
                self._tick_records += result.records
                metrics.RECORDS.inc(result.records)
                metrics.APPLIED.inc(result.applied)
                metrics.DEAD.inc(result.dead)
                metrics.LAST_OFFSET.labels(str(partition)).set(result.last_offset)

    async def _apply_until_done(
        self, partition: int, records: Sequence[tuple[int, bytes | None]]
    ) -> ProjectorResult:
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
                await asyncio.sleep(delay)

    async def rebuild_until_done(self) -> None:
        """Replay the ledger into an emptied Redis, retrying until it is complete."""
        projector = self.projector  # connects
        assert self._backend is not None
        attempt = 0
        while True:
            try:
                if await self._backend.has_epoch():
                    return  # another worker finished the rebuild meanwhile
                metrics.REBUILDS.inc()
                await rebuild(
                    self._backend,
                    self.config.bootstrap,
                    projector.topic,
                    batch=max(self.config.batch_size, 500),
                )
                return
            except Exception as exc:  # Kafka or Redis away mid-rebuild: start over
                attempt += 1
                delay = min(0.1 * 2**attempt, MAX_BACKOFF)
                log.warning(
                    "rebuild: failed (%s: %s); retrying in %.1f s", type(exc).__name__, exc, delay
                )
                await asyncio.sleep(delay)

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
        await self.app.producer.send_and_wait(
            self.config.dlq_topic,
            f"{letter.topic}:{letter.partition}:{letter.offset}".encode(),
            letter.to_json(),
            None,
            None,
            letter.headers(),
        )

    # -- resume from the watermark ----------------------------------------

    async def align_offsets(self, *_: Any, **__: Any) -> None:
        """Commit, and seek to, watermark + 1 of every assigned ledger partition.

        Runs on faust's ``on_rebalance_complete`` signal, which faust sends
        right before it seeks each partition to its committed offset; so
        reading resumes where the counters stop (see the module docstring).
        ``_commit`` is faust's own path to the consumer thread's commit (the
        public ``commit`` only commits acknowledged offsets); it is private,
        and ``test_group_offsets_ahead_of_redis_are_realigned_to_the_watermark``
        fails should a faust release change it.
        """
        consumer = self.app.consumer
        mine = sorted(tp for tp in consumer.assignment() if tp.topic == self.config.topic)
        if not mine:
            return
        offsets: dict[TP, int] = {}
        attempt = 0
        while True:
            try:
                if not await self._has_epoch():
                    await self.rebuild_until_done()
                for tp in mine:
                    offsets[tp] = await self.projector.resume_offset(tp.partition)
                break
            except Exception as exc:  # Redis down at a rebalance: wait for it
                attempt += 1
                log.warning("projector: cannot read watermarks (%s); retrying", exc)
                await asyncio.sleep(min(0.1 * 2**attempt, MAX_BACKOFF))
        committed = await consumer._commit(offsets)  # type: ignore[attr-defined]
        # faust's seek to committed offsets skips an offset of 0 (aiokafka's
        # seek_to_committed only seeks to offsets > 0) and the position would stay
        # where the group's old offset put it: seek every partition ourselves.
        await consumer.seek_wait(offsets)
        for tp, offset in offsets.items():  # the watermark, until this worker applies more
            self.last_offset[tp.partition] = offset - 1
        log.info(
            "projector: assigned %s; resuming at %s%s",
            ",".join(str(tp.partition) for tp in mine),
            ", ".join(f"p{tp.partition}@{off}" for tp, off in offsets.items()),
            "" if committed else " (commit refused: a new rebalance follows)",
        )

    async def _has_epoch(self) -> bool:
        self.projector  # noqa: B018 - connects
        assert self._backend is not None
        return await self._backend.has_epoch()

    # -- progress ---------------------------------------------------------

    async def report(self) -> None:
        """One INFO line: events/s, totals, per partition lag and last offset."""
        now = time.monotonic()
        rate = self._tick_records / max(now - self._tick_at, 1e-9)
        self._tick_records, self._tick_at = 0, now
        consumer = self.app.consumer
        parts = []
        for tp in sorted(tp for tp in consumer.assignment() if tp.topic == self.config.topic):
            high: int | None = consumer.highwater(tp)
            position = await consumer.position(tp)
            lag = "?" if high is None or position is None else str(max(high - position, 0))
            if lag != "?":
                metrics.LAG.labels(str(tp.partition)).set(int(lag))
            last = self.last_offset.get(tp.partition)
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


def load_policy(spec: str) -> Policy:
    """The :class:`Policy` named by ``package.module:attribute``."""
    import importlib

    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise InvalidInputError("policy", spec, "expected package.module:attribute")
    try:
        policy = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise InvalidInputError("policy", spec, f"cannot load it ({exc})") from None
    if not isinstance(policy, Policy):
        raise InvalidInputError("policy", spec, f"not a Policy but {type(policy).__name__}")
    return policy


def _by_partition(events: Sequence[EventT[bytes]]) -> dict[int, list[tuple[int, bytes | None]]]:
    """Each partition's records in offset order, a re-delivered offset kept once.

    The projector requires ascending offsets (the watermark would skip a late
    one); a batch never holds anything else, but a repeat after a seek must
    not stall the partition.
    """
    grouped: dict[int, dict[int, bytes | None]] = defaultdict(dict)
    for event in events:
        message = event.message
        value = message.value
        grouped[message.partition].setdefault(
            message.offset, None if value is None else bytes(value)
        )
    return {p: sorted(records.items()) for p, records in grouped.items()}


def build_app(config: WorkerConfig, *, datadir: str | None = None) -> faust.App:
    """The faust app of one worker: one agent over the ledger topic, no tables, no web."""
    app = faust.App(
        config.group,
        broker=[f"kafka://{host}" for host in config.bootstrap.split(",")],
        value_serializer="raw",
        key_serializer="raw",
        # Every assignment seeks to the Redis watermark + 1; the reset policy only
        # matters when that offset is no longer on the topic (retention).
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=config.session_timeout_ms / 1000,
        broker_heartbeat_interval=config.heartbeat_interval_ms / 1000,
        # No leader topic, no web server, nothing on disk worth keeping.
        topic_disable_leader=True,
        web_enabled=False,
        datadir=datadir or tempfile.gettempdir(),
        producer_acks=-1,
    )
    worker = ProjectionWorker(config, app)
    topic = app.topic(config.topic, value_type=bytes, key_type=bytes)
    app.agent(topic, name=f"{config.group}.projector", concurrency=1)(worker.consume)
    app.on_rebalance_complete.connect(worker.align_offsets, weak=False)
    if config.progress_interval:
        app.timer(config.progress_interval, name=f"{config.group}.progress")(worker.report)

    @app.service
    class _Closer(faust.Service):
        async def on_stop(self) -> None:
            await worker.aclose()

    return app


# -- start-up -----------------------------------------------------------------


async def prepare_topics(config: WorkerConfig) -> int:
    """Wait for the ledger topic (up to ``topic_wait`` s); create its DLQ if missing.

    Returns the ledger topic's partition count. Waiting first avoids a
    subscription to a topic that does not exist yet, which costs a
    rebalance (slow on some brokers) when it appears.
    """
    deadline = time.monotonic() + config.topic_wait
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
    # One loop for the start-up checks and for faust, which takes the current one.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    datadir = tempfile.mkdtemp(prefix="mcpbg-worker-")
    try:
        try:
            partitions = loop.run_until_complete(prepare_topics(config))
        except (KafkaError, OSError) as exc:
            log.error("projector: Kafka at %s unreachable: %s", config.bootstrap, exc)
            return 1
        log.info(
            "projector: group %s, topic %s (%d partitions), Redis %s, batches of %d",
            config.group,
            config.topic,
            partitions,
            _redact(config.redis_url),
            config.batch_size,
        )
        if config.metrics_port:
            metrics.serve(config.metrics_port)
            log.info("projector: Prometheus metrics on :%d/metrics", config.metrics_port)
        app = build_app(config, datadir=datadir)
        worker = faust.Worker(app, loop=loop, loglevel=config.log_level, quiet=True)
        try:
            worker.execute_from_commandline()
        except SystemExit as exit_:
            code = exit_.code
            return code if isinstance(code, int) else (0 if code is None else 1)
        return 0  # pragma: no cover - execute_from_commandline always exits
    finally:
        shutil.rmtree(datadir, ignore_errors=True)


def _redact(url: str) -> str:
    """A URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"
