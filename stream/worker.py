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
from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord

from mcp_budget_governor.policy import Policy
from mcp_budget_governor.policy_file import load_policy
from mcp_budget_governor.policy_reload import watcher_for
from mcp_budget_governor.projections.counters.redis import RedisBackend
from mcp_budget_governor.urls import redact as redact_url

from . import metrics
from .config import ENV, WorkerConfig
from .projection import Projection
from .projector import Projector
from .retry import Stopping
from .topics import prepare_topics

if TYPE_CHECKING:  # the postgres extra is needed only by a worker given --postgres
    from mcp_budget_governor.projections.counters.postgres import PostgresBackend

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
    The consumer is this class's; the projection and its side outputs are
    :class:`~.projection.Projection`'s, shared with the faust engine.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._stopping = asyncio.Event()
        self.projection = Projection(config, send=self._send, stopping=self._stopping)
        self._watcher = watcher_for(
            config.policy, self.replace_policy, self.projection.policy, config.policy_poll
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        # Held while a batch is applied; a revocation waits for it.
        self._lock = asyncio.Lock()
        # Partitions assigned but not yet moved to their watermark (paused until then).
        self._unaligned: set[TopicPartition] = set()
        self._assignments = 0
        self._to_commit: dict[TopicPartition, int] = {}
        self._committed_at = time.monotonic()

    @property
    def _policy(self) -> Policy | None:
        return self.projection.policy

    @property
    def last_offset(self) -> dict[int, int]:
        """The last offset processed (applied or dead-lettered) per partition; -1: none."""
        return self.projection.last_offset

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
                reporter = asyncio.create_task(
                    self.projection.report_every(self.config.progress_interval, self._highwater)
                )
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
        self.projection.replace_policy(policy)

    async def _start(self) -> None:
        config = self.config
        self._producer = AIOKafkaProducer(
            bootstrap_servers=config.bootstrap, acks="all", enable_idempotence=False
        )
        await self._producer.start()
        self.projection.start()
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
        await self.projection.aclose()
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def _send(
        self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]] | None
    ) -> None:
        assert self._producer is not None
        await self._producer.send_and_wait(topic, value, key=key, headers=headers)

    @property
    def projector(self) -> Projector:
        """The projector (exists once :meth:`serve` has started)."""
        return self.projection.projector

    @property
    def backend(self) -> RedisBackend | PostgresBackend:
        return self.projection.backend

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
            (tp.partition, [(m.offset, m.value) for m in messages])
            for tp, messages in batch.items()
            if messages and tp in assigned and tp not in self._unaligned
        ]
        for result in await self.projection.apply_all(work):
            self._to_commit[TopicPartition(self.config.topic, result.partition)] = (
                result.last_offset + 1
            )

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
        resume = await self.projection.resume_offsets(tp.partition for tp in mine)
        offsets = {tp: resume[tp.partition] for tp in mine}
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
        self.projection.resumed(resume, committed)

    async def rebuild_until_done(self) -> None:
        """Replay the ledger into an emptied Redis, retrying until it is complete."""
        await self.projection.rebuild_until_done()

    # -- progress ---------------------------------------------------------

    def _highwater(self) -> dict[int, int | None]:
        """Each assigned partition's highwater as last fetched (None until aligned)."""
        consumer = self._consumer
        mine = [] if consumer is None else consumer.assignment()
        return {
            tp.partition: None if tp in self._unaligned else consumer.highwater(tp)
            for tp in mine
            if consumer is not None and tp.topic == self.config.topic
        }

    def report(self) -> None:
        """One INFO line: events/s, totals, per partition lag and last offset."""
        self.projection.report(self._highwater())


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
    prepare_process(config)
    return asyncio.run(_main(config))


def prepare_process(config: WorkerConfig) -> None:
    """What a worker process of either engine sets first: its log format and GC threshold."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s",
    )
    # A batch keeps hundreds of parsed events (pydantic models, tracked by the
    # cyclic GC) alive at once; at the default gen-0 threshold (700) the
    # collector ran every few dozen events and cost more than the parse itself
    # (benchmarks/README.md, bench_worker.py). The process is this loop alone.
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


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
