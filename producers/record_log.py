"""The one on-disk record format of the outbox and the file ledger: JSON Lines segments.

One record per line in ``<prefix>-<first sequence number>.jsonl`` files; a
:class:`Position` says where a record is, the ``fsync`` policy how durable an
append is, and a torn or bad line is reported, never raised. The format,
positions, durability and damage rules are in ``docs/record-log.md``.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> with RecordLog(folder, prefix="ledger", fsync="never") as log:
...     end = log.append([b'{"id": "a"}', b'{"id": "b"}'])
...     [(r.position.seq, r.data) for r in log.read()]
[(0, b'{"id": "a"}'), (1, b'{"id": "b"}')]
>>> sorted(p.name for p in Path(folder).glob("*.jsonl"))
['ledger-00000000000000000000.jsonl']
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import mmap
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from mcp_budget_governor.errors import GovernorError

log = logging.getLogger(__name__)

FsyncPolicy = Literal["always", "batch", "never"]
FSYNC_POLICIES: tuple[FsyncPolicy, ...] = ("always", "batch", "never")

SUFFIX = ".jsonl"
SEQ_DIGITS = 20
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
DEFAULT_BATCH_INTERVAL = 0.005
_SCAN_CHUNK = 1024 * 1024
#: An unterminated newest line younger than this may be a write in progress.
IN_PROGRESS_SECONDS = 2.0
_PREFIX = re.compile(r"^[A-Za-z0-9_.]+$")


class RecordLogError(GovernorError, OSError):
    """The log cannot take writes: closed, locked by another writer, or a failed fsync.

    After a failed fsync the log refuses further writes: the kernel may have
    dropped the dirty pages, and a later fsync could report success for data
    that never reached the disk.
    """


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """Where a record starts: segment (its first sequence number), byte offset, index."""

    segment: int
    offset: int
    index: int

    @property
    def seq(self) -> int:
        """The record's sequence number in the whole log."""
        return self.segment + self.index

    def to_json(self) -> dict[str, int]:
        """A plain mapping, for cursor files."""
        return {"segment": self.segment, "offset": self.offset, "index": self.index}

    @classmethod
    def from_json(cls, raw: object) -> Position:
        """The inverse of :meth:`to_json`; raises ``ValueError`` on anything else."""
        if not isinstance(raw, dict):
            raise ValueError(f"a position is an object, got {raw!r}")
        values: list[int] = []
        for name in ("segment", "offset", "index"):
            value = raw.get(name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: a non-negative integer, got {value!r}")
            values.append(value)
        return cls(*values)


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One complete line: its position, its bytes (without ``\\n``), and why it is bad, if it is."""

    position: Position
    data: bytes
    error: str | None = None

    @property
    def next(self) -> Position:
        """The position just past this record (where the next one starts)."""
        p = self.position
        return Position(p.segment, p.offset + len(self.data) + 1, p.index + 1)


def json_object(data: bytes) -> None:
    """A ``validate`` for :meth:`RecordLog.read`: the line must be one JSON object."""
    value = json.loads(data)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object but a {type(value).__name__}")


def segment_name(prefix: str, segment: int) -> str:
    """``ledger-00000000000000000042.jsonl`` for ``("ledger", 42)``."""
    return f"{prefix}-{segment:0{SEQ_DIGITS}d}{SUFFIX}"


def fsync_dir(directory: Path) -> None:
    """Make a created, renamed or deleted directory entry durable.

    The one implementation for every writer that renames files into place
    (record logs, the Parquet archive, FOCUS exports). A no-op where folders
    cannot be opened (Windows).
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RecordLog:
    """An append-only log of byte records in JSON Lines segment files.

    Thread-safe for one appending thread plus others that ``sync``,
    ``delete_before`` or read sizes (an outbox acknowledged from a worker thread).

    ``writable=True`` (one process at a time) opens the newest segment for
    appending after truncating a torn tail; ``writable=False`` only reads, and
    sees segments another process creates. ``first_seq`` numbers the first
    segment of an empty directory (an outbox whose segments were all deleted
    continues its numbering from its cursor). ``fresh_segment=True`` makes a
    writer continue in a new segment rather than the newest one unless that
    is empty (see :class:`~mcp_budget_governor.producers.file_ledger.FileLedger`).

    ``mapped=True`` (the outbox's hot path) preallocates the segment being
    written to ``segment_bytes`` (``posix_fallocate``: a full disk fails here,
    as an error, not later as a SIGBUS) and appends by copying into a shared
    memory map of it instead of a ``write()`` per record: the bytes are in the
    page cache when the copy returns (a killed process loses nothing) and
    fsync covers them as it covers written ones. Only that segment has a
    zeroed tail: a rotation and :meth:`close` cut it to its records, and the
    writer that opens it again strips trailing NUL bytes with the torn tail.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        prefix: str = "log",
        fsync: FsyncPolicy = "batch",
        batch_interval: float = DEFAULT_BATCH_INTERVAL,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        writable: bool = True,
        first_seq: int = 0,
        fresh_segment: bool = False,
        mapped: bool = False,
    ) -> None:
        if not _PREFIX.match(prefix):
            raise ValueError(f"prefix: use letters, digits, '_' and '.' only (got {prefix!r})")
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync: one of {FSYNC_POLICIES} (got {fsync!r})")
        if not batch_interval >= 0:  # also refuses NaN, which would never fsync
            raise ValueError(f"batch_interval: seconds >= 0 (got {batch_interval!r})")
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes: a positive size (got {segment_bytes!r})")
        self.directory = Path(directory)
        self.prefix = prefix
        self.fsync: FsyncPolicy = fsync
        self.batch_interval = batch_interval
        self.segment_bytes = segment_bytes
        self.writable = writable
        # Without posix_fallocate (macOS) a full disk would be a SIGBUS: write() instead.
        self.mapped = mapped and writable and hasattr(os, "posix_fallocate")
        # The memory map of the segment being written (mapped logs) and its length.
        self._map: mmap.mmap | None = None
        self._map_size = 0
        name = rf"^{re.escape(prefix)}-(\d{{{SEQ_DIGITS}}}){re.escape(SUFFIX)}$"
        self._pattern = re.compile(name)
        # Torn tails already reported by this reader, so a tailing reader warns once.
        self._warned: set[tuple[int, int]] = set()
        # The writer's state below is guarded by _lock: a Flusher fsyncs from a thread.
        self._lock = threading.Lock()
        self._fd = -1
        self._lock_fd = -1
        # Where the next record goes: (segment, offset, index), one tuple so that
        # another thread reads it whole (the ``_end`` Position is made from it).
        self._at = (first_seq, 0, 0)
        self._sizes: dict[int, int] = {}
        self._written = 0  # bytes appended by this instance
        self._synced = 0  # of which known to be fsync'd
        self._last_sync = time.monotonic()
        self._failed: BaseException | None = None
        self._closed = False
        self.flusher_attached = False
        if writable:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._open_writer(first_seq)
            if fresh_segment and self._end.offset:
                self._rotate(self._end.seq)

    # -- opening -------------------------------------------------------------

    def _open_writer(self, first_seq: int) -> None:
        lock_path = self.directory / f"{self.prefix}.lock"
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise RecordLogError(
                f"{lock_path}: another process is writing this log (one writer per directory)"
            ) from None
        try:
            self._open_segments(first_seq)
        except BaseException:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise

    def _open_segments(self, first_seq: int) -> None:
        segments = self.segments()
        for seg in segments:
            self._sizes[seg] = self.path(seg).stat().st_size
            if self.mapped and seg != segments[-1]:
                self._cut_zeros(seg)
        if not segments:
            self._create_segment(first_seq)
            return
        last = segments[-1]
        path = self.path(last)
        flags = os.O_RDWR if self.mapped else os.O_WRONLY | os.O_APPEND
        self._fd = os.open(path, flags)
        size = self._sizes[last]
        if self.mapped:
            # The zeroed, preallocated tail of a mapped segment a process left
            # open (killed, or a machine crash): not records, and not damage.
            size = self._sizes[last] = _data_end(path, size)
        end, count = _scan_lines(path, size)
        if end < size:
            # A crash mid-write left a line without its newline: cut it off so
            # the next record starts on a clean line instead of extending it.
            log.warning(
                "%s: torn tail at byte %d (%d bytes without a newline, a crash mid-write): "
                "truncated",
                path,
                end,
                size - end,
            )
            os.ftruncate(self._fd, end)
            if self.fsync != "never":
                os.fsync(self._fd)
            self._sizes[last] = end
        self._end = Position(last, end, count)
        if self.mapped:
            self._map_segment(end)

    def _cut_zeros(self, seg: int) -> None:
        """Cut the zeroed tail of a finished segment whose cut a machine crash undid
        (the truncate of a rotation is durable only with the fsync after it)."""
        path = self.path(seg)
        size = self._sizes[seg]
        if not size:
            return
        with open(path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) != b"\0":
                return
        end = _data_end(path, size)
        os.truncate(path, end)
        self._sizes[seg] = end

    def _create_segment(self, seq: int) -> None:
        path = self.path(seq)
        flags = os.O_RDWR if self.mapped else os.O_WRONLY | os.O_APPEND
        self._fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        if self.fsync != "never":
            fsync_dir(self.directory)
        self._sizes[seq] = 0
        self._end = Position(seq, 0, 0)
        if self.mapped:
            self._map_segment(0)

    def _map_segment(self, used: int, need: int = 0) -> None:
        """Preallocate the segment being written and map it (mapped logs; lock held
        or opening). ``used``: its bytes of records; ``need``: a record that must fit."""
        size = max(self.segment_bytes, used + need)
        size += -size % mmap.PAGESIZE
        try:
            # Blocks reserved now: a full disk is an OSError here, never a SIGBUS
            # in the copy of a record into the map.
            os.posix_fallocate(self._fd, 0, size)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, used)  # leave no zeroed tail behind
            raise
        self._map = mmap.mmap(self._fd, size)
        self._map_size = size

    def _unmap(self) -> None:
        """Release the map and cut the zeroed tail: the segment becomes a plain
        JSON Lines file again (lock held)."""
        if self._map is None:
            return
        self._map.close()
        self._map = None
        self._map_size = 0
        os.ftruncate(self._fd, self._sizes.get(self._end.segment, self._end.offset))

    # -- layout --------------------------------------------------------------

    def path(self, segment: int) -> Path:
        """The file of a segment."""
        return self.directory / segment_name(self.prefix, segment)

    def segments(self) -> list[int]:
        """The segments on disk now, oldest first (a fresh directory listing)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = self._pattern.match(name)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    @property
    def end(self) -> Position:
        """Where the next appended record goes (writer only)."""
        return Position(*self._at)

    @property
    def _end(self) -> Position:
        return Position(*self._at)

    @_end.setter
    def _end(self, end: Position) -> None:
        self._at = (end.segment, end.offset, end.index)

    @property
    def total_bytes(self) -> int:
        """Bytes in this log's segment files (tracked by the writer, listed by a reader)."""
        if self.writable:
            with self._lock:
                return sum(self._sizes.values())
        total = 0
        for seg in self.segments():
            with contextlib.suppress(FileNotFoundError):
                total += self.path(seg).stat().st_size
        return total

    def size(self, segment: int) -> int:
        """Bytes in one segment (writer only; 0 for a segment not on disk)."""
        return self._sizes.get(segment, 0)

    def has_segment(self, segment: int) -> bool:
        """Whether the writer knows this segment (no directory listing)."""
        return segment in self._sizes

    def next_segment(self, segment: int) -> int | None:
        """The writer's first segment after ``segment``, if any."""
        with self._lock:
            later = [s for s in self._sizes if s > segment]
        return min(later) if later else None

    def bytes_from(self, position: Position) -> int:
        """Bytes from ``position`` to the end of the log (writer only, no I/O)."""
        with self._lock:
            tail = sum(size for seg, size in self._sizes.items() if seg >= position.segment)
            known = position.segment in self._sizes
        return tail - position.offset if known else tail

    # -- writing -------------------------------------------------------------

    def _check_open(self) -> None:
        if not self.writable:
            raise RecordLogError(f"{self.directory}: this log was opened read-only")
        if self._closed:
            raise RecordLogError(f"{self.directory}: the log is closed")
        if self._failed is not None:
            raise RecordLogError(
                f"{self.directory}: an earlier fsync failed ({self._failed}); "
                "reopen the log to know what is on disk"
            )

    def append(self, records: Sequence[bytes], *, sync: bool | None = None) -> Position:
        """Write ``records`` (each one line, without ``\\n``) in order, in one write.

        Returns the position of the first. ``sync`` overrides the policy for
        this call (``False``: the caller fsyncs through a :class:`Flusher`).
        A batch is never split across segments; the log rotates before a
        batch that would take the current segment past ``segment_bytes``.
        """
        if not records:
            return self._end
        for record in records:
            if not record or b"\n" in record:
                raise ValueError(
                    "a record is one non-empty line: no newline inside "
                    f"(got {bytes(record[:60])!r}...)"
                )
        buf = b"\n".join(records) + b"\n"
        with self._lock:
            self._check_open()
            if self._end.offset and self._end.offset + len(buf) > self.segment_bytes:
                self._rotate(self._end.seq)
            first = self._end
            if self.mapped:
                self._copy_records(records, len(buf), first.offset)
            else:
                _write_all(self._fd, buf, first.offset)
            self._end = Position(first.segment, first.offset + len(buf), first.index + len(records))
            self._sizes[first.segment] += len(buf)
            self._written += len(buf)
        if sync is None:
            if self.fsync == "always":
                sync = True
            elif self.fsync == "batch" and not self.flusher_attached:
                sync = time.monotonic() - self._last_sync >= self.batch_interval
            else:
                sync = False
        if sync:
            self.sync()
        return first

    def append_line(self, record: bytes) -> tuple[int, int, int]:
        """Write one record, never fsyncing (its owner's :class:`Flusher` does): the
        hot path of the outbox. Returns the position just past it (its cursor) as
        the plain ``(segment, offset, index)`` of a :class:`Position`.

        The same write as :meth:`append` of one record, without the batch's
        bookkeeping: one ``write()`` (or, mapped, one copy into the map), no
        temporary list, join or Position.
        """
        if not record or b"\n" in record:
            raise ValueError(
                f"a record is one non-empty line: no newline inside (got {record[:60]!r}...)"
            )
        size = len(record) + 1
        with self._lock:
            if self._closed or self._failed is not None or not self.writable:
                self._check_open()
            segment, offset, index = self._at
            if offset and offset + size > self.segment_bytes:
                self._rotate(segment + index)
                segment, offset, index = self._at
            m = self._map
            if m is not None and offset + size <= self._map_size:
                # A copy into the page cache, no system call: the record, then its
                # newline, so a process killed mid-copy leaves a torn line, never a
                # whole-looking one with a hole (a memcpy may store its tail first).
                m[offset : offset + size - 1] = record
                m[offset + size - 1] = 10
                at = self._at = (segment, offset + size, index + 1)
                self._sizes[segment] += size
                self._written += size
                return at
            if self.mapped:
                self._copy_records((record,), size, offset)
                at = self._at = (segment, offset + size, index + 1)
                self._sizes[segment] += size
                self._written += size
                return at
            buf = record + b"\n"
            try:
                written = os.write(self._fd, buf)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, offset)
                raise
            if written < size:  # a short write (a full disk, a signal): finish or undo
                _write_all(self._fd, buf[written:], offset)
            at = self._at = (segment, offset + size, index + 1)
            self._sizes[segment] += size
            self._written += size
        return at

    def _copy_records(self, records: Sequence[bytes], size: int, offset: int) -> None:
        """Copy records into the map at ``offset``, growing it first if they do not
        fit (one record bigger than a segment); each record before its newline."""
        if self._map is None or offset + size > self._map_size:
            if self._map is not None:
                self._map.close()
                self._map = None
            self._map_segment(offset, size)
        m = self._map
        assert m is not None
        for record in records:
            end = offset + len(record)
            m[offset:end] = record
            m[end] = 10
            offset = end + 1

    def _rotate(self, seq: int) -> None:
        """Start a new segment at ``seq`` (lock held)."""
        self._unmap()
        if self.fsync != "never" and self._written > self._synced:
            # The old segment is closed for good: make it durable now rather
            # than leave a Flusher holding on to its descriptor.
            try:
                os.fsync(self._fd)
            except OSError as exc:
                self._failed = exc
                raise RecordLogError(f"fsync of {self.path(self._end.segment)}: {exc}") from exc
            self._synced = self._written
        old = self._end
        os.close(self._fd)
        self._fd = -1
        if old.offset == 0 and old.segment != seq:
            # An empty segment named for a sequence number that will not be used.
            self.path(old.segment).unlink()
            del self._sizes[old.segment]
        self._create_segment(seq)

    def roll(self, min_seq: int) -> None:
        """Continue in a new segment numbered at least ``min_seq`` (used when a
        cursor is ahead of what survived on disk, so new records sort after it)."""
        with self._lock:
            self._check_open()
            seq = max(min_seq, self._end.seq)
            if self._end.offset == 0 and self._end.segment == seq:
                return
            self._rotate(seq)

    @property
    def written_bytes(self) -> int:
        """Bytes this instance has appended (a mark :class:`Flusher` waits on)."""
        return self._written

    @property
    def synced_bytes(self) -> int:
        """Of :attr:`written_bytes`, how many an fsync has covered."""
        return self._synced

    @property
    def unsynced_bytes(self) -> int:
        """Bytes this instance appended that no fsync has covered yet."""
        return self._written - self._synced

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def sync(self) -> None:
        """fsync everything appended so far. Thread-safe; appends may continue meanwhile."""
        with self._lock:
            self._check_open()
            mark = self._written
            if mark <= self._synced:
                self._last_sync = time.monotonic()
                return
            # A duplicate descriptor: a rotation may close the original while
            # this fsync runs in a Flusher's thread.
            fd = os.dup(self._fd)
            path = self.path(self._end.segment)
        try:
            os.fsync(fd)
        except OSError as exc:
            self._failed = exc
            log.error("fsync of %s failed: %s; the log refuses further writes", path, exc)
            raise RecordLogError(f"fsync of {path}: {exc}") from exc
        finally:
            os.close(fd)
        with self._lock:
            self._synced = max(self._synced, mark)
            self._last_sync = time.monotonic()

    def delete_before(self, segment: int) -> int:
        """Delete the whole segments older than ``segment`` (never the one being
        written). Returns the bytes freed."""
        freed = 0
        deleted = False
        if self.writable:
            with self._lock:
                if not any(seg < segment for seg in self._sizes):
                    return 0  # the writer knows every segment: none to delete, no listing
        for seg in self.segments():
            if seg >= segment or seg >= self._end.segment:
                break
            path = self.path(seg)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("%s: not deleted (%s); will retry", path, exc)
                continue
            with self._lock:
                freed += self._sizes.pop(seg, 0)
            deleted = True
        if deleted and self.fsync != "never":
            fsync_dir(self.directory)
        return freed

    def close(self) -> None:
        """fsync (whatever the policy) and release the file and the writer lock."""
        if self._closed:
            return
        try:
            if self._map is not None:
                with self._lock:
                    self._unmap()
            if self.writable and self._failed is None and self._written > self._synced:
                self.sync()
        finally:
            self._closed = True
            for fd in (self._fd, self._lock_fd):
                if fd >= 0:
                    os.close(fd)  # closing the lock file releases the flock
            self._fd = self._lock_fd = -1

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------

    def read(
        self,
        start: Position | None = None,
        *,
        validate: Callable[[bytes], object] | None = None,
    ) -> Generator[LogRecord, None, None]:
        """Every complete record from ``start`` (default: the oldest), in order across segments.

        ``validate(data)`` may raise ``ValueError`` for a record the caller
        cannot use; such a record (and an empty line) is yielded with
        ``error`` set, never raised. A torn tail is skipped with a warning; in
        the newest segment reading stops before it (a writer may be finishing
        that line; the next ``read`` from the same position sees it complete).
        A ``start`` in a segment that no longer exists resumes at the next one.
        """
        segments = self.segments()
        if start is None:
            if not segments:
                return
            start = Position(segments[0], 0, 0)
        for i, seg in enumerate(segments):
            if seg < start.segment:
                continue
            offset, index = (start.offset, start.index) if seg == start.segment else (0, 0)
            newest = i == len(segments) - 1
            path = self.path(seg)
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed in the finally below
            except FileNotFoundError:
                continue  # deleted (shipped) while we listed
            # A mapped writer's own segments hold zeros past their records: it
            # reads what it wrote (the size it keeps), not the preallocated tail.
            limit = self._sizes.get(seg) if self.mapped else None
            try:
                f.seek(offset)
                for line in f if limit is None else _lines_upto(f, limit - offset):
                    if not line.endswith(b"\n"):
                        if line.strip(b"\0"):  # all NUL: a mapped segment's zeroed tail
                            self._torn(path, seg, offset, len(line), newest)
                        break
                    data = line[:-1]
                    error = None
                    if not data:
                        error = "empty line"
                    elif validate is not None:
                        try:
                            validate(data)
                        except ValueError as exc:
                            error = str(exc) or type(exc).__name__
                    yield LogRecord(Position(seg, offset, index), data, error)
                    offset += len(line)
                    index += 1
                else:
                    continue
                if newest:
                    return
            finally:
                f.close()

    def _torn(self, path: Path, seg: int, offset: int, length: int, newest: bool) -> None:
        if (seg, offset) in self._warned:
            return
        if newest:
            try:
                age = time.time() - path.stat().st_mtime
            except FileNotFoundError:
                return
            if age < IN_PROGRESS_SECONDS:
                # Most likely a live writer's line caught half copied: say
                # nothing yet; if it is still unterminated later, it is torn.
                return
            self._warned.add((seg, offset))
            log.warning(
                "%s: torn tail at byte %d (%d bytes without a newline, unchanged for %.0f s): "
                "not read",
                path,
                offset,
                length,
                age,
            )
            return
        self._warned.add((seg, offset))
        log.warning(
            "%s: torn tail at byte %d (%d bytes without a newline): skipped",
            path,
            offset,
            length,
        )


def _write_all(fd: int, buf: bytes, start: int) -> None:
    """Write all of ``buf`` or nothing: a failure (a full disk) truncates back
    to ``start``, where the batch started (the writer knows its end: no lseek on
    the hot path), so no half record is left for the next one to extend."""
    view = memoryview(buf)
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def _lines_upto(f: BinaryIO, size: int) -> Iterator[bytes]:
    """The lines of ``f`` within its next ``size`` bytes (the last one maybe cut)."""
    while size > 0 and (line := f.readline(size)):
        size -= len(line)
        yield line


def _data_end(path: Path, size: int) -> int:
    """The length of a file without its trailing NUL bytes (a mapped segment's
    zeroed tail); a NUL inside the records, followed by more, is damage, kept."""
    with open(path, "rb") as f:
        while size > 0:
            start = max(0, size - _SCAN_CHUNK)
            f.seek(start)
            chunk = f.read(size - start).rstrip(b"\0")
            if chunk:
                return start + len(chunk)
            size = start
    return 0


def _scan_lines(path: Path, limit: int | None = None) -> tuple[int, int]:
    """The byte length of the complete lines of a file (of its first ``limit``
    bytes), and how many there are."""
    end = count = pos = 0
    with open(path, "rb") as f:
        while chunk := f.read(_SCAN_CHUNK if limit is None else min(_SCAN_CHUNK, limit - pos)):
            n = chunk.count(b"\n")
            if n:
                count += n
                end = pos + chunk.rindex(b"\n") + 1
            pos += len(chunk)
    return end, count


class Flusher:
    """Group commit: one fsync, in a background thread, for every append since the last.

    The log stops syncing inline once a flusher is attached. ``notify()``
    after an append asks for an fsync no sooner than ``interval`` after the
    previous one ("batch"); ``await wait_synced()`` returns once an fsync
    covers everything appended before the call ("always" with ``interval=0``:
    callers that arrive while an fsync runs share the next one).

    The fsyncs run in one long-lived thread that the event loop never waits
    for: ``notify()`` costs an attribute read when an fsync is already due,
    and the loop is woken only for callers of ``wait_synced`` (one wake-up
    per fsync that releases any), so the hot path's cost does not grow with
    the fsync rate.
    """

    def __init__(self, record_log: RecordLog, interval: float | None = None) -> None:
        self.log = record_log
        self.interval = record_log.batch_interval if interval is None else interval
        record_log.flusher_attached = True
        self._cv = threading.Condition()
        self._due = False  # an fsync was asked for and has not started yet
        self._stop = False
        self._thread: threading.Thread | None = None
        # (bytes to cover, future, its loop), guarded by _cv
        self._waiters: list[tuple[int, asyncio.Future[None], asyncio.AbstractEventLoop]] = []
        self._last = 0.0
        #: group commits done, and their total and longest duration (seconds): the
        #: window a machine crash can lose is ``interval`` plus one fsync's duration
        self.fsyncs = 0
        self.fsync_seconds = 0.0
        self.longest_fsync = 0.0

    def _start(self) -> None:
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(
                target=self._run, name=f"mcpbg-fsync:{self.log.directory.name}", daemon=True
            )
            self._thread.start()

    def notify(self) -> None:
        """Something was appended: fsync it within ``interval``."""
        if self._due:
            return  # already asked; the fsync it starts covers this append too
        with self._cv:
            self._due = True
            self._cv.notify()
        self._start()

    async def wait_synced(self) -> None:
        """Return once everything appended so far is fsync'd (raises if the fsync failed)."""
        target = self.log.written_bytes
        if target <= self.log.synced_bytes:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._cv:
            self._waiters.append((target, future, loop))
            self._due = True
            self._cv.notify()
        self._start()
        await future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._due and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                # Group commit: no sooner than `interval` after the previous fsync
                # (an interruptible wait, so that closing does not wait it out).
                delay = self._last + self.interval - time.monotonic()
                while delay > 0 and not self._stop:
                    self._cv.wait(delay)
                    delay = self._last + self.interval - time.monotonic()
                if self._stop:
                    return
                self._due = False
            started = time.monotonic()
            try:
                self.log.sync()
            except Exception as exc:  # a failed fsync: every waiter must hear of it
                # and so must later ones: the thread stays, and the log refuses again.
                self._release(exc)
                continue
            self._last = time.monotonic()
            took = self._last - started
            self.fsyncs += 1
            self.fsync_seconds += took
            self.longest_fsync = max(self.longest_fsync, took)
            self._release(None)
            if self.log.written_bytes > self.log.synced_bytes:
                with self._cv:
                    self._due = True

    def _release(self, exc: BaseException | None) -> None:
        """Settle the waiters an fsync covered (or all of them, on an error); any thread."""
        synced = self.log.synced_bytes
        with self._cv:
            done = [w for w in self._waiters if exc is not None or w[0] <= synced]
            self._waiters = [w for w in self._waiters if exc is None and w[0] > synced]
        for _, future, loop in done:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, exc)

    async def aclose(self) -> None:
        """Stop the thread and fsync what is left."""
        thread = self._thread
        if thread is not None:
            with self._cv:
                self._stop = True
                self._cv.notify()
            await asyncio.to_thread(thread.join)
            self._thread = None
        error: BaseException | None = None
        try:
            if not self.log.closed:
                await asyncio.to_thread(self.log.sync)
        except RecordLogError as exc:
            error = exc
        self._release(error)
        closed = RecordLogError("the flusher was closed")
        with self._cv:
            left, self._waiters = self._waiters, []
        for _, future, loop in left:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, closed)
        await asyncio.sleep(0)  # let this loop's settled waiters run
        if error is not None:
            raise error


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return  # cancelled meanwhile
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def warn_unclosed(message: str, logger: logging.Logger) -> None:
    """Say loudly that a ledger was dropped unclosed: a ``ResourceWarning`` and a log
    line, neither of which may raise (this runs in ``__del__``, maybe at exit)."""
    with contextlib.suppress(Exception):
        warnings.warn(message, ResourceWarning, stacklevel=3)
    with contextlib.suppress(Exception):
        logger.warning("%s", message)
