"""A durable, ordered local spill for ledger events that cannot reach Kafka yet.

Events the broker cannot take now are appended here; a shipper sends them on,
oldest first, and acknowledges what it sent. Delivery is at least once (the
event id is the projection's idempotency key); a full outbox refuses new
events or admits them with an ERROR, never drops any. ``docs/outbox.md``
describes the cursor, durability, the full outbox and damaged lines.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as folder:
...     with Outbox(folder, max_bytes=1 << 20, fsync="never") as outbox:
...         _ = outbox.append([b'{"id": "e1"}', b'{"id": "e2"}'])
...         batch = outbox.peek(500)
...         print([raw for _, raw in batch])
...         outbox.ack(batch[-1][0])
...         print(len(outbox), outbox.peek(500))
[b'{"id": "e1"}', b'{"id": "e2"}']
0 []
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

    - ``max_bytes``: the budget of unshipped bytes (``docs/outbox.md``).
    - ``on_full``: ``"refuse"`` raises :class:`OutboxFullError`, ``"admit"``
      writes anyway and logs an ERROR (rate-limited by ``full_log_interval``).
    - ``fsync``, ``batch_interval``: the durability policy of the record log.
    - ``segment_bytes``: segment size (default: a quarter of ``max_bytes``,
      between 64 KiB and 16 MiB), so shipped space is freed in steps.
    - ``on_malformed``: called once per damaged line met by ``peek``.
    - ``mapped``: append by copying into a memory map of the preallocated
      segment (default; no ``write()`` per record, see :class:`RecordLog`)
      rather than by ``write()``.

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
        mapped: bool = True,
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
            mapped=mapped,
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
