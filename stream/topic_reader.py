"""Read a ledger topic from its earliest offset until caught up, parsing every record.

For rebuilds, reconciliation, audits and tests: a one-shot snapshot of the
topic, not a live consumer. Partitions are assigned by hand (no consumer
group, no join, nothing committed), every one read from its earliest offset.

*Caught up* is judged from the highwater mark each fetch response reports
(``consumer.highwater(tp)``): reading stops once the position of every
partition has reached the highwater mark last reported for it. Records
appended after that are not waited for. ``end_offsets`` and ``seek_to_end``
are not used: the test broker (tansu) reports a wrong end offset after a
multi-record batch, while the highwater mark of its fetch responses is right.
As a fallback, reading also stops when no record has arrived for
``idle_timeout`` seconds (a broker that stops answering fetches, say); the
result then says ``caught_up=False`` and a WARNING names the partitions
whose end was not confirmed.

Every record is parsed with :func:`mcp_budget_governor.events.parse`. A
record that is not a valid event (not JSON, a schema violation, no value)
never raises: it is handed to ``on_malformed(partition, offset, raw,
reason)`` (default: a WARNING naming the topic, partition, offset and
reason), counted, and left out of the result; reading goes on.

>>> records = await read_topic("127.0.0.1:9092", "mcpbg.ledger")  # doctest: +SKIP
>>> records.malformed, records.caught_up  # doctest: +SKIP
(0, True)
>>> ids = [r.event.id for r in records]  # doctest: +SKIP

Or record by record, without holding the topic in memory::

    async with TopicReader(bootstrap, "mcpbg.ledger", on_malformed=report) as reader:
        async for record in reader:
            apply(record.partition, record.offset, record.event)
    print(reader.malformed, reader.caught_up)

``client_options`` go to :class:`aiokafka.AIOKafkaConsumer` as they are
(``security_protocol``, ``ssl_context``, ``sasl_mechanism``,
``fetch_max_wait_ms``, ...).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from mcp_budget_governor.errors import GovernorError
from mcp_budget_governor.events import LedgerEvent, MalformedEventError, parse

__all__ = [
    "MalformedHandler",
    "TopicNotFoundError",
    "TopicReader",
    "TopicRecord",
    "TopicRecords",
    "read_topic",
]

log = logging.getLogger(__name__)

#: ``on_malformed(partition, offset, raw, reason)``; ``raw`` is None for a record without a value.
MalformedHandler = Callable[[int, int, bytes | None, str], None]

_DEFAULT_OPTIONS: dict[str, Any] = {
    # A fetch of a partition with nothing new waits at most this long, so
    # an empty partition reports its highwater mark quickly.
    "fetch_max_wait_ms": 100,
    "request_timeout_ms": 10_000,
}


class TopicNotFoundError(GovernorError, LookupError):
    """The broker does not know the topic (or it has no partitions)."""


@dataclass(frozen=True, slots=True)
class TopicRecord:
    """One valid event as read from the topic, with where it was found."""

    partition: int
    offset: int
    event: LedgerEvent
    key: bytes | None = None
    timestamp: int | None = None


class TopicRecords(list[TopicRecord]):
    """The valid records of a read (a list), plus what the read learned on the way.

    - ``malformed``: how many records were not valid events (reported, left out).
    - ``highwater``: the last highwater mark the broker reported, per partition.
    - ``caught_up``: True when every partition reached its highwater mark;
      False when reading stopped after ``idle_timeout`` without that proof.
    """

    malformed: int
    highwater: dict[int, int]
    caught_up: bool

    def __init__(self, records: Iterable[TopicRecord] = ()) -> None:
        super().__init__(records)
        self.malformed = 0
        self.highwater = {}
        self.caught_up = False


class TopicReader:
    """Reads every partition of ``topic`` from the earliest offset until caught up.

    Use as an async context manager and iterate it (once); see the module
    docstring. ``partitions`` restricts the read to those partition numbers
    (default: all). ``topic_timeout`` is how long to wait for the broker to
    know the topic (metadata of a just-created topic may lag).
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        *,
        on_malformed: MalformedHandler | None = None,
        idle_timeout: float = 2.0,
        partitions: Iterable[int] | None = None,
        topic_timeout: float = 5.0,
        **client_options: Any,
    ) -> None:
        if not 0 < idle_timeout < math.inf:
            raise ValueError(f"idle_timeout: seconds > 0 (got {idle_timeout!r})")
        self.bootstrap = bootstrap
        self.topic = topic
        self.idle_timeout = idle_timeout
        self.topic_timeout = topic_timeout
        self._only = None if partitions is None else sorted(set(partitions))
        self._handler = on_malformed
        options = {**_DEFAULT_OPTIONS, **client_options}
        # What makes this a reader and not a group member: these are not options.
        options.update(
            bootstrap_servers=bootstrap,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        self._options = options
        self._consumer: AIOKafkaConsumer | None = None
        self._tps: list[TopicPartition] = []
        self._iterated = False
        #: Records that were not valid events (reported through ``on_malformed``).
        self.malformed = 0
        #: Valid records read so far.
        self.count = 0
        #: Whether every partition reached its reported highwater mark.
        self.caught_up = False
        #: The last highwater mark reported per partition.
        self.highwater: dict[int, int] = {}

    # -- lifecycle ----------------------------------------------------------

    async def __aenter__(self) -> TopicReader:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect, find the topic's partitions and seek each to its earliest offset."""
        if self._consumer is not None:
            return
        consumer = AIOKafkaConsumer(**self._options)
        await consumer.start()
        try:
            partitions = await self._partitions(consumer)
            self._tps = [TopicPartition(self.topic, p) for p in partitions]
            consumer.assign(self._tps)
            await consumer.seek_to_beginning(*self._tps)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer

    async def stop(self) -> None:
        """Disconnect (nothing is committed: a reader has no group)."""
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        try:
            await consumer.stop()
        except asyncio.CancelledError:
            # aiokafka#647: closing re-raises the cancellation of its own fetch task
            # (one in retry backoff while the broker is down) and skips closing the
            # client; only a cancellation aimed at us may propagate.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            await consumer._client.close()

    async def _partitions(self, consumer: AIOKafkaConsumer) -> list[int]:
        deadline = time.monotonic() + self.topic_timeout
        while True:
            await consumer.topics()  # refreshes the metadata of every topic
            known = consumer.partitions_for_topic(self.topic)
            if known:
                break
            if time.monotonic() >= deadline:
                raise TopicNotFoundError(
                    f"topic {self.topic!r} not found on {self.bootstrap} "
                    f"within {self.topic_timeout:g}s"
                )
            await asyncio.sleep(0.1)
        if self._only is None:
            return sorted(known)
        missing = [p for p in self._only if p not in known]
        if missing:
            raise TopicNotFoundError(
                f"topic {self.topic!r} has no partition {missing} (it has {sorted(known)})"
            )
        return list(self._only)

    # -- reading ------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[TopicRecord]:
        if self._consumer is None:
            raise RuntimeError("TopicReader: use 'async with' (or await start()) first")
        if self._iterated:
            raise RuntimeError("TopicReader: a reader reads the topic once; make another")
        self._iterated = True
        return self._records(self._consumer)

    async def _records(self, consumer: AIOKafkaConsumer) -> AsyncIterator[TopicRecord]:
        idle_since = time.monotonic()
        wait_ms = max(1, min(500, int(self.idle_timeout * 1000)))
        while True:
            batches = await consumer.getmany(*self._tps, timeout_ms=wait_ms)
            for tp, messages in batches.items():
                for m in messages:
                    record = self._parse(tp.partition, m.offset, m.key, m.value, m.timestamp)
                    if record is not None:
                        self.count += 1
                        yield record
            if batches:
                idle_since = time.monotonic()
            if await self._reached_highwater(consumer):
                self.caught_up = True
                return
            if time.monotonic() - idle_since >= self.idle_timeout:
                behind = await self._behind(consumer)
                log.warning(
                    "topic %s: no record for %.1f s and the end of partition(s) %s not "
                    "confirmed by a highwater mark; stopping (the read may be incomplete)",
                    self.topic,
                    self.idle_timeout,
                    behind,
                )
                return

    async def _reached_highwater(self, consumer: AIOKafkaConsumer) -> bool:
        done = True
        for tp in self._tps:
            high = consumer.highwater(tp)
            if high is None:
                done = False  # no fetch response for it yet
                continue
            self.highwater[tp.partition] = high
            if await consumer.position(tp) < high:
                done = False
        return done

    async def _behind(self, consumer: AIOKafkaConsumer) -> dict[int, str]:
        out: dict[int, str] = {}
        for tp in self._tps:
            high = consumer.highwater(tp)
            position = await consumer.position(tp)
            if high is None or position < high:
                out[tp.partition] = f"at {position}, highwater {high}"
        return out

    def _parse(
        self,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        timestamp: int | None,
    ) -> TopicRecord | None:
        reason: str | None = None
        if value is None:
            reason = "no value (a tombstone or a null record)"
        else:
            try:
                event = parse(value)
            except MalformedEventError as exc:
                reason = exc.reason
            except ValueError as exc:  # not expected from parse; never let one record stop us
                reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            self.malformed += 1
            if self._handler is not None:
                self._handler(partition, offset, value, reason)
            else:
                log.warning(
                    "topic %s partition %d offset %d: malformed record skipped: %s; raw %r",
                    self.topic,
                    partition,
                    offset,
                    reason,
                    None if value is None else value[:80],
                )
            return None
        return TopicRecord(partition, offset, event, key, timestamp)


async def read_topic(
    bootstrap: str,
    topic: str,
    *,
    on_malformed: MalformedHandler | None = None,
    idle_timeout: float = 2.0,
    **client_options: Any,
) -> TopicRecords:
    """Every valid event of ``topic``, from the earliest offset until caught up.

    Records of one partition come in offset order; no order is promised
    across partitions. Malformed records are reported
    through ``on_malformed(partition, offset, raw, reason)`` (default: a
    WARNING log), counted in ``.malformed`` of the result, and left out.
    Other keyword arguments (``partitions``, ``topic_timeout``, and options for
    the aiokafka consumer) are passed to :class:`TopicReader`.
    """
    out = TopicRecords()
    async with TopicReader(
        bootstrap, topic, on_malformed=on_malformed, idle_timeout=idle_timeout, **client_options
    ) as reader:
        async for record in reader:
            out.append(record)
    out.malformed = reader.malformed
    out.highwater = dict(reader.highwater)
    out.caught_up = reader.caught_up
    return out
