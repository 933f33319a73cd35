"""What every worker engine shares: the projector, its side outputs, and the rules around a batch.

An engine (the aiokafka loop in :mod:`.worker`, the faust agent in
:mod:`.faust_app`) owns the consumer: group membership, fetching, seeking and
committing. Everything else is here, once: the Redis backend and the
:class:`~.projector.Projector`, a batch retried until it lands, the rebuild of
an emptied Redis (one at a time), the watermarks an assignment resumes from,
alerts, the Parquet archive, dead letters (through the engine's producer),
metrics and the progress line. docs/worker.md says how the rules fit together.

>>> import asyncio
>>> from mcp_budget_governor.stream.config import WorkerConfig
>>> projection = Projection(WorkerConfig("kafka://k:9092", "redis://r:6379/0"),
...                         send=None, stopping=asyncio.Event())
>>> # in the engine's loop: projection.start(send); await projection.apply_all([(0, records)])
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import orjson
from aiokafka.errors import KafkaError

from mcp_budget_governor.errors import EpochMissingError
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.policy_file import load_policy
from mcp_budget_governor.projections.counters.cluster import SLOTS, ClusterBackend
from mcp_budget_governor.projections.counters.redis import RedisBackend
from mcp_budget_governor.settings import SETTINGS

from . import dead_log, metrics
from .alerts import (
    AlertEvaluator,
    AlertSink,
    LogSink,
    MemoryDeduper,
    RedisDeduper,
    RedisLogSink,
    TopicSink,
    WebhookSink,
)
from .archiver import Archiver
from .compaction import Compactor
from .config import WorkerConfig
from .projector import DeadLetter, Projector, ProjectorResult, Record
from .rebuild import EpochBackend, rebuild
from .retry import until_done

if TYPE_CHECKING:  # the postgres extra is needed only by a worker given --postgres
    from mcp_budget_governor.projections.counters.postgres import PostgresBackend

__all__ = ["Projection", "Send"]

log = logging.getLogger("mcp_budget_governor.stream.worker")

#: Seconds between two looks at whether an archive segment is due for compaction.
COMPACT_TICK = 1.0

#: The engine's producer: ``send(topic, key, value, headers)``, awaited until the broker acks.
Send = Callable[[str, bytes, bytes, list[tuple[str, bytes]] | None], Awaitable[None]]


class Projection:
    """The engine-independent half of a worker; ``start`` connects, ``aclose`` releases.

    ``send`` produces dead letters and alerts through the engine's producer;
    ``stopping`` ends every retry (the engine sets it on SIGTERM).
    """

    def __init__(self, config: WorkerConfig, *, send: Send | None, stopping: asyncio.Event) -> None:
        self.config = config
        self._send = send
        self._stopping = stopping
        self.policy = load_policy(config.policy) if config.policy else None
        self._backend: RedisBackend | PostgresBackend | None = None
        self._projector: Projector | None = None
        self._alerts: AlertEvaluator | None = None
        self._archiver: Archiver | None = None
        self._compactor: Compactor | None = None
        self._compaction: asyncio.Task[None] | None = None
        # One rebuild at a time: concurrent partition applies may all find Redis empty.
        self._rebuilding = asyncio.Lock()
        #: The last offset processed (applied or dead-lettered) per partition; -1: none.
        self.last_offset: dict[int, int] = {}
        self._tick_records = 0
        self._tick_at = time.monotonic()

    # -- lifecycle ----------------------------------------------------------

    def start(self, send: Send | None = None) -> None:
        """Create the counters' backend (Redis, or Postgres given ``postgres_url``), the
        projector and the alert evaluator (in the running loop)."""
        if send is not None:
            self._send = send
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
                config.redis_url,
                timeout=config.redis_timeout,
                max_connections=4,
                caps_refresh=config.caps_refresh,  # Redis Cluster's copy of run-time caps
            )
        self._projector = Projector(
            self._backend,
            config.topic,
            dlq=self.send_dead_letter,
            require_epoch=True,
            archive=self._archive_batch if config.archive_dir else None,
        )
        if self.policy is not None:
            self._alerts = AlertEvaluator(
                self.policy,
                self._backend,
                dedupe=(
                    RedisDeduper(self._backend.client)
                    if isinstance(self._backend, RedisBackend)
                    else MemoryDeduper()  # per worker: a level may fire once per worker
                ),
                sinks=self._alert_sinks(),
                forecast=bool(config.alert_forecast),
            )

    async def aclose(self) -> None:
        """Log the totals and release the alerts' and Redis' connections."""
        await self._stop_compaction()
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

    def replace_policy(self, policy: Policy) -> None:
        """Compare the counters with ``policy`` from the next batch on (a reload)."""
        self.policy = policy
        if self._alerts is not None:
            self._alerts.replace_policy(policy)

    @property
    def projector(self) -> Projector:
        """The projector (exists once :meth:`start` has run)."""
        assert self._projector is not None, "start() has not run"
        return self._projector

    @property
    def backend(self) -> RedisBackend | PostgresBackend:
        assert self._backend is not None, "start() has not run"
        return self._backend

    # -- batches ------------------------------------------------------------

    async def apply_all(
        self, work: Sequence[tuple[int, Sequence[Record]]]
    ) -> list[ProjectorResult]:
        """Apply each partition's share of a fetch (one ``apply`` each), then account for it.

        With ``concurrency`` above 1 several shares are in flight at once.
        Each is retried until it lands (:meth:`apply_until_done`); then its
        alerts are evaluated and its offsets, metrics and progress noted.
        """
        if self.config.concurrency > 1 and len(work) > 1:
            gate = asyncio.Semaphore(self.config.concurrency)

            async def one(partition: int, records: Sequence[Record]) -> ProjectorResult:
                async with gate:
                    return await self.apply_until_done(partition, records)

            results = await asyncio.gather(*(one(p, recs) for p, recs in work))
        else:
            results = [await self.apply_until_done(p, recs) for p, recs in work]
        for result in results:
            await self.evaluate_alerts(result)
            partition = result.partition
            self.last_offset[partition] = result.last_offset
            self._tick_records += result.records
            metrics.RECORDS.inc(result.records)
            metrics.APPLIED.inc(result.applied)
            metrics.DEAD.inc(result.dead)
            metrics.LAST_OFFSET.labels(str(partition)).set(result.last_offset)
        return results

    async def apply_until_done(self, partition: int, records: Sequence[Record]) -> ProjectorResult:
        """One batch of one partition, retried with backoff until it lands (never skipped)."""

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

    # -- assignments ----------------------------------------------------------

    async def resume_offsets(self, partitions: Iterable[int]) -> dict[int, int]:
        """Watermark + 1 of each partition, rebuilding an emptied Redis first; retried."""
        mine = sorted(partitions)

        async def watermarks() -> dict[int, int]:
            if not await self.backend.has_epoch():
                await self.rebuild_until_done()
            return {p: await self.projector.resume_offset(p) for p in mine}

        def failed(exc: Exception, number: int, delay: float) -> None:  # Redis down: wait
            log.warning("projector: cannot read watermarks (%s); retrying", exc)

        return await until_done(watermarks, self._stopping, failed)

    def resumed(self, offsets: Mapping[int, int], committed: bool) -> None:
        """Note (and log) that reading resumes at ``offsets`` (partition -> next offset)."""
        for partition, offset in offsets.items():  # the watermark, until more is applied
            self.last_offset[partition] = offset - 1
        log.info(
            "projector: assigned %s; resuming at %s%s",
            ",".join(str(p) for p in sorted(offsets)),
            ", ".join(f"p{p}@{off}" for p, off in sorted(offsets.items())),
            "" if committed else " (commit refused: a new rebalance follows)",
        )

    async def rebuild_until_done(self) -> None:
        """Replay the ledger into an emptied Redis (on a cluster: the slots of the shards
        that restarted empty), retrying until it is complete."""
        async with self._rebuilding:
            backend = self.backend

            async def attempt() -> None:
                if await backend.has_epoch():
                    return  # another worker finished the rebuild meanwhile
                metrics.REBUILDS.inc()
                batch = max(self.config.batch_size, 500)
                # On Redis Cluster only the slots whose marker is missing (the shard
                # that restarted empty) are rebuilt; the other shards are not touched.
                target: EpochBackend = backend
                if isinstance(backend, ClusterBackend):
                    target = lost = await backend.lost()
                    log.warning(
                        "rebuild: %d of %d slots of the cluster lost their state; only they "
                        "are rebuilt",
                        len(lost.slots),
                        SLOTS,
                    )
                # The watermarks end at the topic's end: the live path will not read
                # these events again, so they reach the archive here.
                archive = self._archive_batch if self.config.archive_dir else None
                await rebuild(
                    target,
                    self.config.bootstrap,
                    self.config.topic,
                    batch=batch,
                    archive=archive,
                    dead=self._rebuild_dead,
                )

            def failed(exc: Exception, number: int, delay: float) -> None:  # Kafka/Redis away
                log.warning(
                    "rebuild: failed (%s: %s); retrying in %.1f s", type(exc).__name__, exc, delay
                )

            await until_done(attempt, self._stopping, failed)

    # -- side outputs ---------------------------------------------------------

    def _alert_sinks(self) -> list[AlertSink]:
        sinks: list[AlertSink] = [LogSink()]
        if self.config.alert_webhook:
            secret = self.config.alert_webhook_secret or None
            if secret is None:
                variable = SETTINGS["alert_webhook_secret"].env
                log.warning("alerts: the webhook is not signed: set %s", variable)
            sinks.append(WebhookSink(self.config.alert_webhook, secret=secret))
        if self.config.alert_topic:
            sinks.append(TopicSink(self._produce_alert, self.config.alert_topic))
        if self.config.alert_keep and isinstance(self._backend, RedisBackend):
            # The latest alerts where mcpbg serve (which always has Redis) reads them.
            sinks.append(RedisLogSink(self._backend.client, self.config.alert_keep))
        return sinks

    async def _produce_alert(self, topic: str, key: bytes, value: bytes) -> None:
        assert self._send is not None
        await self._send(topic, key, value, None)

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
            await asyncio.to_thread(self._start_archive)
            self._compaction = asyncio.create_task(self._compact_every(COMPACT_TICK))
        assert self._archiver is not None and self._compactor is not None
        # Parquet encoding and fsync off the event loop; the batch waits for it.
        written = await asyncio.to_thread(self._archiver.write_batch, partition, records)
        self._compactor.noted(written)

    def _start_archive(self) -> None:
        """The archiver, and its compactor, once what a killed worker left is cleaned up."""
        config = self.config
        archiver = Archiver(config.archive_dir, topic=config.topic)
        archiver.remove_stale_temp_files()
        compactor = Compactor(
            config.archive_dir,
            config.topic,
            max_bytes=config.archive_segment_mb * 1_000_000,
            max_age=config.archive_segment_age,
        )
        compactor.start()
        self._archiver, self._compactor = archiver, compactor

    async def _compact_every(self, interval: float) -> None:
        """Compact what is due, off the event loop, every ``interval`` seconds (until cancelled)."""
        compactor = self._compactor
        assert compactor is not None
        while True:
            await asyncio.sleep(interval)
            if not compactor.due():
                continue
            try:
                written = await asyncio.to_thread(compactor.run_due)
            except Exception as exc:  # the sources stay; the next round tries again
                log.warning("archive: compaction failed (%s: %s)", type(exc).__name__, exc)
                continue
            if written:
                log.info("archive: %d compacted segment(s) written", written)

    async def _stop_compaction(self) -> None:
        """On a clean stop: compact every small segment noted, delete every source due."""
        task, self._compaction = self._compaction, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._compactor is not None:
            try:
                await asyncio.to_thread(self._compactor.run_due, everything=True)
            except Exception as exc:  # the next start finishes it
                log.warning("archive: compaction at stop failed (%s: %s)", type(exc).__name__, exc)

    async def _rebuild_dead(
        self, partition: int, offset: int, raw: bytes | None, reason: str
    ) -> None:
        await self.send_dead_letter(DeadLetter(self.config.topic, partition, offset, reason, raw))

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
        if self.config.archive_dir:
            # The archive holds the batch already (it is written before the apply):
            # its readers must know the record was not applied.
            await asyncio.to_thread(
                dead_log.append,
                self.config.archive_dir,
                letter.topic,
                letter.partition,
                letter.offset,
                _event_id(letter.raw),
                letter.reason,
            )
        assert self._send is not None
        await self._send(
            self.config.dlq_topic,
            f"{letter.topic}:{letter.partition}:{letter.offset}".encode(),
            letter.to_json(),
            letter.headers(),
        )

    # -- progress ---------------------------------------------------------

    async def report_every(
        self, interval: float, highwater: Callable[[], Mapping[int, int | None]]
    ) -> None:
        """:meth:`report` every ``interval`` seconds (until cancelled)."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.report(highwater())
            except Exception as exc:  # a log line must never stop the worker
                log.warning("projector: progress report failed: %s", exc)

    def report(self, highwater: Mapping[int, int | None]) -> None:
        """One INFO line: events/s, totals, and per assigned partition (-> the highwater
        the last fetch reported, None while unknown or not yet aligned) lag and last offset."""
        now = time.monotonic()
        rate = self._tick_records / max(now - self._tick_at, 1e-9)
        self._tick_records, self._tick_at = 0, now
        parts = []
        for partition in sorted(highwater):
            high = highwater[partition]
            last = self.last_offset.get(partition)
            lag = "?"
            if high is not None and last is not None:
                lag = str(max(high - (last + 1), 0))
                metrics.LAG.labels(str(partition)).set(int(lag))
            parts.append(f"p{partition} lag={lag} last={'-' if last is None else last}")
        p = self._projector
        log.info(
            "projector: %.0f events/s; %d records, %d applied, %d dead letters; %s",
            rate,
            0 if p is None else p.records,
            0 if p is None else p.applied,
            0 if p is None else p.dead,
            "; ".join(parts) or "no partitions assigned",
        )


def _event_id(raw: bytes | None) -> str | None:
    """The ``id`` a poison record claims, if it has one (for the dead-letter log)."""
    try:
        doc = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        return None
    value = doc.get("id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None
