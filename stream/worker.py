"""The stream worker: an aiokafka consumer-group member that projects the ledger into Redis.

``mcpbg worker --kafka-url kafka://host:9092 --redis-url redis://host:6379/0``
(or the same settings as environment variables, see :mod:`.config`) runs one
member of the consumer group ``--group``; start several and they split the
topic's partitions. State lives in Redis only: each assignment resumes right
after the partition's Redis watermark, each partition's share of a fetch is
one ``apply`` call, a failed batch is retried until it lands (:mod:`.retry`),
never skipped. How it stays exact: docs/worker.md.

>>> from mcp_budget_governor.stream.config import WorkerConfig
>>> worker = ProjectionWorker(WorkerConfig("kafka://k:9092", "redis://r:6379/0"))
>>> # await worker.serve()  in one task; worker.stop() from another
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord

from mcp_budget_governor.errors import EpochMissingError
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.policy_file import load_policy
from mcp_budget_governor.policy_reload import watcher_for
from mcp_budget_governor.projections.counters.redis import RedisBackend
from mcp_budget_governor.urls import redact as redact_url

from . import metrics
from .alerts import (
    AlertEvaluator,
    AlertSink,
    LogSink,
    MemoryDeduper,
    RedisDeduper,
    TopicSink,
    WebhookSink,
)
from .archiver import Archiver
from .config import ENV, WorkerConfig
from .projector import DeadLetter, Projector, ProjectorResult, Record
from .rebuild import rebuild
from .retry import Stopping, until_done
from .topics import prepare_topics

if TYPE_CHECKING:  # the postgres extra is needed only by a worker given --postgres
    from mcp_budget_governor.projections.counters.postgres import PostgresBackend

__all__ = ["ENV", "ProjectionWorker", "WorkerConfig", "load_policy", "prepare_topics", "run"]

log = logging.getLogger(__name__)


#: The worker process's gen-0 garbage collection threshold (Python's default: 700).
GC_GEN0_THRESHOLD = 50_000
#: Seconds between two commits of consumed offsets (they serve lag tools only).
COMMIT_INTERVAL = 1.0


# -- the worker ---------------------------------------------------------------


class ProjectionWorker:
    """One consumer-group member projecting the ledger topic into Redis.

    :meth:`serve` runs it until :meth:`stop` (``run`` wires SIGTERM and
    SIGINT to it); connections are made inside ``serve``, in its event loop.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._policy = load_policy(config.policy) if config.policy else None
        self._watcher = watcher_for(
            config.policy, self.replace_policy, self._policy, config.policy_poll
        )
        self._backend: RedisBackend | PostgresBackend | None = None
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
        if config.postgres_url:
            from mcp_budget_governor.projections.counters.postgres import PostgresBackend

            # A batch apply is one function call; it may take longer than a check.
            self._backend = PostgresBackend.from_url(
                config.postgres_url, timeout=max(config.redis_timeout, 30.0), max_connections=4
            )
        else:
            assert config.redis_url is not None  # WorkerConfig requires one of the two
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
                dedupe=(
                    RedisDeduper(self._backend.client)
                    if isinstance(self._backend, RedisBackend)
                    else MemoryDeduper()  # per worker: a level may fire once per worker
                ),
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
    def backend(self) -> RedisBackend | PostgresBackend:
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
        except Stopping:
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
        async def attempt() -> ProjectorResult:
            while True:
                try:
                    return await self.projector.apply_batch(partition, records)
                except EpochMissingError:
                    # Redis lost its state mid-run: rebuild every partition from the
                    # ledger first; this batch then lands on complete counters.
                    await self.rebuild_until_done()

        def failed(exc: Exception, number: int, delay: float) -> None:
            log.warning(
                "projector: batch of partition %d (offsets %d-%d) failed (attempt %d: "
                "%s: %s); retrying in %.1f s",
                partition,
                records[0][0],
                records[-1][0],
                number,
                type(exc).__name__,
                exc,
                delay,
                exc_info=number == 1 and not isinstance(exc, (ConnectionError, KafkaError)),
            )

        return await until_done(attempt, self._stopping, failed)

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

        async def watermarks() -> dict[TopicPartition, int]:
            if not await self.backend.has_epoch():
                await self.rebuild_until_done()
            return {tp: await self.projector.resume_offset(tp.partition) for tp in mine}

        def failed(exc: Exception, number: int, delay: float) -> None:  # Redis down: wait
            log.warning("projector: cannot read watermarks (%s); retrying", exc)

        offsets = await until_done(watermarks, self._stopping, failed)
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

        async def attempt() -> None:
            if await backend.has_epoch():
                return  # another worker finished the rebuild meanwhile
            metrics.REBUILDS.inc()
            batch = max(self.config.batch_size, 500)
            await rebuild(backend, self.config.bootstrap, self.config.topic, batch=batch)

        def failed(exc: Exception, number: int, delay: float) -> None:  # Kafka or Redis away
            log.warning(
                "rebuild: failed (%s: %s); retrying in %.1f s", type(exc).__name__, exc, delay
            )

        await until_done(attempt, self._stopping, failed)

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
        "projector: group %s, topic %s (%d partitions), %s %s, batches of %d",
        config.group,
        config.topic,
        partitions,
        "Postgres" if config.postgres_url else "Redis",
        redact_url(config.postgres_url or config.redis_url or ""),
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
