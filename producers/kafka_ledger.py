"""The Kafka ledger: every event to an append-only topic, through a durable local outbox.

``append()`` commits each event to the local
:class:`~mcp_budget_governor.producers.outbox.Outbox` before it returns (a
killed process loses nothing); a task ships the outbox to the topic in
per-partition batches keyed by tenant, and the outbox's cursor records what
was shipped. Shipping, at-least-once delivery and a full outbox are described
in ``docs/kafka-ledger.md``.

Closing the governor closes its ledger (needs a broker):

>>> ledger = KafkaLedger.from_url("kafka://127.0.0.1:9092", topic="mcpbg.ledger")  # doctest: +SKIP
>>> async with Governor(policy, backend, ledger=ledger) as governor:  # doctest: +SKIP
...     decision = await governor.check(ctx)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from mcp_budget_governor.context import Context
from mcp_budget_governor.errors import GovernorError, InvalidInputError
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import (
    DEFAULT_TOPIC,
    EntryType,
    LedgerEntry,
    partition_key,
    partition_of,
)
from mcp_budget_governor.urls import parse_bootstrap as parse_bootstrap  # its home: urls.py

from .outbox import Outbox
from .record_log import DEFAULT_BATCH_INTERVAL, Flusher, Position, warn_unclosed

log = logging.getLogger(__name__)

_SEND_ERRORS = (KafkaError, OSError, asyncio.TimeoutError)
#: At most one "refusals dropped" warning per this many seconds.
DROP_LOG_INTERVAL = 10.0
#: Events prepared ahead and not yet appended, at most (concurrent checks in flight).
_AHEAD_MAX = 1024


class LedgerTimeoutError(GovernorError, TimeoutError):
    """``durability="acked"``: the broker did not acknowledge in time (the event is kept)."""


@dataclass(slots=True)
class LedgerStats:
    """Counts since start, for logs and health checks."""

    appended: int = 0
    shipped: int = 0
    #: appended while shipping went through the files (Kafka down, a backlog, leftovers)
    spilled: int = 0
    send_failures: int = 0
    #: refusals not written because the outbox was full (see the module docstring)
    dropped_refusals: int = 0
    queued: int = 0
    outbox_pending: int = 0
    kafka_up: bool = False
    last_error: str | None = field(default=None)


def _partition_key(ctx: Context) -> bytes:
    return partition_key(ctx.tenant, ctx.user)


class KafkaLedger:
    """Appends ledger events to a durable local outbox and ships them to a Kafka topic.

    - ``bootstrap``: ``host:port[,host:port]``.
    - ``topic``: created with ``partitions`` and ``replication_factor`` when missing.
    - ``outbox_dir``: the commit point (default: a folder per topic under the
      system temp dir; give a persistent volume in production, and the same
      folder again after a restart: its unshipped events ship first).
    - ``outbox_max_bytes``, ``on_full``: the disk budget of unshipped events
      (module docstring).
    - ``batch_interval``: the group-commit window (seconds between fsyncs).
    - ``outbox_mapped``: append by copying into a memory map of the outbox's
      preallocated segment (default) rather than one ``write()`` per event;
      both leave the event in the OS page cache before ``append`` returns.
    - ``queue_size``: appended events kept in memory for shipping; past it
      (a backlog) the shipper reads them back from the files.
    - ``linger_ms``: how long the shipper lets a batch form; ``batch_size``
      (events) and ``max_batch_bytes`` bound it; ``compression`` goes to the client.
    - ``durability``: ``"async"`` (default) returns once the event is in the
      outbox; ``"acked"`` also waits for the broker, at most ``ack_timeout`` s.
    - ``request_timeout``: how long a send may take before Kafka counts as down.
    - ``client_options``: passed through to aiokafka (``security_protocol``,
      ``ssl_context``, ``sasl_mechanism``, ``sasl_plain_username``, ...).
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        topic: str = DEFAULT_TOPIC,
        source: str | None = None,
        outbox_dir: str | os.PathLike[str] | None = None,
        outbox_max_bytes: int = 1 << 30,
        on_full: Literal["refuse", "admit"] = "refuse",
        batch_interval: float = DEFAULT_BATCH_INTERVAL,
        outbox_mapped: bool = True,
        partitions: int = 6,
        replication_factor: int = 1,
        queue_size: int = 10_000,
        batch_size: int = 500,
        linger_ms: int = 20,
        max_batch_bytes: int = 1 << 20,
        compression: str | None = None,
        durability: Literal["async", "acked"] = "async",
        ack_timeout: float = 10.0,
        request_timeout: float = 5.0,
        retry_interval: float = 1.0,
        create_topic: bool = True,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if durability not in ("async", "acked"):
            raise InvalidInputError("durability", durability, "expected 'async' or 'acked'")
        for name, value in (
            ("partitions", partitions),
            ("queue_size", queue_size),
            ("batch_size", batch_size),
            ("outbox_max_bytes", outbox_max_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(name, value, "expected a positive integer")
        if on_full not in ("refuse", "admit"):
            raise InvalidInputError("on_full", on_full, "expected 'refuse' or 'admit'")
        self.bootstrap = parse_bootstrap(bootstrap)
        self.topic = topic
        self.source = source or f"/mcpbg/{socket.gethostname()}"
        self.partitions = partitions
        self.replication_factor = replication_factor
        self.queue_size = queue_size
        self.batch_size = batch_size
        self.durability = durability
        self.ack_timeout = ack_timeout
        self.retry_interval = retry_interval
        self._send_timeout = 2 * request_timeout
        self.linger = linger_ms / 1000
        self._pending_sends: list[Any] = []
        self.create_topic = create_topic
        self._producer_options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "acks": "all",
            # The test broker, and many managed ones, have no idempotent producer;
            # the outbox cursor and the consumers' dedupe by event id replace it.
            "enable_idempotence": False,
            "linger_ms": linger_ms,
            "max_batch_size": max_batch_bytes,
            "compression_type": compression,
            "request_timeout_ms": int(request_timeout * 1000),
            **(client_options or {}),
        }
        self._client_options = dict(client_options or {})
        directory = outbox_dir or Path(tempfile.gettempdir()) / f"mcpbg-outbox-{topic}"
        self.outbox = Outbox(
            directory,
            max_bytes=outbox_max_bytes,
            on_full=on_full,
            batch_interval=batch_interval,
            mapped=outbox_mapped,
        )
        self._flusher = Flusher(self.outbox.log)
        self._log = self.outbox.log
        # Memory copies of appended, unshipped events: (line, context (its
        # partition key is made by the shipper), outbox cursor just past it, as
        # the plain (segment, offset, index) of a Position).
        # Valid only while ``_from_disk`` is false.
        self._queue: deque[tuple[bytes, Context, tuple[int, int, int]]] = deque()
        # True while the memory copy is incomplete (leftovers of a previous
        # process, Kafka down, a backlog past queue_size): ship from the files.
        self._from_disk = not self.outbox.empty
        self._pending_bytes = self.outbox.pending_bytes
        # "acked" durability: (sequence number, waiter), in outbox order.
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._acking: asyncio.Future[None] | None = None
        self._producer: AIOKafkaProducer | None = None
        self._shipper: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self._closed = False
        self._drop_logged_at = float("-inf")
        self._dropped_since_log = 0
        # prepare(): event id -> (entry, its encoding), until its append.
        self._ahead: dict[str, tuple[LedgerEntry, bytes]] = {}
        self.stats = LedgerStats()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> KafkaLedger:
        """``KafkaLedger.from_url("kafka://host:9092", topic=...)``; see the class for options."""
        return cls(url, **options)

    # -- the hot path -------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """False while a full outbox refuses new admissions (the governor answers 503)."""
        return self._pending_bytes < self.outbox.max_bytes or self.outbox.on_full != "refuse"

    def prepare(self, entry: LedgerEntry) -> None:
        """Encode ``entry`` now, while its caller waits for the counters' reply, for an
        :meth:`append` of that very object (the governor's likely outcome). Writes
        nothing: an entry prepared and never appended is simply forgotten."""
        ahead = self._ahead
        if len(ahead) >= _AHEAD_MAX:  # outcomes that never came (refusals, failures)
            ahead.clear()
        ahead[entry.id] = (entry, encode(entry, self.source))

    async def append(self, entry: LedgerEntry) -> None:
        """Commit one event to the outbox (written to the OS before this returns) for
        shipping; waits on the broker only with ``durability="acked"``."""
        if self._closing:
            raise GovernorError("ledger: append after aclose()")
        held = self._ahead.pop(entry.id, None) if self._ahead else None
        # Identity, not equality: the held entry is alive, so no other object has its id.
        raw = held[1] if held is not None and held[0] is entry else encode(entry, self.source)
        size = len(raw) + 1
        box = self.outbox
        if self._pending_bytes + size <= box.max_bytes:
            end = self._log.append_line(raw)
        elif entry.type is EntryType.REJECTED and not entry.charges:
            self._drop_refusal()
            return
        elif box.on_full == "admit":
            first = box.append([raw])  # past the limit, with a rate-limited ERROR
            end = (first.segment, first.offset + size, first.index + 1)
        else:
            # Admissions were refused through ``accepting`` before anything was
            # charged; an event that gets here was charged and must be kept.
            end = self._log.append_line(raw)
        self._pending_bytes += size
        self.stats.appended += 1
        if not self._from_disk:
            if len(self._queue) < self.queue_size:
                self._queue.append((raw, entry.context, end))
            else:
                self._fall_back_to_disk()
                self.stats.spilled += 1
        else:
            self.stats.spilled += 1
        self._flusher.notify()
        self._kick()
        if self.durability == "acked":
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append((end[0] + end[2] - 1, waiter))  # its sequence number
            try:
                await asyncio.wait_for(asyncio.shield(waiter), self.ack_timeout)
            except TimeoutError:
                raise LedgerTimeoutError(
                    f"ledger: no broker acknowledgement within {self.ack_timeout}s; "
                    f"event {entry.id} is kept in the outbox and will be shipped"
                ) from None

    def _fall_back_to_disk(self) -> None:
        """Drop the memory copy: the shipper reads from the outbox's cursor instead."""
        self._from_disk = True
        self._queue.clear()

    def _drop_refusal(self) -> None:
        self.stats.dropped_refusals += 1
        self._dropped_since_log += 1
        now = time.monotonic()
        if now - self._drop_logged_at >= DROP_LOG_INTERVAL:
            log.warning(
                "ledger: outbox %s is full (%d bytes not shipped, outbox_max_bytes=%d): "
                "dropped %d refusal event(s) since the last report, %d in all "
                "(refusals charge nothing: counters are unaffected)",
                self.outbox.directory,
                self._pending_bytes,
                self.outbox.max_bytes,
                self._dropped_since_log,
                self.stats.dropped_refusals,
            )
            self._drop_logged_at = now
            self._dropped_since_log = 0

    # -- the shipper --------------------------------------------------------

    def _kick(self) -> None:
        wake = self._wake
        if wake is None:
            wake = self._wake = asyncio.Event()
        if self._shipper is None or self._shipper.done():
            self._shipper = asyncio.get_running_loop().create_task(self._ship_forever())
        if not wake.is_set():
            wake.set()

    async def start(self) -> None:
        """Start shipping now (otherwise the first append starts it), leftovers first."""
        self._kick()

    async def _connect(self) -> AIOKafkaProducer:
        if self._producer is not None:
            return self._producer
        producer = AIOKafkaProducer(**self._producer_options)
        try:
            await producer.start()
            if self.create_topic:
                await self._ensure_topic()
        except BaseException:
            with contextlib.suppress(Exception):
                await producer.stop()
            raise
        self._producer = producer
        return producer

    async def _ensure_topic(self) -> None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap,
            request_timeout_ms=self._producer_options["request_timeout_ms"],
            **self._client_options,
        )
        await admin.start()
        try:
            existing = await admin.list_topics()
            if self.topic not in existing:
                with contextlib.suppress(TopicAlreadyExistsError):
                    await admin.create_topics(
                        [NewTopic(self.topic, self.partitions, self.replication_factor)]
                    )
                log.info("ledger: created topic %s (%d partitions)", self.topic, self.partitions)
        finally:
            await admin.close()

    async def _send(self, batch: Sequence[tuple[bytes, bytes]]) -> None:
        """Send a batch and wait for the broker's acknowledgement of all of it.

        Records are grouped by partition (CRC-32 of the key, so one scope stays
        on one partition, in order) into one record batch each: the client's
        per-message path (a future, a partitioner and an accumulator per
        record) cost about 20 us an event, this a few.
        """
        try:
            producer = await self._connect()
            partitions = sorted(await producer.partitions_for(self.topic))
            by_partition: dict[int, Any] = {}
            for raw, key in batch:
                partition = partitions[partition_of(key, len(partitions))]
                builder = by_partition.get(partition)
                if builder is None or builder.append(timestamp=None, key=key, value=raw) is None:
                    if builder is not None:  # full: ship it and start another
                        await self._send_batch(producer, builder, partition)
                    builder = by_partition[partition] = producer.create_batch()
                    builder.append(timestamp=None, key=key, value=raw)
            for partition, builder in by_partition.items():
                await self._send_batch(producer, builder, partition)
            # The client retries on its own; past this, Kafka counts as down.
            await asyncio.wait_for(asyncio.gather(*self._pending_sends), self._send_timeout)
        finally:
            self._pending_sends.clear()

    async def _send_batch(self, producer: AIOKafkaProducer, builder: Any, partition: int) -> None:
        future = await producer.send_batch(builder, self.topic, partition=partition)
        self._pending_sends.append(future)

    async def _ship_forever(self) -> None:
        assert self._wake is not None
        while True:
            if not (self._queue or self._from_disk):
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                # Linger so a batch can form: otherwise a steady trickle of calls
                # wakes the shipper once per event and sends batches of one.
                if len(self._queue) < self.batch_size and not self._closing:
                    await asyncio.sleep(self.linger)
                continue
            try:
                await self._ship_once()
            except _SEND_ERRORS as exc:
                self._down(exc)
                await asyncio.sleep(self.retry_interval)

    async def _ship_once(self) -> None:
        """Ship the oldest unshipped batch, then record its cursor on disk."""
        if self._from_disk:
            records = self.outbox.peek(self.batch_size)
            if not records:
                self._from_disk = False
                return
            batch = [(raw, _key_of(raw)) for _, raw in records]
            cursor = records[-1][0]
        else:
            n = min(self.batch_size, len(self._queue))
            taken = [self._queue.popleft() for _ in range(n)]
            batch = [(raw, _partition_key(ctx)) for raw, ctx, _ in taken]
            cursor = Position(*taken[-1][2])
        await self._send(batch)
        # The shipped position is recorded (the cursor file replaced, no fsync: the
        # broker has these records, so a cursor ahead of the disk after a machine
        # crash loses nothing, and one behind re-ships): a restart resumes after
        # it. A crash before this completes sends the batch again (at least once).
        if cursor.segment == self._log.end.segment == self.outbox.acked.segment:
            # Within the segment being written nothing is deleted: the ack is one
            # small pwrite, cheaper here than a thread hand-off per batch.
            self.outbox.ack(cursor, sync=False)
        else:  # it deletes shipped segments (unlink, fsync of the folder): off the loop
            ack = functools.partial(self.outbox.ack, cursor, sync=False)
            self._acking = asyncio.ensure_future(asyncio.to_thread(ack))
            try:
                await asyncio.shield(self._acking)
            finally:
                self._acking = None
        self._pending_bytes = self.outbox.pending_bytes
        self.stats.shipped += len(batch)
        self._up()
        while self._waiters and self._waiters[0][0] < cursor.seq:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        if self._from_disk and self.outbox.empty:
            self._from_disk = False
            log.info("ledger: outbox caught up; shipping from memory again")

    def _up(self) -> None:
        if not self.stats.kafka_up:
            log.info("ledger: Kafka at %s acknowledged; shipping", self.bootstrap)
        self.stats.kafka_up = True

    def _down(self, exc: BaseException) -> None:
        self.stats.send_failures += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        if self.stats.kafka_up or self.stats.send_failures == 1:
            log.warning(
                "ledger: Kafka unreachable (%s); events wait in the outbox %s",
                exc,
                self.outbox.directory,
            )
        self.stats.kafka_up = False
        # The failed batch is still after the cursor: it is read back from disk
        # and sent again first, then everything after it, in order.
        self._fall_back_to_disk()
        if self._producer is not None:
            producer, self._producer = self._producer, None
            asyncio.get_running_loop().create_task(_stop_quietly(producer))

    # -- lifecycle ----------------------------------------------------------

    @property
    def unshipped(self) -> int:
        """Events in the outbox that the broker has not acknowledged yet."""
        return len(self.outbox)

    def snapshot(self) -> LedgerStats:
        """Current counts, with the queue and outbox depths filled in."""
        self.stats.queued = len(self._queue)
        self.stats.outbox_pending = len(self.outbox)
        return self.stats

    async def flush(self, within: float = 30.0) -> bool:
        """Wait until everything appended so far is acknowledged; False after ``within`` s."""
        deadline = time.monotonic() + within
        # The cursor moves inside the acknowledging thread: wait for that step too.
        while not self.outbox.empty or self._acking is not None:
            if time.monotonic() > deadline:
                return False
            self._kick()
            await asyncio.sleep(0.01)
        return True

    async def aclose(self, within: float = 10.0) -> None:
        """Ship what can be shipped within ``within`` s; keep the rest in the outbox
        (fsync'd), to ship first at the next start on the same folder."""
        if self._closing:
            return
        drained = await self.flush(within)
        self._closing = True
        if self._shipper is not None:
            self._shipper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shipper
        if self._acking is not None:  # let a cursor update finish before closing
            with contextlib.suppress(Exception):
                await self._acking
        if not drained:
            log.warning(
                "ledger: closing with %d events kept in the outbox %s (they ship at the next "
                "start on that folder)",
                len(self.outbox),
                self.outbox.directory,
            )
        try:
            await self._flusher.aclose()
        finally:
            self.outbox.close()
            self._closed = True
            if self._producer is not None:
                await _stop_quietly(self._producer)
                self._producer = None

    def __del__(self) -> None:
        # A governor dropped without ``aclose()`` (a script that just returns):
        # its events are safe on disk, but say so loudly, with the count.
        if getattr(self, "_closed", True):
            return
        try:
            left = len(self.outbox)
            directory = self.outbox.directory
        except Exception:  # pragma: no cover - half-built or torn down at exit
            return
        if not left:
            return
        message = (
            f"KafkaLedger(topic={self.topic!r}) was garbage-collected unclosed with {left} "
            f"events not yet shipped; they are kept in the outbox {directory} and ship at the "
            "next start on that folder (close it: `async with governor:` or "
            "`await governor.aclose()`)"
        )
        warn_unclosed(message, log)


def _key_of(raw: bytes) -> bytes:
    # Records read back from the outbox are plain CloudEvents; their key is
    # recomputed from the context.
    try:
        ctx = orjson.loads(raw)["data"]["context"]
        return partition_key(ctx.get("tenant"), ctx.get("user"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return b"-"  # a damaged record still ships, for the dead-letter path to report


async def _stop_quietly(producer: AIOKafkaProducer) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), 5.0)
