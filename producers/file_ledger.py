"""The ledger as files, for the embedded mode: one replica, no Kafka.

:class:`FileLedger` appends each entry as one CloudEvent line
(:func:`mcp_budget_governor.events.encode`) to a
:class:`~mcp_budget_governor.producers.record_log.RecordLog` directory, the
same JSON Lines segments the outbox writes, which DuckDB reads as they are::

    SELECT type, count(*) FROM read_json('<dir>/*.jsonl', format='newline_delimited')
    GROUP BY type

:class:`FileProjector` plays the stream worker's part: it tails the directory
and applies the events through ``Backend.apply``, so counters get committed
exactly as they would from Kafka. Each segment is a partition
(``"<partition_prefix>:<segment file name>"``) and a record's index in its
segment is its offset, so the backend's applied-offset watermark (plus its
seen-id sets) makes every re-run, restart or second projector harmless.

Durability (``fsync``) is the record log's policy, applied without blocking
the event loop:

- ``"batch"`` (default): ``append`` returns once the line is written (a crash
  of the process loses nothing); a background fsync, in a thread, covers
  every append since the previous one at most every ``batch_interval``
  seconds, so a crash of the machine loses at most that window.
- ``"always"``: ``append`` returns once an fsync covers its line; appends
  that arrive while an fsync runs share the next one (group commit).
- ``"never"``: no fsync until ``aclose``.

The append is the commit point, as for the Kafka ledger's outbox: a process
killed right after ``check()`` / ``meter()`` returned has its event in the
files. A ledger garbage-collected without ``aclose()`` (a script that just
returns) logs a WARNING (and a ``ResourceWarning``) naming the bytes not yet
fsync'd: close the governor (``async with governor:``).

Each opening of a :class:`FileLedger` continues in a new segment (unless the
newest is empty), so a tail lost in a machine crash is never overwritten by
new records at offsets a projector has already applied. The files are the
source of truth: nothing here deletes segments.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, Backend, hold_roles
from mcp_budget_governor.errors import EventRefusedError, GovernorError
from mcp_budget_governor.events import MalformedEventError, changes_of, encode, parse
from mcp_budget_governor.ledger import LedgerEntry

from .record_log import (
    DEFAULT_BATCH_INTERVAL,
    DEFAULT_SEGMENT_BYTES,
    Flusher,
    FsyncPolicy,
    LogRecord,
    Position,
    RecordLog,
    warn_unclosed,
)

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "ledger"


class FileLedger:
    """A :class:`~mcp_budget_governor.ledger.Ledger` that appends CloudEvent lines to files.

    - ``source``: the CloudEvents ``source`` (default ``/mcpbg/<hostname>``).
    - ``fsync``, ``batch_interval``: the durability policy (module docstring).
    - ``segment_bytes``, ``prefix``: segment size and file name prefix.

    One process writes a directory at a time (the record log's writer lock).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        source: str | None = None,
        fsync: FsyncPolicy = "batch",
        batch_interval: float = DEFAULT_BATCH_INTERVAL,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.source = source or f"/mcpbg/{socket.gethostname()}"
        self.fsync: FsyncPolicy = fsync
        self.log = RecordLog(
            directory,
            prefix=prefix,
            fsync=fsync,
            batch_interval=batch_interval,
            segment_bytes=segment_bytes,
            # Each opening writes a new segment (a new partition): should a
            # machine crash take back the unsynced tail of the last one, records
            # written after it can never take the (segment, index) of records a
            # projector already applied from the page cache, and be skipped.
            fresh_segment=True,
        )
        # fsyncs go through the flusher, in a thread: the hot path never waits
        # on the disk under "batch", and shares one fsync under "always".
        self._flusher = (
            None
            if fsync == "never"
            else Flusher(self.log, 0.0 if fsync == "always" else batch_interval)
        )

    @property
    def directory(self) -> Path:
        """Where the segments are."""
        return self.log.directory

    async def append(self, entry: LedgerEntry) -> None:
        """Append one entry as a CloudEvent line, durable per the fsync policy."""
        self.log.append_line(encode(entry, self.source))
        if self._flusher is None:
            return
        if self.fsync == "always":
            await self._flusher.wait_synced()
        else:
            self._flusher.notify()

    async def aclose(self) -> None:
        """fsync everything appended and release the directory."""
        try:
            if self._flusher is not None:
                await self._flusher.aclose()
        finally:
            self.log.close()

    def __del__(self) -> None:
        log_ = getattr(self, "log", None)
        if log_ is None or log_.closed or not log_.writable:
            return
        unsynced = log_.unsynced_bytes
        if not unsynced:
            return
        message = (
            f"FileLedger({log_.directory}) was garbage-collected unclosed with {unsynced} "
            "bytes of events written but not yet fsync'd (safe if only the process dies, "
            "not the machine); close it: `async with governor:` or `await governor.aclose()`"
        )
        warn_unclosed(message, log)


class FileProjector:
    """Applies a file ledger's events to a backend's counters, in batches.

    ``catch_up()`` applies everything written so far and returns how many
    events the backend counted as new; ``run()`` repeats it until cancelled.
    A malformed record is logged with its file and position, counted in
    :attr:`malformed` and skipped. Restartable: a new projector over the same
    directory and backend starts past each segment's applied watermark (when
    the backend reports one) and the backend skips anything applied before.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        backend: Backend,
        *,
        partition_prefix: str = "file",
        prefix: str = DEFAULT_PREFIX,
        batch: int = 500,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch: at least 1 (got {batch!r})")
        self.log = RecordLog(directory, prefix=prefix, writable=False)
        self.backend = backend
        self.partition_prefix = partition_prefix
        self.batch = batch
        self.malformed = 0
        self.refused = 0
        self.applied = 0
        self._next: Position | None = None  # where the next catch_up reads from
        self._watermarks: dict[int, int] = {}  # per segment, from the backend at first sight

    def partition(self, segment: int) -> str:
        """The partition name of a segment: ``file:ledger-00000000000000000000.jsonl``."""
        return f"{self.partition_prefix}:{self.log.path(segment).name}"

    async def _watermark(self, segment: int) -> int:
        known = self._watermarks.get(segment)
        if known is None:
            # Both real backends expose their watermark; it only saves parsing
            # what was applied before, correctness rests on apply's own guards.
            read: Any = getattr(self.backend, "watermark", None)
            known = -1 if read is None else int(await read(self.partition(segment)))
            self._watermarks[segment] = known
        return known

    async def catch_up(self) -> int:
        """Apply every event written since the last call; returns how many were new."""
        applied = 0
        events: list[AppliedEvent] = []
        segment = watermark = -1
        resume: Position | None = None
        for record in self.log.read(self._next):
            pos = record.position
            if pos.segment != segment:
                if events:
                    applied += await self._apply(segment, events, resume)
                    events = []
                segment = pos.segment
                watermark = await self._watermark(segment)
            resume = record.next
            if pos.index <= watermark:
                continue
            event = self._decode(record)
            if event is not None:
                events.append(event)
            if len(events) >= self.batch:
                applied += await self._apply(segment, events, resume)
                events = []
        if events:
            applied += await self._apply(segment, events, resume)
        elif resume is not None:
            self._next = resume
        return applied

    async def _apply(
        self, segment: int, events: Sequence[AppliedEvent], resume: Position | None
    ) -> int:
        # The cursor moves only after the backend took the batch: a failure
        # leaves it where it was, and the next call applies the batch again.
        # An event the store refuses (a sum out of range: nothing of the batch was
        # written) is logged, counted in ``refused`` and left out; the rest applies.
        todo = list(events)
        passed: dict[str, int] = {}  # once one is refused, the watermark passes it
        while True:
            try:
                apply: Any = self.backend.apply  # ``through`` only once needed: any backend
                n = int(await apply(self.partition(segment), todo, **passed))
                break
            except EventRefusedError as exc:
                kept = [e for e in todo if e.offset != exc.offset]
                if len(kept) == len(todo):  # pragma: no cover - not one of this batch's
                    raise
                log.warning(
                    "%s: event at record %d refused, skipped: %s",
                    self.log.path(segment),
                    exc.offset,
                    exc.reason,
                )
                self.refused += 1
                todo = kept
                passed = {"through": events[-1].offset}
        self._watermarks[segment] = events[-1].offset
        self._next = resume
        self.applied += n
        return n

    def _decode(self, record: LogRecord) -> AppliedEvent | None:
        pos = record.position
        try:
            event = parse(record.data)
        except (MalformedEventError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, MalformedEventError) else str(exc)
            self.malformed += 1
            log.warning(
                "%s: malformed event at byte %d (record %d), skipped: %s",
                self.log.path(pos.segment),
                pos.offset,
                pos.index,
                reason,
            )
            return None
        charges = tuple(AppliedCharge(c.key, c.amount, c.expire_at) for c in event.data.charges)
        return AppliedEvent(
            pos.index,
            event.id,
            event.time.timestamp(),
            charges,
            changes_of(event),
            *hold_roles(event.type.split(".")[1], event.data.reservation, charges),
            tuple((s.once, s.until) for s in event.data.decision.spent),
        )

    async def run(self, poll_interval: float = 0.2) -> None:
        """Catch up every ``poll_interval`` seconds until cancelled; a backend
        outage is logged and retried, never fatal."""
        while True:
            try:
                await self.catch_up()
            except (GovernorError, OSError) as exc:
                log.warning("file projection paused: %s; retrying", exc)
            await asyncio.sleep(poll_interval)
