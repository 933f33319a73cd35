"""The Kafka ledger: every event to an append-only topic, never blocking the hot path.

``append()`` encodes the event and puts it on an in-memory queue; a shipper
task hands the queue to the Kafka client in batches (linger, batch size,
compression, ``acks="all"``), keyed by tenant (else user) so one scope's events
stay in order on one partition.

When Kafka cannot be reached, or the queue is full, events spill to a durable
local :class:`~mcp_budget_governor.producers.outbox.Outbox` (fsync'd in group
commits) and are shipped from there, in order, once Kafka answers again; on
start, leftovers from a previous process ship first. The order rule that
keeps events in sequence: the batch being retried is oldest, then the memory
queue, then the outbox. When spilling starts the whole queue moves to the
outbox first, and new events follow it there until the outbox has drained.

Durability: events in the memory queue, and the one batch in the client's
hands, live in memory until the broker acknowledges them or spilling starts
(Kafka down, slow for ``spill_after``, or the queue full); from then on they
head the outbox on disk, and a batch the broker acknowledges after all is
not sent again. With ``durability="acked"`` each ``append`` waits for the broker's
acknowledgement (bounded by ``ack_timeout``). Delivery is at least once: a
batch that reached the broker but whose acknowledgement was lost is sent
again, and the projection counts each event id once.

A full outbox (``outbox_max_bytes``) refuses new *admissions* when
``on_full="refuse"``: :attr:`KafkaLedger.accepting` turns false and the
governor answers 503 before charging anything. ``append`` itself always
writes, so an event whose charge was made is never lost (the overshoot past
``max_bytes`` is bounded by the calls already under way).

>>> ledger = KafkaLedger.from_url("kafka://127.0.0.1:9092", topic="mcpbg.ledger")  # doctest: +SKIP
>>> governor = Governor(policy, RedisBackend.from_url(url), ledger=ledger)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from mcp_budget_governor.errors import GovernorError, InvalidInputError
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import LedgerEntry

from .outbox import Outbox
from .record_log import Flusher

log = logging.getLogger(__name__)

_SEND_ERRORS = (KafkaError, OSError, asyncio.TimeoutError)


class LedgerTimeoutError(GovernorError, TimeoutError):
    """``durability="acked"``: the broker did not acknowledge in time (the event is kept)."""


@dataclass(slots=True)
class _Pending:
    """An event on its way: encoded lazily (by the shipper, off the caller's path)."""

    entry: LedgerEntry | None
    raw: bytes
    key: bytes
    waiter: asyncio.Future[None] | None = None


@dataclass(slots=True)
class LedgerStats:
    """Counts since start, for logs and health checks."""

    appended: int = 0
    shipped: int = 0
    spilled: int = 0
    send_failures: int = 0
    queued: int = 0
    outbox_pending: int = 0
    kafka_up: bool = False
    last_error: str | None = field(default=None)


def parse_bootstrap(url: str) -> str:
    """``kafka://h1:9092,h2:9092`` or ``h1:9092,h2:9092`` -> ``h1:9092,h2:9092``."""
    text = url.strip()
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme != "kafka":
            raise InvalidInputError("bootstrap", url, "expected kafka://host:port[,host:port]")
    hosts = [h.strip() for h in text.rstrip("/").split(",") if h.strip()]
    if not hosts:
        raise InvalidInputError("bootstrap", url, "expected host:port[,host:port]")
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInputError("bootstrap", url, f"{host!r} is not host:port")
    return ",".join(hosts)


def scope_key(tenant: object, user: object) -> bytes:
    """The partition key: the tenant, else the user, so one scope stays in order."""
    scope = tenant if tenant is not None else user
    return b"-" if scope is None else str(scope).encode()


def _partition_key(entry: LedgerEntry) -> bytes:
    return scope_key(entry.context.tenant, entry.context.user)


class KafkaLedger:
    """Appends ledger events to a Kafka topic through a memory queue and a durable outbox.

    - ``bootstrap``: ``host:port[,host:port]``.
    - ``topic``: created with ``partitions`` and ``replication_factor`` when missing.
    - ``outbox_dir``: where events spill (default: a folder per topic under the
      system temp dir; give a persistent volume in production).
    - ``queue_size``: events held in memory before spilling to the outbox.
    - ``linger_ms``: how long the shipper lets a batch form; ``batch_size``
      (events) and ``max_batch_bytes`` bound it; ``compression`` goes to the client.
    - ``durability``: ``"async"`` (default) returns at once; ``"acked"`` waits
      for the broker's acknowledgement, at most ``ack_timeout`` seconds.
    - ``request_timeout``: how long a send may take before Kafka counts as down.
    - ``spill_after``: once the broker has not acknowledged a batch for this
      long, new events spill to the outbox instead of waiting in memory.
    - ``client_options``: passed through to aiokafka (``security_protocol``,
      ``ssl_context``, ``sasl_mechanism``, ``sasl_plain_username``, ...).
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        topic: str = "mcpbg.ledger",
        source: str | None = None,
        outbox_dir: str | os.PathLike[str] | None = None,
        outbox_max_bytes: int = 1 << 30,
        on_full: Literal["refuse", "admit"] = "refuse",
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
        spill_after: float = 1.0,
        create_topic: bool = True,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        if durability not in ("async", "acked"):
            raise InvalidInputError("durability", durability, "expected 'async' or 'acked'")
        for name, value in (
            ("partitions", partitions),
            ("queue_size", queue_size),
            ("batch_size", batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(name, value, "expected a positive integer")
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
        self.spill_after = spill_after
        self.linger = linger_ms / 1000
        # monotonic time the batch now in the client's hands was sent (0: none)
        self._sending_since = 0.0
        self._pending_sends: list[Any] = []
        self.create_topic = create_topic
        self._producer_options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "acks": "all",
            # The test broker, and many managed ones, have no idempotent producer;
            # the projection deduplicates by event id instead.
            "enable_idempotence": False,
            "linger_ms": linger_ms,
            "max_batch_size": max_batch_bytes,
            "compression_type": compression,
            "request_timeout_ms": int(request_timeout * 1000),
            **(client_options or {}),
        }
        self._client_options = dict(client_options or {})
        directory = outbox_dir or Path(tempfile.gettempdir()) / f"mcpbg-outbox-{topic}"
        self.outbox = Outbox(directory, max_bytes=outbox_max_bytes, on_full=on_full)
        self._flusher = Flusher(self.outbox.log)
        self._queue: deque[_Pending] = deque()
        self._retry: list[_Pending] = []
        # How many records at the head of the outbox are copies of ``_retry``
        # (spilling began while that batch was in the client's hands).
        self._retry_spilled = 0
        # Waiters of spilled events ("acked" durability), in outbox order.
        self._spilled_waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        # Leftovers from a previous process ship before anything new.
        self._spilling = not self.outbox.empty
        self._producer: AIOKafkaProducer | None = None
        self._shipper: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self.stats = LedgerStats()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> KafkaLedger:
        """``KafkaLedger.from_url("kafka://host:9092", topic=...)``; see the class for options."""
        return cls(url, **options)

    # -- the hot path -------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """False while a full outbox refuses new admissions (the governor answers 503)."""
        if not self._spilling:
            return True  # nothing waits on disk: the common case costs one attribute read
        box = self.outbox
        return box.on_full != "refuse" or box.pending_bytes < box.max_bytes

    async def append(self, entry: LedgerEntry) -> None:
        """Queue one event for Kafka (spilling to the outbox when needed); never waits on
        the broker unless ``durability="acked"``."""
        if self._closing:
            raise GovernorError("ledger: append after aclose()")
        waiter = asyncio.get_running_loop().create_future() if self.durability == "acked" else None
        self.stats.appended += 1
        if (
            self._spilling
            or len(self._queue) >= self.queue_size
            or (self._sending_since and time.monotonic() - self._sending_since > self.spill_after)
        ):
            # Kafka is down, slow to acknowledge, or behind: new events go to disk
            # rather than pile up in memory while the client retries.
            item = _Pending(None, encode(entry, self.source), _partition_key(entry), waiter)
            # A full outbox refuses new work through ``accepting``, which the
            # governor asks before it charges anything. Once here, the charge is
            # made: the event must be written, or it would stay in flight forever.
            self._spill([item])
        else:
            # Encoding waits for the shipper, which runs while callers await Redis.
            self._queue.append(_Pending(entry, b"", b"", waiter))
        self._kick()
        if waiter is not None:
            try:
                await asyncio.wait_for(asyncio.shield(waiter), self.ack_timeout)
            except TimeoutError:
                raise LedgerTimeoutError(
                    f"ledger: no broker acknowledgement within {self.ack_timeout}s; "
                    f"event {entry.id} is kept and will be shipped"
                ) from None

    def _spill(self, items: Sequence[_Pending]) -> None:
        """Move the queue, then ``items``, to the outbox: all older events go first."""
        head: list[_Pending] = []
        if not self._spilling:
            self._spilling = True
            log.warning(
                "ledger: spilling to the outbox %s (Kafka unreachable or queue full)",
                self.outbox.directory,
            )
            # The batch in the client's hands is older still, and an outage may
            # last: it heads the (empty until now) outbox, so that a crash cannot
            # lose it. If its send succeeds after all, the shipper acknowledges
            # those records without sending them again.
            head = self._retry
            self._retry_spilled = len(head)
        moving = [*head, *self._queue, *items]
        self._queue.clear()
        if not moving:
            return
        records = [self._encoded(p).raw for p in moving]
        if self.outbox.on_full == "admit":
            first = self.outbox.append(records)  # writes past the limit, logging loudly
        else:
            # A full outbox refuses earlier, through `accepting`, before anything
            # is charged; an event that gets here was charged and must be kept.
            first = self.outbox.log.append(records)
        self._flusher.notify()
        self.stats.spilled += len(moving)
        for i, pending in enumerate(moving):
            if pending.waiter is not None:
                self._spilled_waiters.append((first.seq + i, pending.waiter))

    def _encoded(self, pending: _Pending) -> _Pending:
        if pending.entry is not None:
            pending.raw = encode(pending.entry, self.source)
            pending.key = _partition_key(pending.entry)
            pending.entry = None
        return pending

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
        self._sending_since = time.monotonic()
        try:
            producer = await self._connect()
            partitions = sorted(await producer.partitions_for(self.topic))
            by_partition: dict[int, Any] = {}
            for raw, key in batch:
                partition = partitions[zlib.crc32(key) % len(partitions)]
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
            self._sending_since = 0.0

    async def _send_batch(self, producer: AIOKafkaProducer, builder: Any, partition: int) -> None:
        future = await producer.send_batch(builder, self.topic, partition=partition)
        self._pending_sends.append(future)

    async def _ship_forever(self) -> None:
        assert self._wake is not None
        while True:
            if not (self._retry or self._queue or self._spilling):
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
                progressed = await self._ship_once()
            except _SEND_ERRORS as exc:
                self._down(exc)
                await asyncio.sleep(self.retry_interval)
                continue
            if not progressed:
                await asyncio.sleep(0)

    async def _ship_once(self) -> bool:
        if self._retry:
            batch = self._retry
            await self._send([(p.raw, p.key) for p in map(self._encoded, batch)])
            await self._sent(batch)
            return True
        if self._queue:
            batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
            self._retry = batch  # kept for a retry, oldest of all, should the send fail
            encoded: list[tuple[bytes, bytes]] = []
            for i, pending in enumerate(batch):
                if i and i % 64 == 0:
                    await asyncio.sleep(0)  # let callers' replies in between
                self._encoded(pending)
                encoded.append((pending.raw, pending.key))
            await self._send(encoded)
            await self._sent(batch)
            return True
        # Spilling: the outbox, oldest first, until it is empty.
        await self._flusher.wait_synced()
        records = self.outbox.peek(self.batch_size)
        if not records:
            self._spilling = False
            log.warning("ledger: outbox drained; shipping from memory again")
            return True
        await self._send([(raw, _key_of(raw)) for _, raw in records])
        cursor = records[-1][0]
        await asyncio.to_thread(self.outbox.ack, cursor)
        self.stats.shipped += len(records)
        self._up()
        while self._spilled_waiters and self._spilled_waiters[0][0] < cursor.seq:
            _, waiter = self._spilled_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        return True

    async def _sent(self, batch: Sequence[_Pending]) -> None:
        self._retry = []
        if self._retry_spilled:
            # Spilling began while this batch was in flight: its copies head the
            # outbox; acknowledge them there rather than ship them twice.
            head = self.outbox.peek(self._retry_spilled)
            self._retry_spilled = 0
            if head:
                await asyncio.to_thread(self.outbox.ack, head[-1][0])
        self._shipped(batch)

    def _shipped(self, batch: Sequence[_Pending]) -> None:
        self.stats.shipped += len(batch)
        self._up()
        for pending in batch:
            if pending.waiter is not None and not pending.waiter.done():
                pending.waiter.set_result(None)

    def _up(self) -> None:
        if not self.stats.kafka_up:
            log.info("ledger: Kafka at %s acknowledged; shipping", self.bootstrap)
        self.stats.kafka_up = True

    def _down(self, exc: BaseException) -> None:
        self.stats.send_failures += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        if self.stats.kafka_up or self.stats.send_failures == 1:
            log.warning("ledger: Kafka unreachable (%s); events go to the outbox", exc)
        self.stats.kafka_up = False
        # Everything in memory goes to disk, the batch being retried first.
        self._spill(())
        if self._retry_spilled:
            self._retry, self._retry_spilled = [], 0  # it heads the outbox now
        if self._producer is not None:
            producer, self._producer = self._producer, None
            asyncio.get_running_loop().create_task(_stop_quietly(producer))

    # -- lifecycle ----------------------------------------------------------

    def snapshot(self) -> LedgerStats:
        """Current counts, with the queue and outbox depths filled in."""
        self.stats.queued = len(self._queue) + len(self._retry)
        self.stats.outbox_pending = len(self.outbox)
        return self.stats

    async def flush(self, within: float = 30.0) -> bool:
        """Wait until everything appended so far is acknowledged; False after ``within`` s."""
        deadline = time.monotonic() + within
        while self._retry or self._queue or self._spilling:
            if time.monotonic() > deadline:
                return False
            self._kick()
            await asyncio.sleep(0.01)
        return True

    async def aclose(self, within: float = 10.0) -> None:
        """Ship what can be shipped within ``within`` s; keep the rest in the outbox."""
        if self._closing:
            return
        drained = await self.flush(within)
        self._closing = True
        if self._shipper is not None:
            self._shipper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shipper
        if not drained:
            # The unsent stay on disk and ship first at the next start (the batch
            # being retried first, unless it already heads the outbox).
            self._spill(())
            self._retry, self._retry_spilled = [], 0
            log.warning("ledger: closing with %d events kept in the outbox", len(self.outbox))
        await self._flusher.aclose()
        self.outbox.close()
        if self._producer is not None:
            await _stop_quietly(self._producer)
            self._producer = None


def _key_of(raw: bytes) -> bytes:
    # Spilled records are plain CloudEvents; their key is recomputed from the context.
    try:
        ctx = orjson.loads(raw)["data"]["context"]
        return scope_key(ctx.get("tenant"), ctx.get("user"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return b"-"  # a damaged record still ships, for the dead-letter path to report


async def _stop_quietly(producer: AIOKafkaProducer) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), 5.0)
