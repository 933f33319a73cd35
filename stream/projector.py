"""The projection of ledger records into counters, with or without a stream framework.

:class:`Projector` takes one batch of raw records of one topic partition,
hands those that are not valid events to a dead-letter callback and applies the
rest through ``backend.apply`` in one call. The watermark moves with the
amounts, and seen-id sets skip a retried event, so an at-least-once stream
counts each event once: ``docs/exactly-once.md`` says how.

>>> import asyncio
>>> from mcp_budget_governor import Context, MemoryBackend
>>> from mcp_budget_governor.events import encode
>>> from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id
>>> raw = encode(LedgerEntry(new_id(), EntryType.ADMITTED, 1764442477.0, Context(user="u_42")),
...              "/mcpbg/doc")
>>> dead = []
>>> projector = Projector(MemoryBackend(), "mcpbg.ledger", dlq=dead.append)
>>> async def batch_then_redelivery():
...     first = await projector.apply_batch(0, [(0, raw), (1, b"not json")])
...     again = await projector.apply_batch(0, [(0, raw)])  # redelivered: counts nothing
...     return first.applied, first.dead, again.applied, await projector.resume_offset(0)
>>> asyncio.run(batch_then_redelivery())
(1, 1, 0, 2)
>>> dead[0].offset
1
"""

from __future__ import annotations

import base64
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import orjson

from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, Backend, hold_roles
from mcp_budget_governor.errors import EventRefusedError
from mcp_budget_governor.events import (
    Charge,
    LedgerEvent,
    MalformedEventError,
    changes_of,
    parse,
)

from .fastdecode import DecodedCharge, decode

__all__ = [
    "DeadLetter",
    "DeadLetterHandler",
    "Projector",
    "ProjectorResult",
    "Record",
    "WatermarkBackend",
    "dead_letter_topic",
    "to_applied",
]

#: ``(offset, raw value)`` of one record; the value is None for a tombstone.
Record = tuple[int, bytes | None]


def dead_letter_topic(topic: str) -> str:
    """Where the poison records of ``topic`` go: ``<topic>.dlq``."""
    return f"{topic}.dlq"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record that is not a valid event, with where it was found and why."""

    topic: str
    partition: int
    offset: int
    reason: str
    raw: bytes | None

    def to_json(self) -> bytes:
        """The dead-letter record's value: JSON, the original bytes in base64.

        base64 because a poison record may be anything, not UTF-8 text; ``raw``
        is null for a record that had no value.
        """
        return orjson.dumps(
            {
                "reason": self.reason,
                "topic": self.topic,
                "partition": self.partition,
                "offset": self.offset,
                "raw": None if self.raw is None else base64.b64encode(self.raw).decode(),
            }
        )

    def headers(self) -> list[tuple[str, bytes]]:
        """The same facts as Kafka headers, for tools that route on headers only."""
        return [
            ("mcpbg-dlq-reason", self.reason.encode()),
            ("mcpbg-dlq-topic", self.topic.encode()),
            ("mcpbg-dlq-partition", str(self.partition).encode()),
            ("mcpbg-dlq-offset", str(self.offset).encode()),
        ]

    @classmethod
    def from_json(cls, value: bytes) -> DeadLetter:
        """Read back what :meth:`to_json` wrote (for tools and tests)."""
        doc = orjson.loads(value)
        raw = doc["raw"]
        return cls(
            doc["topic"],
            int(doc["partition"]),
            int(doc["offset"]),
            doc["reason"],
            None if raw is None else base64.b64decode(raw),
        )


#: Called once per poison record; may be a plain function or a coroutine function.
DeadLetterHandler = Callable[[DeadLetter], Awaitable[None] | None]
#: Receives a partition's valid events, ``(offset, event)``, before they are applied.
ArchiveHandler = Callable[[int, Sequence[tuple[int, LedgerEvent]]], Awaitable[object] | object]


@dataclass(frozen=True, slots=True)
class ProjectorResult:
    """What one batch did.

    - ``records``: records in the batch; ``valid`` of them parsed as events.
    - ``applied``: events new to the counters (a redelivery or a duplicate
      event id counts as valid but not applied).
    - ``dead``: records sent to the dead-letter handler.
    - ``last_offset``: the highest offset in the batch (-1 for an empty batch).
    - ``charges``: every charge of the valid events (redeliveries included),
      for the alert evaluator: limit, bucket, key, amount and expire_at of
      each (a parsed :class:`Charge`, or a :class:`DecodedCharge` when the
      fast decoder read the record).
    """

    partition: int
    records: int
    valid: int
    applied: int
    dead: int
    last_offset: int
    charges: tuple[Charge | DecodedCharge, ...] = ()


@runtime_checkable
class WatermarkBackend(Backend, Protocol):
    """A counter backend that also reports a partition's applied-offset watermark."""

    async def watermark(self, partition: str) -> int:
        """The last applied offset of ``partition``, -1 when none."""
        ...


def to_applied(event: LedgerEvent, offset: int) -> AppliedEvent:
    """A parsed event as the projection applies it, at ``offset`` of its partition."""
    charges = tuple(AppliedCharge(c.key, c.amount, c.expire_at) for c in event.data.charges)
    opens, closes = hold_roles(event.type.split(".")[1], event.data.reservation, charges)
    return AppliedEvent(
        offset,
        event.id,
        event.time.timestamp(),
        charges,
        changes_of(event),
        opens,
        closes,
        tuple((s.once, s.until) for s in event.data.decision.spent),
    )


class Projector:
    """Applies batches of raw ledger records of ``topic`` to ``backend``.

    Framework-free on purpose: the stream worker drives it, and so can a test,
    a rebuild tool or another stream framework. ``dlq`` receives every poison
    record as a :class:`DeadLetter`; it is awaited (when it returns an
    awaitable) before the batch is applied. Counts since creation are kept in
    ``applied``, ``dead`` and ``records``.
    """

    def __init__(
        self,
        backend: WatermarkBackend,
        topic: str,
        *,
        dlq: DeadLetterHandler,
        require_epoch: bool = False,
        archive: ArchiveHandler | None = None,
    ) -> None:
        self.backend = backend
        self.topic = topic
        self.dlq = dlq
        # With it, a store that lost its state raises EpochMissingError instead
        # of letting new events land on empty counters (the caller rebuilds).
        self.require_epoch = require_epoch
        # Called with each batch's valid events before they are applied: the
        # worker resumes from the watermark, so an applied batch is never read again.
        self.archive = archive
        self.records = 0
        self.applied = 0
        self.dead = 0
        # partition -> the last offset dead-lettered by this process
        self._dead_lettered: dict[int, int] = {}

    def partition_name(self, partition: int) -> str:
        """The watermark field of a partition: ``<topic>:<partition>``.

        The topic is part of it so that two ledgers projected into one Redis
        keep separate watermarks.
        """
        return f"{self.topic}:{partition}"

    async def watermark(self, partition: int) -> int:
        """The last offset of ``partition`` applied to the counters, -1 when none."""
        return await self.backend.watermark(self.partition_name(partition))

    async def resume_offset(self, partition: int) -> int:
        """Where reading ``partition`` resumes: the watermark + 1."""
        return await self.watermark(partition) + 1

    async def apply_batch(self, partition: int, records: Sequence[Record]) -> ProjectorResult:
        """Parse, dead-letter and apply one batch of ``partition`` (offsets ascending).

        Raises ``ValueError`` when offsets do not strictly ascend (the
        watermark would silently skip the late ones), and whatever
        ``backend.apply`` or the dead-letter handler raises (for example
        :class:`~mcp_budget_governor.errors.BackendUnavailableError`): the
        caller must then retry the batch, never skip it.
        """
        events: list[AppliedEvent] = []
        parsed: list[tuple[int, LedgerEvent]] = []
        charges: list[Charge | DecodedCharge] = []
        dead: list[DeadLetter] = []
        fast = self.archive is None
        previous = -1
        for offset, raw in records:
            if offset <= previous:
                raise ValueError(
                    f"{self.partition_name(partition)}: offsets must ascend "
                    f"({offset} after {previous})"
                )
            previous = offset
            reason = _problem(raw)
            if reason is None:
                assert raw is not None
                if fast:
                    try:
                        decoded = decode(raw, offset)
                    except Exception:  # a decoder bug must cost speed, never a stalled batch
                        decoded = None
                    if decoded is not None:
                        events.append(decoded.event)
                        charges.extend(decoded.charges)
                        continue
                try:
                    event = parse(raw)
                    parsed.append((offset, event))
                    events.append(to_applied(event, offset))
                    charges.extend(event.data.charges)
                    continue
                except MalformedEventError as exc:
                    reason = exc.reason
                except ValueError as exc:  # parse promises MalformedEventError; be safe
                    reason = f"{type(exc).__name__}: {exc}"
            dead.append(DeadLetter(self.topic, partition, offset, reason, raw))
        sent = 0
        if dead:
            done = await self._done(partition)
            for letter in dead:
                sent += await self._send(partition, letter, done)
        if self.archive is not None and parsed:
            archived = self.archive(partition, parsed)
            if inspect.isawaitable(archived):
                await archived
        applied, refused = await self._apply(partition, records, events, previous, bool(dead))
        sent += refused
        self.records += len(records)
        self.applied += applied
        self.dead += sent
        return ProjectorResult(
            partition, len(records), len(events), applied, sent, previous, tuple(charges)
        )

    async def _done(self, partition: int) -> int:
        """The last offset of ``partition`` already dead-lettered or applied: at or below the
        watermark, a record was dead-lettered when first read (the watermark passes dead
        letters only after they are sent); at or below ``_dead_lettered``, by an earlier
        try of this batch whose apply failed."""
        return max(await self.watermark(partition), self._dead_lettered.get(partition, -1))

    async def _send(self, partition: int, letter: DeadLetter, done: int) -> int:
        """Hand ``letter`` to the dead-letter handler unless it was (1 if sent, else 0)."""
        if letter.offset <= done:
            return 0
        outcome = self.dlq(letter)
        if inspect.isawaitable(outcome):
            await outcome
        self._dead_lettered[partition] = max(letter.offset, self._dead_lettered.get(partition, -1))
        return 1

    async def _apply(
        self,
        partition: int,
        records: Sequence[Record],
        events: list[AppliedEvent],
        last: int,
        dead: bool,
    ) -> tuple[int, int]:
        """Apply ``events``; an event the store refuses goes to the dead letters, the rest
        are applied. Returns (applied, events dead-lettered here).

        The watermark moves through the batch's dead letters too (``through``), in the
        same step as its events: they are not read, or sent, again. A store that
        refuses an event has written nothing of the batch (all or none): the refused
        event is sent to the dead letters once, with the store's reason, and the batch
        is applied again without it. An error that names no event (a store that cannot
        apply one of them for a reason other than being unreachable) is narrowed down
        by applying the events one at a time. The partition never stalls on one event.
        """
        name = self.partition_name(partition)
        raws = dict(records)
        refused = 0
        while events or dead:
            try:
                applied = await self.backend.apply(
                    name, events, require_epoch=self.require_epoch, through=last if dead else -1
                )
            except EventRefusedError as exc:
                if not any(e.offset == exc.offset for e in events):
                    raise  # not one of ours: nothing to take out
                offset, reason = exc.offset, exc.reason
            except Exception as exc:
                if _retry(exc) or not events:
                    raise
                if len(events) > 1:
                    # No event named: one at a time, each all or none, finds the ones that fail.
                    total = 0
                    for event in events:
                        one, bad = await self._apply(
                            partition, records, [event], event.offset, False
                        )
                        total, refused = total + one, refused + bad
                    _, bad = await self._apply(partition, records, [], last, True)
                    return total, refused + bad
                offset, reason = events[0].offset, _reason(exc)
            else:
                return applied, refused
            letter = DeadLetter(self.topic, partition, offset, reason, raws.get(offset))
            refused += await self._send(partition, letter, await self._done(partition))
            events = [e for e in events if e.offset != offset]
            dead = True  # the watermark passes it, with the rest of the batch
        return 0, refused


def _reason(exc: BaseException) -> str:
    """An apply error as a dead letter's one-line reason."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _retry(exc: BaseException) -> bool:
    """Whether an apply error is the store being unreachable or busy (the batch is retried)
    rather than something about the events (they are dead-lettered); a bug in this
    code (a TypeError...) is retried too, never blamed on the events."""
    if isinstance(exc, (ConnectionError, TimeoutError, OSError, TypeError, AttributeError)):
        return True
    return any(cls.__name__ == "BackendBusyError" for cls in type(exc).__mro__)


def _problem(raw: bytes | None) -> str | None:
    """Why a record cannot even be handed to the parser, else None."""
    if raw is None:
        return "no value (a tombstone or a null record)"
    if not raw:
        return "empty value"
    return None
