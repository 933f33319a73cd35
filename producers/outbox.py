"""A durable, ordered local spill for ledger events that cannot reach Kafka yet.

When the broker is unreachable, or the producer's in-memory queue is full,
events go here instead; a shipper sends them on, oldest first, once Kafka is
back, and acknowledges what it sent::

    outbox = Outbox("/var/lib/mcpbg/outbox", max_bytes=1 << 30)
    outbox.append([raw_event])                 # the hot path; not blocked by Kafka
    batch = outbox.peek(500)                   # later, the shipper
    ...send [raw for _, raw in batch] and wait for the broker's acks...
    outbox.ack(batch[-1][0])                   # persisted; shipped segments deleted

Records are :mod:`~mcp_budget_governor.producers.record_log` lines (the same
JSON Lines segments as the file ledger), so an outbox folder is readable by
DuckDB too. Durability follows the ``fsync`` policy of that module
(``"batch"`` by default: a process crash loses nothing, a machine crash at
most the last ``batch_interval``). The methods are synchronous; under
``"batch"`` the fsync runs inline in the append that finds the interval
elapsed, unless an async owner attaches a
:class:`~mcp_budget_governor.producers.record_log.Flusher` to ``outbox.log``
(which then fsyncs in a thread). ``ack`` may run in a worker thread while the
owner appends.

**Cursors.** ``peek`` pairs each record with its cursor, the position just
past it; ``ack(cursor)`` means "everything before this was shipped". The
acknowledged cursor is kept in ``<prefix>.cursor``, replaced atomically
(temporary file, fsync, rename, fsync of the directory) *after* the log is
fsync'd, so it never points past records that a machine crash could take
back. ``ack(cursor, sync=False)`` (the Kafka ledger, which acknowledges only
what the broker has) rewrites it in place without any fsync: cheap enough
for every shipped batch, safe against a killed process, and after a machine
crash at worst older (records ship again) or past the surviving log (whose
lost tail was shipped). After a restart ``peek`` starts right after the last acknowledged
record. Delivery is at least once: a crash between sending and ``ack`` sends
those records again, which is harmless (the event id is the idempotency key
of the projection). An unreadable cursor file makes the outbox start from its
oldest segment, for the same reason.

**A full outbox** (``max_bytes`` of records not yet acknowledged) never drops
anything already accepted, and never silently drops anything new:

- ``on_full="refuse"`` (default): :meth:`Outbox.append` raises
  :class:`OutboxFullError` and writes nothing of that batch. The governor
  turns it into a 503 refusal of the call, so an outage that outlasts the
  disk budget sheds load instead of losing ledger events. Choose this when
  the disk budget is a hard limit (a shared volume, a small container disk).
- ``on_full="admit"``: the batch is written past the limit and an ERROR is
  logged (at most once per ``full_log_interval`` seconds, with the count of
  over-limit appends in between). Choose this when serving calls matters more
  than the disk and the volume has room to spare beyond ``max_bytes``; the
  only bound left is the disk itself.

Disk use is the unacknowledged bytes plus the acknowledged part of the
segment being written (deleted by the first ``ack`` after the log rotates
past it), so under ``refuse`` it stays within about ``max_bytes +
segment_bytes``.

**Damaged lines.** A line that is not a JSON object (disk damage; the
producer only writes encoded events) is reported once through
``on_malformed(path, position, data, reason)`` (default: an ERROR log naming
the file, byte offset and record index) and counted in :attr:`Outbox.malformed`,
and still returned by ``peek``: the outbox does not judge events, so the
consumer's dead-letter path records it with its reason instead of it
vanishing here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from mcp_budget_governor.errors import GovernorError

from .record_log import (
    DEFAULT_BATCH_INTERVAL,
    FsyncPolicy,
    Position,
    RecordLog,
    fsync_dir,
    json_object,
)

log = logging.getLogger(__name__)

MalformedHandler = Callable[[Path, Position, bytes, str], None]
# A cursor is JSON of three integers (under 100 bytes); rewritten in place, it is
# padded with spaces (which JSON ignores) so a shorter one leaves nothing behind.
_CURSOR_BYTES = 128


class OutboxFullError(GovernorError):
    """The outbox holds ``max_bytes`` of unshipped records: this batch was not written.

    Nothing already accepted was dropped. The caller refuses the call (503 +
    Retry-After) rather than lose its ledger event.
    """

    def __init__(self, pending_bytes: int, incoming: int, max_bytes: int) -> None:
        self.pending_bytes = pending_bytes
        self.incoming = incoming
        self.max_bytes = max_bytes
        super().__init__(
            f"outbox full: {pending_bytes} bytes not yet shipped + {incoming} new > "
            f"max_bytes={max_bytes}; the batch was refused, nothing was dropped"
        )


class Outbox:
    """Durable, ordered spill of raw ledger records, shipped oldest first.

    - ``max_bytes``: the budget of unshipped bytes (see the module docstring).
    - ``on_full``: ``"refuse"`` raises :class:`OutboxFullError`, ``"admit"``
      writes anyway and logs an ERROR (rate-limited by ``full_log_interval``).
    - ``fsync``, ``batch_interval``: the durability policy of the record log.
    - ``segment_bytes``: segment size (default: a quarter of ``max_bytes``,
      between 64 KiB and 16 MiB), so shipped space is freed in steps.
    - ``on_malformed``: called once per damaged line met by ``peek``.

    One process owns a directory at a time (the log's writer lock).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int,
        on_full: Literal["refuse", "admit"] = "refuse",
        fsync: FsyncPolicy = "batch",
        batch_interval: float = DEFAULT_BATCH_INTERVAL,
        segment_bytes: int | None = None,
        prefix: str = "outbox",
        full_log_interval: float = 10.0,
        on_malformed: MalformedHandler | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes: a positive size (got {max_bytes!r})")
        if on_full not in ("refuse", "admit"):
            raise ValueError(f"on_full: 'refuse' or 'admit' (got {on_full!r})")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.on_full = on_full
        self.full_log_interval = full_log_interval
        self.on_malformed = on_malformed or _log_malformed
        self.malformed = 0
        self._reported: set[Position] = set()
        self._full_logged_at = float("-inf")
        self._full_since_log = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._cursor_path = self.directory / f"{prefix}.cursor"
        self._cursor_fd = -1
        cursor = self._load_cursor()
        if segment_bytes is None:
            segment_bytes = min(16 << 20, max(64 << 10, max_bytes // 4))
        self.log = RecordLog(
            self.directory,
            prefix=prefix,
            fsync=fsync,
            batch_interval=batch_interval,
            segment_bytes=segment_bytes,
            first_seq=0 if cursor is None else cursor.seq,
        )
        self._acked = self._reconcile(cursor)

    # -- the cursor ----------------------------------------------------------

    def _load_cursor(self) -> Position | None:
        try:
            raw = self._cursor_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:  # unreadable (permissions, I/O error, a directory)
            raw = b""
            log.error("%s: %s", self._cursor_path, exc)
        try:
            return Position.from_json(json.loads(raw))
        except ValueError as exc:
            # Re-shipping is safe (event ids are idempotency keys); losing is not.
            log.error(
                "%s: unreadable (%s); shipping again from the oldest segment",
                self._cursor_path,
                exc,
            )
            return None

    def _reconcile(self, cursor: Position | None) -> Position:
        """The acknowledged position that matches what is on disk."""
        segments = self.log.segments()
        end = self.log.end
        if cursor is None:
            return Position(segments[0], 0, 0)
        if cursor.seq > end.seq or (cursor.segment == end.segment and cursor.offset > end.offset):
            # Acknowledged records are missing (fsync="never" and a machine
            # crash, or a damaged disk): new records must sort after the
            # cursor, or they would count as shipped.
            log.error(
                "%s: the acknowledged cursor %s is past the end of the log %s; "
                "continuing in a new segment after it",
                self._cursor_path,
                cursor,
                end,
            )
            self.log.roll(cursor.seq)
            return self.log.end
        if cursor.segment not in segments:
            later = [s for s in segments if s > cursor.segment]
            return Position(later[0], 0, 0) if later else self.log.end
        self.log.delete_before(cursor.segment)
        return self._normalize(cursor)

    def _normalize(self, cursor: Position) -> Position:
        """The end of a finished segment is the start of the next one."""
        if cursor.segment < self.log.end.segment and cursor.offset >= self.log.size(cursor.segment):
            later = self.log.next_segment(cursor.segment)
            if later is not None:
                return Position(later, 0, 0)
        return cursor

    def _store_cursor(self, cursor: Position, sync: bool) -> None:
        data = json.dumps(cursor.to_json()).encode()
        if not sync:
            self._overwrite_cursor(data)
            return
        if self._cursor_fd >= 0:  # the rename below replaces the file it writes
            os.close(self._cursor_fd)
            self._cursor_fd = -1
        tmp = self._cursor_path.with_name(self._cursor_path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._cursor_path)
        fsync_dir(self.directory)

    def _overwrite_cursor(self, data: bytes) -> None:
        """Rewrite the cursor in place, padded to a fixed size: one small ``pwrite``,
        no new file, no rename (the shipper acknowledges every batch). A crash of the
        process cannot tear it; a torn write in a machine crash makes the cursor
        unreadable, which ships again from the oldest segment: never a loss."""
        if self._cursor_fd < 0:
            self._cursor_fd = os.open(self._cursor_path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._cursor_fd, data.ljust(_CURSOR_BYTES), 0)

    # -- the API -------------------------------------------------------------

    def append(self, records: Sequence[bytes]) -> Position:
        """Spill ``records`` in order (durable per the fsync policy); the position of the first.

        Raises :class:`OutboxFullError` (writing nothing) when the batch would
        take the unshipped bytes past ``max_bytes`` and ``on_full="refuse"``.
        """
        incoming = sum(len(r) + 1 for r in records)
        pending = self.pending_bytes
        if records and pending + incoming > self.max_bytes:
            self._full(pending, incoming)
        return self.log.append(records)

    def _full(self, pending: int, incoming: int) -> None:
        self._full_since_log += 1
        now = time.monotonic()
        if now - self._full_logged_at >= self.full_log_interval:
            action = (
                "refusing new records (callers get 503)"
                if self.on_full == "refuse"
                else "admitting past the limit"
            )
            log.error(
                "outbox %s is full: %d bytes not shipped (max_bytes=%d); %s; "
                "%d over-limit appends since the last report",
                self.directory,
                pending,
                self.max_bytes,
                action,
                self._full_since_log,
            )
            self._full_logged_at = now
            self._full_since_log = 0
        if self.on_full == "refuse":
            raise OutboxFullError(pending, incoming, self.max_bytes)

    def peek(self, limit: int = 500) -> list[tuple[Position, bytes]]:
        """Up to ``limit`` unshipped records, oldest first, each with its cursor
        (the position just past it, for :meth:`ack`). Reads; changes nothing."""
        out: list[tuple[Position, bytes]] = []
        if limit <= 0:
            return out
        with contextlib.closing(self.log.read(self._acked, validate=json_object)) as records:
            for record in itertools.islice(records, limit):
                if record.error is not None and record.position not in self._reported:
                    self._reported.add(record.position)
                    self.malformed += 1
                    self.on_malformed(
                        self.log.path(record.position.segment),
                        record.position,
                        record.data,
                        record.error,
                    )
                out.append((record.next, record.data))
        return out

    def ack(self, cursor: Position, *, sync: bool = True) -> None:
        """Everything before ``cursor`` (from :meth:`peek`) was shipped: persist
        that and delete the segments it covers entirely. Acknowledging an older
        cursor again does nothing.

        ``sync=False`` (for a shipper that acknowledges only what a broker has
        acknowledged) writes the cursor file without any fsync: it survives a
        crash of the process (the kernel has it); after a crash of the machine
        the cursor may be older (those records ship again: at least once) or,
        if the log's unsynced tail was lost, past the end of the log, which
        the next opening handles (the lost records were shipped).
        """
        if cursor <= self._acked:
            return
        end = self.log.end
        if cursor > end or cursor.offset > self.log.size(cursor.segment):
            raise ValueError(f"cursor {cursor} is past the end of the outbox ({end})")
        if not self.log.has_segment(cursor.segment):
            raise ValueError(f"cursor {cursor} names no segment of the outbox")
        cursor = self._normalize(cursor)
        if cursor <= self._acked:
            return
        sync = sync and self.log.fsync != "never"
        # The records must be durable before a cursor that points past them.
        if sync:
            self.log.sync()
        self._store_cursor(cursor, sync)
        self._acked = cursor
        self.log.delete_before(cursor.segment)

    @property
    def acked(self) -> Position:
        """The cursor of the last acknowledgement (where ``peek`` starts)."""
        return self._acked

    def __len__(self) -> int:
        """How many records are not yet acknowledged (damaged lines included)."""
        return self.log.end.seq - self._acked.seq

    @property
    def pending_bytes(self) -> int:
        """Bytes of records not yet acknowledged (what ``max_bytes`` bounds)."""
        return self.log.bytes_from(self._acked)

    @property
    def total_bytes(self) -> int:
        """Bytes of segment files on disk, acknowledged ones included."""
        return self.log.total_bytes

    @property
    def empty(self) -> bool:
        """Whether everything appended has been acknowledged."""
        return len(self) == 0

    def sync(self) -> None:
        """fsync what was appended (for ``fsync="batch"`` owners without a Flusher)."""
        self.log.sync()

    def close(self) -> None:
        """fsync and release the directory."""
        if self._cursor_fd >= 0:
            if self.log.fsync != "never":
                with contextlib.suppress(OSError):
                    os.fsync(self._cursor_fd)
            os.close(self._cursor_fd)
            self._cursor_fd = -1
        self.log.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_malformed(path: Path, position: Position, data: bytes, reason: str) -> None:
    log.error(
        "%s: malformed record at byte %d (record %d, sequence %d): %s; shipped as is for the "
        "consumer to dead-letter: %r",
        path,
        position.offset,
        position.index,
        position.seq,
        reason,
        data[:80],
    )
