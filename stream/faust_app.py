"""The faust engine: the projection as an agent of a faust-streaming app.

``mcpbg worker --engine faust`` (or ``MCPBG_ENGINE=faust``) runs it as its own
faust app; a team with a faust fleet mounts it in an existing app with one
call, :func:`attach`, before the app starts::

    app = faust.App("billing", broker="kafka://localhost:9092")
    attach(app, WorkerConfig.from_env())   # MCPBG_KAFKA_URL, MCPBG_REDIS_URL, ...
    app.main()                             # faust -A billing worker

It reuses the aiokafka engine's rules (:class:`~.projection.Projection`:
projector, retries, rebuild guard, alerts, archive, dead letters, metrics) and
keeps their guarantees: state in Redis only (no faust tables), every assigned
partition moved to its Redis watermark + 1 before anything of it is applied,
one ``apply`` per partition's share of a ``take_events`` batch, graceful
SIGTERM. docs/worker.md ("The faust engine") says how, and what it costs.

>>> import faust
>>> from mcp_budget_governor.stream.config import WorkerConfig
>>> app = faust.App("doc-billing", broker="kafka://127.0.0.1:9", web_enabled=False)
>>> projection = attach(app, WorkerConfig("kafka://127.0.0.1:9", "redis://127.0.0.1:9/0"))
>>> sorted(agent.name for agent in app.agents.values())
['mcpbg-projector.projector']
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any, cast

import faust
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, EventT, StreamT

from mcp_budget_governor.urls import redact as redact_url

from . import metrics
from .config import WorkerConfig
from .projection import Projection
from .projector import Record
from .retry import Stopping
from .topics import prepare_topics
from .worker import prepare_process

__all__ = ["FaustProjection", "attach", "build_app", "run", "tuned_transport"]

log = logging.getLogger("mcp_budget_governor.stream.worker")

#: Seconds during which records past a partition's next offset are dropped after
#: seeking it back; past that the missing offsets are taken as gone (retention).
GAP_GRACE = 5.0


def tuned_transport(fetch_max_wait_ms: int) -> type[faust_aiokafka.Transport]:
    """faust's aiokafka transport with ``fetch_max_wait_ms`` in place of its fixed 1500 ms.

    A fetch the broker holds for data becomes projection lag on brokers that
    answer it late (docs/worker.md); faust offers no setting for it.
    """

    class Thread(faust_aiokafka.AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport: Any) -> AIOKafkaConsumer:
            consumer = super()._create_worker_consumer(transport)
            # Read by AIOKafkaConsumer.start() when it creates its fetcher.
            consumer._fetch_max_wait_ms = fetch_max_wait_ms
            return consumer

    class Consumer(faust_aiokafka.Consumer):
        def _new_consumer_thread(self) -> Thread:
            return Thread(self, loop=self.loop, beacon=self.beacon)

    class Transport(faust_aiokafka.Transport):
        pass

    Transport.Consumer = Consumer
    return Transport


class FaustProjection:
    """The agent body and the rebalance callbacks :func:`attach` registers on an app."""

    def __init__(self, app: faust.App, config: WorkerConfig) -> None:
        self.app = app
        self.config = config
        self._stopping = asyncio.Event()
        self.projection = Projection(config, send=self._send, stopping=self._stopping)
        self._started = False
        # partition -> the next offset to apply; only partitions aligned to their
        # watermark in the current assignment are here.
        self._expected: dict[int, int] = {}
        # partition -> when it was sought back over a gap (see GAP_GRACE)
        self._sought: dict[int, float] = {}
        # Held while a batch is applied, and while an assignment is aligned.
        self._lock = asyncio.Lock()

    def _start(self) -> Projection:
        if not self._started:  # first use, inside the app's event loop
            self.projection.start()
            self._started = True
        return self.projection

    async def _send(
        self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]] | None
    ) -> None:
        await self.app.producer.send_and_wait(topic, key, value, None, None, headers)

    # -- the agent ------------------------------------------------------------

    async def consume(self, stream: StreamT[bytes]) -> None:
        """The agent: batches of events, each partition's share applied in one call.

        faust acknowledges a batch's events when this loop asks for the next
        one, so everything in it is applied by then (or the worker is stopping).
        """
        projection = self._start()
        # take_events is on faust's Stream, not on the StreamT interface agents get.
        batches = cast(faust.Stream[bytes], stream).take_events(
            self.config.batch_size, self.config.faust_take_within
        )
        try:
            async for events in batches:
                async with self._lock:
                    work = await self._work(events)
                    if not work:
                        continue
                    for result in await projection.apply_all(work):
                        if result.partition in self._expected:  # not revoked meanwhile
                            self._expected[result.partition] = result.last_offset + 1
        except Stopping:
            log.info("projector: stopping with a batch not applied (it is read again later)")

    async def _work(self, events: Sequence[EventT[bytes]]) -> list[tuple[int, list[Record]]]:
        """Each aligned partition's records that continue exactly where it stands.

        Records of a partition not (yet) aligned, or below its next offset, are
        dropped: faust may hand over records fetched before the seek. Records
        past it (a gap: the fetch position was not the watermark) are dropped
        too and the partition is sought back, so nothing is skipped.
        """
        grouped: dict[int, list[Record]] = {}
        for event in events:
            message = event.message
            value = message.value
            grouped.setdefault(message.partition, []).append(
                (message.offset, None if value is None else bytes(value))
            )
        work = []
        for partition, records in grouped.items():
            expected = self._expected.get(partition)
            if expected is None:
                continue
            records.sort()
            fresh = [r for r in records if r[0] >= expected]
            if not fresh:
                continue
            if fresh[0][0] > expected and not await self._gap_gone(
                partition, expected, fresh[0][0]
            ):
                continue
            self._sought.pop(partition, None)
            work.append((partition, _unique(fresh)))
        return work

    async def _gap_gone(self, partition: int, expected: int, found: int) -> bool:
        """Seek back over a gap; True once GAP_GRACE has passed (the offsets are gone)."""
        now = time.monotonic()
        since = self._sought.get(partition)
        if since is None:
            log.info(
                "projector: p%d read at %d, expected %d: seeking back", partition, found, expected
            )
            self._sought[partition] = now
            tp = TP(self.config.topic, partition)
            await self.app.consumer.seek(tp, expected)
            return False
        if now - since < GAP_GRACE:
            return False
        log.warning(
            "projector: p%d offsets %d-%d are no longer on the topic; resuming at %d",
            partition,
            expected,
            found - 1,
            found,
        )
        return True

    # -- rebalances -------------------------------------------------------------

    async def align(self, *_: Any, **__: Any) -> None:
        """Commit, and seek to, watermark + 1 of every assigned ledger partition.

        Runs on faust's ``on_rebalance_complete`` signal, right before faust
        seeks each partition to its committed offset and resumes the flow;
        nothing of a partition is applied before it is aligned (:meth:`_work`).
        ``_commit`` is faust's path to the consumer thread's commit (the public
        ``commit`` only commits acknowledged offsets); the realignment test
        fails should a faust release change it.
        """
        projection = self._start()
        consumer = self.app.consumer
        mine = sorted(tp for tp in consumer.assignment() if tp.topic == self.config.topic)
        async with self._lock:
            self._expected = {}
            self._sought = {}
            if not mine:
                return
            try:
                resume = await projection.resume_offsets(tp.partition for tp in mine)
            except Stopping:
                return
            offsets = {tp: resume[tp.partition] for tp in mine}
            try:
                committed = bool(await cast(Any, consumer)._commit(offsets))
            except KafkaError:
                committed = False
            # faust's seek to committed offsets skips an offset of 0 (aiokafka's
            # seek_to_committed seeks only offsets > 0), and a refused commit would
            # leave it at the group's old offset: seek every partition ourselves.
            await consumer.seek_wait(offsets)
            self._expected = dict(resume)
            projection.resumed(resume, committed)

    async def revoked(self, *args: Any, **_: Any) -> None:
        """Forget the revoked partitions' positions (after the batch in hand); faust's
        ``on_partitions_revoked`` signal passes (sender, revoked)."""
        revoked: set[TP] = set(args[1]) if len(args) > 1 else set()
        async with self._lock:
            for tp in revoked:
                if tp.topic == self.config.topic:
                    self._expected.pop(tp.partition, None)

    # -- progress and stop --------------------------------------------------------

    def highwater(self) -> dict[int, int | None]:
        """Each aligned partition's highwater as last fetched (None while unknown)."""
        consumer = self.app.consumer
        out: dict[int, int | None] = {}
        for tp in consumer.assignment():
            if tp.topic == self.config.topic:
                out[tp.partition] = (
                    consumer.highwater(tp) if tp.partition in self._expected else None
                )
        return out

    async def report(self) -> None:
        """One progress line (the app's timer)."""
        self.projection.report(self.highwater())

    async def aclose(self) -> None:
        """End every retry, log the totals, release Redis (at the app's stop)."""
        self._stopping.set()
        if self._started:
            await self.projection.aclose()
            self._started = False


def _unique(records: list[Record]) -> list[Record]:
    """Sorted records with a repeated offset kept once (the projector wants them ascending)."""
    out: list[Record] = []
    for record in records:
        if not out or record[0] != out[-1][0]:
            out.append(record)
    return out


def attach(app: faust.App, config: WorkerConfig, *, tune: bool = True) -> FaustProjection:
    """Add the projection agent to ``app`` (before it starts); returns its state.

    Registers an agent over ``config.topic`` (raw bytes, concurrency 1), the
    alignment on ``on_rebalance_complete``, the revocation, a progress timer
    and a service that releases Redis at the app's stop. ``tune`` replaces the
    app's consumer transport by :func:`tuned_transport` (``fetch_max_wait_ms``);
    the app's other agents see the same, shorter fetch wait.
    """
    if tune and app._consumer is None:
        app.transport = tuned_transport(config.fetch_max_wait_ms)(app.conf.broker_consumer, app)
    elif tune:
        log.warning("projector: the app's consumer exists already; faust's fetch wait stays")
    projection = FaustProjection(app, config)
    topic = app.topic(config.topic, value_type=bytes, key_type=bytes)
    app.agent(topic, name=f"{config.group}.projector", concurrency=1)(projection.consume)
    app.on_rebalance_complete.connect(projection.align, weak=False)
    app.on_partitions_revoked.connect(projection.revoked, weak=False)
    if config.progress_interval:
        app.timer(config.progress_interval, name=f"{config.group}.progress")(projection.report)

    class Closer(faust.Service):
        async def on_stop(self) -> None:
            await projection.aclose()

    app.service(Closer)
    return projection


def build_app(config: WorkerConfig, *, datadir: str | None = None) -> faust.App:
    """The faust app of ``mcpbg worker --engine faust``: the agent, no tables, no web."""
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
        broker_max_poll_records=config.batch_size,
        # No leader topic, no web server, nothing on disk worth keeping.
        topic_disable_leader=True,
        web_enabled=False,
        datadir=datadir or tempfile.gettempdir(),
        producer_acks=-1,
    )
    attach(app, config)
    return app


def run(config: WorkerConfig) -> int:
    """Run the faust engine until SIGTERM/SIGINT; returns the exit code (0 after a clean stop)."""
    prepare_process(config)
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
            "projector: faust engine; group %s, topic %s (%d partitions), %s %s, batches of %d",
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
