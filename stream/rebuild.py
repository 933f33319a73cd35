"""Rebuild the counters from the topic after the store lost its state.

Every retained event of every partition is applied from the earliest offset
through the same ``apply`` as the live projection; only when every partition's
highwater mark is reached is the epoch marker set, so a hot path with
``require_epoch`` never admits from empty counters. ``docs/exactly-once.md``
(*Lost state: the epoch marker*) says why. The watermarks then stand at the
topic's end, so the live projection never reads these events: a worker that
archives hands each batch to its archive here too, before applying it, as the
live projection does (readers count an event archived twice once).

>>> result = await rebuild(backend, "broker:9092", "mcpbg.ledger")  # doctest: +SKIP
>>> result.read, result.applied, result.epoch  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mcp_budget_governor.counters import AppliedEvent, Backend
from mcp_budget_governor.errors import EventRefusedError, GovernorError
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.ledger import new_id

from .projector import to_applied
from .topic_reader import TopicReader

log = logging.getLogger(__name__)


class EpochBackend(Backend, Protocol):
    """A backend that can say whether its counters are complete, and declare them so."""

    async def has_epoch(self) -> bool: ...

    async def mark_ready(self, epoch: str) -> None: ...


#: Where a rebuild hands each batch for the archive: ``(partition, [(offset, event)])``.
Archive = Callable[[int, Sequence[tuple[int, LedgerEvent]]], Awaitable[None]]
#: The worker's dead letters: ``(partition, offset, raw record, reason)``.
Dead = Callable[[int, int, bytes | None, str], Awaitable[None]]


class RebuildIncompleteError(GovernorError):
    """The end of the topic was not confirmed; the epoch was not set (try again)."""


@dataclass(frozen=True, slots=True)
class RebuildResult:
    """What a rebuild read, applied and skipped, and how long it took."""

    read: int
    applied: int
    malformed: int
    seconds: float
    epoch: str


async def rebuild(
    backend: EpochBackend,
    bootstrap: str,
    topic: str,
    *,
    batch: int = 2000,
    idle_timeout: float = 5.0,
    dry_run: bool = False,
    archive: Archive | None = None,
    dead: Dead | None = None,
    **client_options: Any,
) -> RebuildResult:
    """Apply every retained event of ``topic`` to ``backend``, then set the epoch marker.

    ``dry_run``: ``backend`` is a scratch copy (``mcpbg replay --dry-run``), so
    nothing is announced as replayed or ready: the progress lines go to debug.

    ``archive(partition, [(offset, event), ...])``: the worker's archive, given
    each batch before it is applied (the live projection's order: an event is
    never applied unarchived).

    ``dead(partition, offset, raw, reason)``: the worker's dead letters, given
    every record that is not an event and every event the store refuses (a sum
    out of range: the store wrote nothing of it, the rest of the batch applies),
    since the live projection resumes past them.

    Raises :class:`RebuildIncompleteError` (leaving the marker unset) when the
    read stopped without reaching every partition's highwater mark.
    """
    started = time.monotonic()
    pending: dict[int, list[AppliedEvent]] = defaultdict(list)
    parsed: dict[int, list[tuple[int, LedgerEvent]]] = defaultdict(list)
    read = applied = 0

    async def flush(partition: int) -> None:
        nonlocal applied
        events = pending[partition]
        if events:
            if archive is not None:
                await archive(partition, parsed[partition])
            last, through = events[-1].offset, -1
            while True:
                try:
                    applied += await backend.apply(f"{topic}:{partition}", events, through=through)
                    break
                except EventRefusedError as exc:
                    refused = next((e for e in events if e.offset == exc.offset), None)
                    if refused is None:  # pragma: no cover - not one of this batch's
                        raise
                    events.remove(refused)
                    through = last  # the watermark passes it with the rest
                    raw = next(
                        (ev.model_dump_json().encode() for o, ev in parsed[partition]
                         if o == exc.offset),
                        None,
                    )  # fmt: skip
                    log.warning(
                        "rebuild: %s p%d offset %d refused: %s", topic, partition, exc.offset,
                        exc.reason,
                    )  # fmt: skip
                    if dead is not None:
                        await dead(partition, exc.offset, raw, exc.reason)
            events.clear()
            parsed[partition] = []

    skipped: list[tuple[int, int, bytes | None, str]] = []

    def skip(partition: int, offset: int, raw: bytes | None, reason: str) -> None:
        # The live projection resumes past it: a dead letter now, or never.
        log.debug("rebuild: %s p%d offset %d skipped: %s", topic, partition, offset, reason)
        if dead is not None:
            skipped.append((partition, offset, raw, reason))

    announce = log.debug if dry_run else log.warning
    if not dry_run:
        log.warning("rebuild: the counters lost their state; replaying %s from its start", topic)
    async with TopicReader(
        bootstrap, topic, idle_timeout=idle_timeout, on_malformed=skip, **client_options
    ) as reader:
        async for record in reader:
            read += 1
            while skipped:
                await dead(*skipped.pop(0))  # type: ignore[misc]
            events = pending[record.partition]
            events.append(to_applied(record.event, record.offset))
            if archive is not None or dead is not None:
                parsed[record.partition].append((record.offset, record.event))
            if len(events) >= batch:
                await flush(record.partition)
        for partition in list(pending):
            await flush(partition)
        while skipped:
            await dead(*skipped.pop(0))  # type: ignore[misc]
        if not reader.caught_up:
            raise RebuildIncompleteError(
                f"rebuild of {topic}: the end of every partition was not confirmed; "
                "the epoch marker stays unset"
            )
        malformed = reader.malformed
    epoch = new_id()
    await backend.mark_ready(epoch)
    result = RebuildResult(read, applied, malformed, time.monotonic() - started, epoch)
    announce(
        "rebuild: %s replayed: %d events read, %d applied, %d malformed skipped, in %.1f s; "
        "counters ready (epoch %s)",
        topic,
        result.read,
        result.applied,
        result.malformed,
        result.seconds,
        epoch,
    )
    return result
