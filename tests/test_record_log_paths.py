"""The record log and the outbox on their less travelled paths.

What an operator relies on when things go wrong: a second writer is refused,
bad settings and bad cursor files are named, a full disk or a failed fsync
leaves a log that still reads and refuses to pretend, a lost tail does not
make new records count as shipped, and group-commit waiters always hear how
their fsync went.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mcp_budget_governor.producers.outbox import Outbox
from mcp_budget_governor.producers.record_log import (
    Flusher,
    Position,
    RecordLog,
    RecordLogError,
    segment_name,
)

# Fault injection below tells a segment file from other files by the path of
# its descriptor; that needs Linux's /proc.
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd to name descriptors"
)


def rec(i: int) -> bytes:
    """A record of exactly 12 bytes (11 + newline) for every i < 1000."""
    return b'{"n":"%03d"}' % i


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def datas(log: RecordLog, start: Position | None = None) -> list[bytes]:
    return [r.data for r in log.read(start)]


def segment_files(directory: Path, prefix: str = "log") -> list[str]:
    return sorted(p.name for p in directory.glob(f"{prefix}-*.jsonl"))


def failing_fsync(mp: pytest.MonkeyPatch) -> list[str]:
    """Make fsync of segment files fail with EIO (directories and cursors still sync)."""
    real = os.fsync
    failed: list[str] = []

    def fsync(fd: int) -> None:
        path = fd_path(fd)
        if path.endswith(".jsonl"):
            failed.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    mp.setattr(os, "fsync", fsync)
    return failed


# --------------------------------------------------------------------------- #
# settings and cursor values are checked, and the bad one is named
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ([0, 0, 0], "a position is an object, got [0, 0, 0]"),
        (None, "a position is an object, got None"),
        ({"segment": 0, "offset": 5}, "index: a non-negative integer, got None"),
        ({"segment": -1, "offset": 0, "index": 0}, "segment: a non-negative integer, got -1"),
        ({"segment": 0, "offset": 1.0, "index": 0}, "offset: a non-negative integer, got 1.0"),
        ({"segment": True, "offset": 0, "index": 0}, "segment: a non-negative integer, got True"),
        ({"segment": 0, "offset": 0, "index": "3"}, "index: a non-negative integer, got '3'"),
    ],
)
def test_position_from_json_names_what_is_wrong(raw: object, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        Position.from_json(raw)
    assert str(info.value) == named


def test_position_round_trips_through_json() -> None:
    p = Position(segment=40, offset=1234, index=7)
    assert Position.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert p.seq == 47


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"prefix": "../escape"},
            "prefix: use letters, digits, '_' and '.' only (got '../escape')",
        ),
        ({"prefix": ""}, "prefix: use letters, digits, '_' and '.' only (got '')"),
        ({"fsync": "sometimes"}, "fsync: one of ('always', 'batch', 'never') (got 'sometimes')"),
        ({"batch_interval": -0.5}, "batch_interval: seconds >= 0 (got -0.5)"),
        ({"segment_bytes": 0}, "segment_bytes: a positive size (got 0)"),
        pytest.param(
            {"batch_interval": float("nan")},
            "batch_interval: seconds >= 0 (got nan)",
            id="nan-batch-interval",
        ),
    ],
)
def test_record_log_rejects_bad_settings_naming_field_and_value(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    directory = tmp_path / "log"
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        RecordLog(directory, **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert not directory.exists(), "a rejected configuration must leave nothing on disk"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_bytes": 0}, "max_bytes: a positive size (got 0)"),
        ({"max_bytes": 100, "on_full": "drop"}, "on_full: 'refuse' or 'admit' (got 'drop')"),
        ({"max_bytes": 100, "segment_bytes": -1}, "segment_bytes: a positive size (got -1)"),
    ],
)
def test_outbox_rejects_bad_settings_naming_field_and_value(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        Outbox(tmp_path / "box", **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


# --------------------------------------------------------------------------- #
# one writer per directory and prefix
# --------------------------------------------------------------------------- #

HOLDER = textwrap.dedent(
    """
    import sys, time
    from mcp_budget_governor.producers.record_log import RecordLog

    log = RecordLog(sys.argv[1], fsync="always")
    log.append([b'{"from":"child"}'])
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_a_second_writer_process_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"

        with pytest.raises(RecordLogError) as info:
            RecordLog(tmp_path)
        message = str(info.value)
        assert str(tmp_path / "log.lock") in message
        assert "another process is writing this log" in message
        assert isinstance(info.value, OSError)  # callers handling OSError see it too

        # Readers take no lock; another prefix is another log with its own lock.
        assert datas(RecordLog(tmp_path, writable=False)) == [b'{"from":"child"}']
        with RecordLog(tmp_path, prefix="other") as other:
            other.append([rec(1)])
        assert datas(RecordLog(tmp_path, prefix="other", writable=False)) == [rec(1)]
        assert datas(RecordLog(tmp_path, writable=False)) == [b'{"from":"child"}']
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    # The kernel dropped the lock with the process (no stale lock file to clean up).
    assert (tmp_path / "log.lock").exists()
    with RecordLog(tmp_path) as log:
        assert log.end.seq == 1
        log.append([rec(2)])
    assert datas(RecordLog(tmp_path, writable=False)) == [b'{"from":"child"}', rec(2)]


def test_a_writer_that_fails_to_open_releases_the_lock(tmp_path: Path) -> None:
    # The newest "segment" cannot be opened for appending (here: a directory).
    (tmp_path / segment_name("log", 0)).mkdir()
    with pytest.raises(IsADirectoryError):
        RecordLog(tmp_path)
    (tmp_path / segment_name("log", 0)).rmdir()
    # Same process, new descriptor: a leaked flock would refuse this writer.
    with RecordLog(tmp_path) as log:
        log.append([rec(0)])
    assert datas(RecordLog(tmp_path, writable=False)) == [rec(0)]


def test_closed_and_read_only_logs_refuse_writes(tmp_path: Path) -> None:
    log = RecordLog(tmp_path)
    log.append([rec(0)])
    log.close()
    log.close()  # closing twice is harmless
    assert log.closed
    with pytest.raises(RecordLogError, match="the log is closed"):
        log.append([rec(1)])
    with pytest.raises(RecordLogError, match="the log is closed"):
        log.roll(10)

    reader = RecordLog(tmp_path, writable=False)
    for write in (lambda: reader.append([rec(1)]), reader.sync):
        with pytest.raises(RecordLogError, match="opened read-only"):
            write()
    assert datas(reader) == [rec(0)]


def test_a_reader_of_a_missing_directory_sees_an_empty_log(tmp_path: Path) -> None:
    missing = tmp_path / "not-yet"
    reader = RecordLog(missing, writable=False)
    assert reader.segments() == []
    assert list(reader.read()) == []
    assert reader.total_bytes == 0
    assert not missing.exists(), "a reader must not create the writer's directory"

    with RecordLog(missing, segment_bytes=36) as writer:
        for i in range(7):
            writer.append([rec(i)])
        assert writer.append([]) == writer.end  # an empty batch writes nothing
        written = writer.total_bytes
    assert written == 7 * 12
    # The reader lists the files the writer made: same records, same byte count.
    assert reader.total_bytes == written
    assert datas(reader) == [rec(i) for i in range(7)]


# --------------------------------------------------------------------------- #
# segments
# --------------------------------------------------------------------------- #


def test_rotation_exactly_at_the_size_limit_and_never_splitting_a_batch(tmp_path: Path) -> None:
    with RecordLog(tmp_path, segment_bytes=36) as log:
        for i in range(3):  # 3 x 12 bytes: exactly the limit, still one segment
            log.append([rec(i)])
        assert segment_files(tmp_path) == [segment_name("log", 0)]
        log.append([rec(3)])  # would pass it: a new segment, named by sequence number
        # A 48-byte batch never fits: it goes whole into a segment of its own.
        first = log.append([rec(i) for i in range(4, 8)])
        assert first == Position(4, 0, 0)
        log.append([rec(8)])
    sizes = {p.name: p.stat().st_size for p in tmp_path.glob("*.jsonl")}
    assert sizes == {
        segment_name("log", 0): 36,
        segment_name("log", 3): 12,
        segment_name("log", 4): 48,
        segment_name("log", 8): 12,
    }
    records = list(RecordLog(tmp_path, writable=False).read())
    assert [r.data for r in records] == [rec(i) for i in range(9)]
    assert [r.position.seq for r in records] == list(range(9))


def test_records_larger_than_the_scan_chunk_survive_a_reopen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Reopening a writer finds the end of the complete lines even when a record,
    or a torn tail, is longer than the 1 MiB chunks the file is scanned in."""
    big = b'{"blob":"' + b"x" * (5 << 19) + b'"}'  # 2.5 MiB
    with RecordLog(tmp_path) as log:
        log.append([big])
        log.append([rec(1)])
    (segment,) = tmp_path.glob("*.jsonl")
    clean = segment.stat().st_size
    with segment.open("ab") as f:
        f.write(b'{"torn":"' + b"y" * (3 << 19))  # 1.5 MiB without a newline
    caplog.set_level(logging.WARNING)
    with RecordLog(tmp_path) as log:
        assert f"{segment}: torn tail at byte {clean}" in caplog.text
        assert log.end == Position(0, clean, 2)
        log.append([rec(2)])
    assert datas(RecordLog(tmp_path, writable=False)) == [big, rec(1), rec(2)]


def test_delete_before_frees_whole_old_segments_and_retries_what_it_could_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = RecordLog(tmp_path, segment_bytes=24)
    for i in range(9):
        log.append([rec(i)])  # segments 0, 2, 4, 6, 8 (the one being written)
    assert segment_files(tmp_path) == [segment_name("log", s) for s in (0, 2, 4, 6, 8)]

    # Never the segment being written, whatever the argument.
    assert log.delete_before(0) == 0
    gone, stuck = (tmp_path / segment_name("log", s) for s in (0, 2))
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == gone:  # another cleaner got there between listing and unlink
            real_unlink(self)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(self))
        if self == stuck:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real_unlink(self, missing_ok)

    caplog.set_level(logging.WARNING)
    with monkeypatch.context() as mp:
        mp.setattr(Path, "unlink", unlink)
        freed = log.delete_before(99)
    # 0 is gone (not an error), 2 is kept with a warning, 4 and 6 are deleted.
    assert freed == 3 * 24
    assert segment_files(tmp_path) == [segment_name("log", s) for s in (2, 8)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{stuck}: not deleted (") and "will retry" in warnings[0]
    assert log.total_bytes == 24 + 12
    # The next call retries it.
    assert log.delete_before(99) == 24
    assert segment_files(tmp_path) == [segment_name("log", 8)]
    assert datas(log) == [rec(8)]
    log.close()


def test_a_reader_survives_segments_deleted_while_it_reads(tmp_path: Path) -> None:
    with RecordLog(tmp_path, segment_bytes=24) as log:
        for i in range(6):
            log.append([rec(i)])  # segments 0, 2, 4
    reader = RecordLog(tmp_path, writable=False)
    records = reader.read()
    assert next(records).data == rec(0)
    (tmp_path / segment_name("log", 2)).unlink()  # shipped while the reader was in 0
    assert [r.data for r in records] == [rec(1), rec(4), rec(5)]
    # A start position in a deleted segment resumes at the next one.
    assert datas(reader, Position(2, 12, 1)) == [rec(4), rec(5)]


def test_a_torn_newest_line_is_read_once_complete_and_reported_once_when_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    writer = RecordLog(tmp_path)
    writer.append([rec(0), rec(1)])
    (segment,) = tmp_path.glob("*.jsonl")
    caplog.set_level(logging.WARNING)
    reader = RecordLog(tmp_path, writable=False)

    # A writer caught mid-line: the reader stops before it, silently.
    with segment.open("ab") as f:
        f.write(rec(2)[:5])
    seen = list(reader.read())
    assert [r.data for r in seen] == [rec(0), rec(1)]
    assert "torn" not in caplog.text

    # Still unterminated after IN_PROGRESS_SECONDS: a warning, once, however
    # often a tailing reader polls.
    past = time.time() - 60
    os.utime(segment, (past, past))
    for _ in range(3):
        assert [r.data for r in reader.read(seen[-1].next)] == []
    warnings = [r.getMessage() for r in caplog.records if "torn tail" in r.getMessage()]
    assert warnings == [
        f"{segment}: torn tail at byte 24 (5 bytes without a newline, unchanged for 60 s): not read"
    ]

    # The line completed: the next read from the same position yields it whole.
    with segment.open("ab") as f:
        f.write(rec(2)[5:] + b"\n")
    (last,) = reader.read(seen[-1].next)
    assert (last.data, last.position, last.error) == (rec(2), Position(0, 24, 2), None)
    writer.close()


# --------------------------------------------------------------------------- #
# a full disk, a failed fsync
# --------------------------------------------------------------------------- #


@needs_proc
def test_a_write_that_runs_out_of_disk_leaves_no_half_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outbox = Outbox(tmp_path, max_bytes=1 << 20, mapped=False)  # the write() path
    outbox.append([rec(0), rec(1)])
    (segment,) = tmp_path.glob("*.jsonl")
    before = segment.read_bytes()
    pending, length = outbox.pending_bytes, len(outbox)

    real_write = os.write
    calls: list[int] = []

    def write(fd: int, data: bytes) -> int:
        if not fd_path(fd).endswith(".jsonl"):
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:  # the kernel takes part of the batch...
            return real_write(fd, bytes(data[:17]))
        raise OSError(errno.ENOSPC, "No space left on device")  # ...then the disk is full

    with monkeypatch.context() as mp:
        mp.setattr(os, "write", write)
        with pytest.raises(OSError, match="No space left") as info:
            outbox.append([rec(2), rec(3), rec(4)])
    assert info.value.errno == errno.ENOSPC
    assert len(calls) == 2, "the partial write was continued before the disk ran out"

    # Nothing of the batch is left, and the outbox's books agree with the disk.
    assert segment.read_bytes() == before
    assert (outbox.pending_bytes, len(outbox)) == (pending, length)
    assert [raw for _, raw in outbox.peek(10)] == [rec(0), rec(1)]

    # Space is back: the next batch starts on a clean line.
    outbox.append([rec(2)])
    outbox.close()
    with Outbox(tmp_path, max_bytes=1 << 20) as again:
        assert [raw for _, raw in again.peek(10)] == [rec(0), rec(1), rec(2)]
        assert [cursor.seq for cursor, _ in again.peek(10)] == [1, 2, 3]


def test_a_mapped_segment_that_finds_no_disk_space_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mapped outbox reserves each segment's blocks when it starts it: a full disk
    is an OSError from the append that needed the new segment (never a SIGBUS in
    the copy), the books are unchanged, and the append after it succeeds."""
    outbox = Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=len(rec(0)) * 2 + 2)
    outbox.append([rec(0)])
    outbox.log.append_line(rec(1))
    pending, length = outbox.pending_bytes, len(outbox)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(os, "posix_fallocate", full)
        with pytest.raises(OSError, match="No space left"):
            outbox.log.append_line(rec(2))  # needs a new segment
    assert (outbox.pending_bytes, len(outbox)) == (pending, length)
    outbox.log.append_line(rec(2))
    assert [raw for _, raw in outbox.peek(10)] == [rec(0), rec(1), rec(2)]
    outbox.close()
    for segment in tmp_path.glob("*.jsonl"):  # closed: no zeroed tails left
        assert not segment.read_bytes().endswith(b"\0")
    with Outbox(tmp_path, max_bytes=1 << 20) as again:
        assert [raw for _, raw in again.peek(10)] == [rec(0), rec(1), rec(2)]


@needs_proc
def test_after_a_failed_fsync_the_log_refuses_writes_until_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = RecordLog(tmp_path, fsync="always")
    log.append([rec(0)])
    caplog.set_level(logging.ERROR)
    with monkeypatch.context() as mp:
        failed = failing_fsync(mp)
        with pytest.raises(RecordLogError) as info:
            log.append([rec(1)])
    segment = tmp_path / segment_name("log", 0)
    assert failed == [str(segment)]
    assert str(info.value).startswith(f"fsync of {segment}: ")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
    assert f"fsync of {segment} failed" in caplog.text
    assert "refuses further writes" in caplog.text

    # fsync works again, but the log must not report durability it cannot know.
    for attempt in (lambda: log.append([rec(2)]), log.sync, lambda: log.roll(50)):
        with pytest.raises(RecordLogError, match=r"an earlier fsync failed .*reopen the log"):
            attempt()
    log.close()  # does not retry the fsync, releases the lock

    with RecordLog(tmp_path) as reopened:
        assert datas(reopened) == [rec(0), rec(1)]  # the kernel still had rec(1)
        reopened.append([rec(2)])
    assert datas(RecordLog(tmp_path, writable=False)) == [rec(0), rec(1), rec(2)]


@needs_proc
def test_a_failed_fsync_before_rotating_refuses_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Group commit that has not synced yet: the segment is fsync'd on rotation.
    log = RecordLog(tmp_path, fsync="batch", batch_interval=3600, segment_bytes=24)
    log.append([rec(0), rec(1)])
    assert log.unsynced_bytes == 24
    with monkeypatch.context() as mp:
        failing_fsync(mp)
        first = re.escape(f"fsync of {tmp_path / segment_name('log', 0)}: ")
        with pytest.raises(RecordLogError, match=first):
            log.append([rec(2)])
    assert segment_files(tmp_path) == [segment_name("log", 0)]  # no rotation, no record 2
    with pytest.raises(RecordLogError, match="an earlier fsync failed"):
        log.append([rec(2)])
    log.close()
    assert datas(RecordLog(tmp_path, writable=False)) == [rec(0), rec(1)]


# --------------------------------------------------------------------------- #
# Flusher: every waiter hears how its fsync went
# --------------------------------------------------------------------------- #


class GatedFsync:
    """os.fsync that holds segment fsyncs until ``release`` (the rest pass)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.segment_calls = 0
        self._real = os.fsync
        mp.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        if fd_path(fd).endswith(".jsonl"):
            self.segment_calls += 1
            self.entered.set()
            if not self.release.wait(10):
                raise TimeoutError("the test never released the fsync")
        self._real(fd)


@needs_proc
async def test_a_failed_group_fsync_reaches_every_waiter_and_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = RecordLog(tmp_path, fsync="batch", batch_interval=0)
    flusher = Flusher(log, interval=0)
    log.append([rec(0)], sync=False)
    with monkeypatch.context() as mp:
        failing_fsync(mp)
        waiters = [asyncio.create_task(flusher.wait_synced()) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5)
    # The fsync thread may start before the last waiter arrives: that one then hears
    # of the earlier failure rather than sharing it; none is told its bytes are safe.
    assert all(
        isinstance(r, RecordLogError) and ("fsync of" in str(r) or "earlier fsync failed" in str(r))
        for r in results
    ), results
    assert any("fsync of" in str(r) for r in results), results

    # fsync works again; a caller arriving later is not told its bytes are safe.
    with pytest.raises(RecordLogError, match="an earlier fsync failed"):
        await asyncio.wait_for(flusher.wait_synced(), 5)
    with pytest.raises(RecordLogError, match="an earlier fsync failed"):
        log.append([rec(1)], sync=False)
    with pytest.raises(RecordLogError, match="an earlier fsync failed"):
        await flusher.aclose()
    log.close()


@needs_proc
async def test_a_cancelled_waiter_does_not_strand_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = RecordLog(tmp_path, fsync="batch", batch_interval=0)
    flusher = Flusher(log, interval=0)
    gate = GatedFsync(monkeypatch)
    log.append([rec(0)], sync=False)
    impatient = asyncio.create_task(flusher.wait_synced())
    patient = asyncio.create_task(flusher.wait_synced())
    assert await asyncio.to_thread(gate.entered.wait, 5)
    impatient.cancel()  # say, the request it belongs to timed out
    await asyncio.sleep(0)
    gate.release.set()
    await asyncio.wait_for(patient, 5)
    assert impatient.cancelled()
    assert log.unsynced_bytes == 0
    # The flusher still serves later callers.
    log.append([rec(1)], sync=False)
    await asyncio.wait_for(flusher.wait_synced(), 5)
    assert log.unsynced_bytes == 0
    await flusher.aclose()
    log.close()


@needs_proc
async def test_bytes_appended_during_an_fsync_wait_for_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = RecordLog(tmp_path, fsync="batch", batch_interval=0)
    flusher = Flusher(log, interval=0)
    gate = GatedFsync(monkeypatch)
    synced_when_done: dict[str, int] = {}

    async def wait(name: str) -> None:
        await flusher.wait_synced()
        synced_when_done[name] = log.synced_bytes

    log.append([rec(0)], sync=False)
    first = asyncio.create_task(wait("first"))
    assert await asyncio.to_thread(gate.entered.wait, 5)
    log.append([rec(1), rec(2)], sync=False)  # while the first fsync runs
    second = asyncio.create_task(wait("second"))
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()
    gate.release.set()
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    # Each returned only once an fsync covered its own bytes: that took two.
    assert synced_when_done["first"] >= 12
    assert synced_when_done["second"] == 36
    assert gate.segment_calls == 2
    await flusher.aclose()
    log.close()


@needs_proc
@pytest.mark.parametrize("fsync_fails", [False, True], ids=["fsync-ok", "fsync-fails"])
async def test_closing_the_flusher_settles_pending_waiters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync_fails: bool
) -> None:
    log = RecordLog(tmp_path, fsync="batch", batch_interval=0)
    flusher = Flusher(log, interval=0)
    log.append([rec(0)], sync=False)
    await asyncio.wait_for(flusher.wait_synced(), 5)
    flusher.interval = 3600
    log.append([rec(1)], sync=False)
    waiter = asyncio.create_task(flusher.wait_synced())
    await asyncio.sleep(0.05)
    assert not waiter.done()  # the next group fsync is an hour away

    with monkeypatch.context() as mp:
        if fsync_fails:
            failing_fsync(mp)
            with pytest.raises(RecordLogError, match="fsync of"):
                await flusher.aclose()
            with pytest.raises(RecordLogError, match="fsync of"):
                await asyncio.wait_for(waiter, 5)
        else:
            await flusher.aclose()  # the last fsync happens now, not in an hour
            await asyncio.wait_for(waiter, 5)
            assert log.unsynced_bytes == 0
    log.close()
    await flusher.aclose()  # after the log closed: nothing to do, nothing raised


# --------------------------------------------------------------------------- #
# the outbox's cursor
# --------------------------------------------------------------------------- #


def shipped_outbox(directory: Path, n: int = 10, acked: int = 6) -> None:
    """An outbox of ``n`` records in 3-record segments, the first ``acked`` shipped."""
    with Outbox(directory, max_bytes=1 << 20, segment_bytes=36) as outbox:
        outbox.append([rec(i) for i in range(3)])
        for i in range(3, n):
            outbox.append([rec(i)])
        batch = outbox.peek(acked)
        outbox.ack(batch[-1][0])


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[6]", b'{"segment": 6, "offset": -1, "index": 0}', b"\xff\xfe", b""],
    ids=["not-json", "a-list", "negative", "not-utf8", "empty"],
)
def test_an_unreadable_cursor_ships_again_from_the_oldest_segment(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    shipped_outbox(tmp_path)
    assert segment_files(tmp_path, "outbox") == [segment_name("outbox", s) for s in (6, 9)]
    cursor = tmp_path / "outbox.cursor"
    cursor.write_bytes(content)
    caplog.set_level(logging.ERROR)
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=36) as outbox:
        # Shipped records are sent again (harmless); unshipped ones are never skipped.
        assert [raw for _, raw in outbox.peek(100)] == [rec(i) for i in range(6, 10)]
        assert len(outbox) == 4
        outbox.ack(outbox.peek(1)[0][0])
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].startswith(f"{cursor}: unreadable (")
    assert errors[0].endswith("shipping again from the oldest segment")
    assert Position.from_json(json.loads(cursor.read_bytes())).seq == 7  # rewritten


@pytest.mark.parametrize("survivors", [3, 0], ids=["partial-tail-lost", "all-lost"])
def test_a_cursor_past_the_surviving_records_does_not_count_new_ones_as_shipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, survivors: int
) -> None:
    """fsync="never" and a machine crash: the cursor (acked up to 8) outlived the
    records. New records must sort after the cursor, or they would be skipped."""
    with Outbox(tmp_path, max_bytes=1 << 20, fsync="never") as outbox:
        outbox.append([rec(i) for i in range(10)])
        outbox.ack(outbox.peek(8)[-1][0])
    segment = tmp_path / segment_name("outbox", 0)
    with segment.open("r+b") as f:
        f.truncate(12 * survivors)

    caplog.set_level(logging.ERROR)
    with Outbox(tmp_path, max_bytes=1 << 20, fsync="never") as outbox:
        message = caplog.records[-1].getMessage()
        assert message.startswith(f"{tmp_path / 'outbox.cursor'}: the acknowledged cursor")
        assert "past the end of the log" in message
        assert outbox.empty and outbox.pending_bytes == 0
        assert outbox.acked == Position(8, 0, 0)
        first = outbox.append([rec(100), rec(101)])
        assert first == Position(8, 0, 0)
        batch = outbox.peek(10)
        assert [raw for _, raw in batch] == [rec(100), rec(101)]
        # An empty leftover segment is removed at once; one with records goes
        # with the next acknowledgement, since it is all before the cursor.
        expected = [segment_name("outbox", 8)]
        if survivors:
            expected.insert(0, segment.name)
        assert segment_files(tmp_path, "outbox") == expected
        outbox.ack(batch[-1][0])
        assert segment_files(tmp_path, "outbox") == [segment_name("outbox", 8)]
    with Outbox(tmp_path, max_bytes=1 << 20, fsync="never") as outbox:
        assert outbox.empty and outbox.acked.seq == 10


def test_acknowledging_the_end_of_a_finished_segment_frees_it(tmp_path: Path) -> None:
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=36) as outbox:
        outbox.append([rec(i) for i in range(3)])  # segment 0, exactly full
        batch = outbox.peek(10)
        outbox.ack(batch[-1][0])  # the end of segment 0, still the one being written
        assert outbox.acked == Position(0, 36, 3)
        outbox.append([rec(3)])  # rotates to segment 3
        assert segment_files(tmp_path, "outbox") == [segment_name("outbox", s) for s in (0, 3)]
    # On reopening, the end of a finished segment is the start of the next one,
    # and the fully shipped segment is deleted at the next acknowledgement.
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=36) as outbox:
        assert outbox.acked == Position(3, 0, 0)
        assert [raw for _, raw in outbox.peek(10)] == [rec(3)]
        assert outbox.pending_bytes == 12
        outbox.ack(outbox.peek(1)[0][0])
        assert segment_files(tmp_path, "outbox") == [segment_name("outbox", 3)]

    # Within one run too: acknowledging the last record of a rotated-away
    # segment deletes it immediately.
    other = tmp_path / "other"
    with Outbox(other, max_bytes=1 << 20, segment_bytes=36) as outbox:
        outbox.append([rec(i) for i in range(3)])
        outbox.append([rec(3)])
        end_of_first = outbox.peek(3)[-1][0]
        assert end_of_first == Position(0, 36, 3)
        outbox.ack(end_of_first)
        assert outbox.acked == Position(3, 0, 0)
        assert segment_files(other, "outbox") == [segment_name("outbox", 3)]
        outbox.ack(end_of_first)  # again: nothing changes
        assert outbox.acked == Position(3, 0, 0)


def test_ack_rejects_a_cursor_that_did_not_come_from_peek(tmp_path: Path) -> None:
    shipped_outbox(tmp_path, n=10, acked=6)  # segments 6 (6, 7, 8) and 9 (9)
    cursor_file = tmp_path / "outbox.cursor"
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=36) as outbox:
        stored, acked = cursor_file.read_bytes(), outbox.acked
        with pytest.raises(ValueError, match=r"past the end of the outbox \(Position\("):
            outbox.ack(Position(9, 12, 2))  # a record that does not exist yet
        with pytest.raises(ValueError, match="past the end"):
            outbox.ack(Position(6, 500, 1))  # beyond the bytes of segment 6
        with pytest.raises(ValueError, match=r"Position\(segment=7.*names no segment"):
            outbox.ack(Position(7, 0, 0))  # no segment starts at 7
        assert outbox.acked == acked and cursor_file.read_bytes() == stored
        assert [raw for _, raw in outbox.peek(10)] == [rec(i) for i in range(6, 10)]
        assert outbox.peek(0) == [] and outbox.peek(-1) == []


@needs_proc
@pytest.mark.parametrize("policy", ["batch", "never"])
def test_ack_makes_the_records_durable_before_the_cursor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    outbox = Outbox(
        tmp_path,
        max_bytes=1 << 20,
        fsync=policy,  # type: ignore[arg-type]
        batch_interval=3600,
    )
    outbox.append([rec(0), rec(1)])  # group commit: not fsync'd yet
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + Path(fd_path(fd)).name)
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append("replace " + Path(dst).name)
        real_replace(src, dst)

    with monkeypatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        mp.setattr(os, "replace", replace)
        outbox.ack(outbox.peek(10)[-1][0])
    if policy == "batch":
        # Records, then the cursor's temporary file, then the rename, then the directory.
        assert events == [
            f"fsync {segment_name('outbox', 0)}",
            "fsync outbox.cursor.tmp",
            "replace outbox.cursor",
            f"fsync {tmp_path.name}",
        ]
    else:
        # "never" means never, until close: the cursor is rewritten in place.
        assert events == []
    outbox.close()
    with Outbox(tmp_path, max_bytes=1 << 20) as again:
        assert again.empty and again.acked == Position(0, 24, 2)


@needs_proc
def test_outbox_sync_covers_what_group_commit_has_not_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd_path(fd))
        real(fd)

    with (
        Outbox(tmp_path, max_bytes=1 << 20, fsync="batch", batch_interval=3600) as outbox,
        monkeypatch.context() as mp,
    ):
        mp.setattr(os, "fsync", fsync)
        outbox.append([rec(0)])
        outbox.append([rec(1)])
        assert calls == [] and outbox.log.unsynced_bytes == 24
        outbox.sync()
        assert calls == [str(tmp_path / segment_name("outbox", 0))]
        assert outbox.log.unsynced_bytes == 0
        outbox.sync()  # nothing new: no fsync
        assert len(calls) == 1


def test_an_empty_line_is_reported_once_and_still_shipped(tmp_path: Path) -> None:
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        outbox.append([rec(0)])
    (segment,) = tmp_path.glob("*.jsonl")
    with segment.open("ab") as f:
        f.write(b"\n")
    reports: list[tuple[Path, Position, bytes, str]] = []
    with Outbox(tmp_path, max_bytes=1 << 20, on_malformed=lambda *a: reports.append(a)) as outbox:
        outbox.append([rec(1)])
        for _ in range(2):
            assert [raw for _, raw in outbox.peek(10)] == [rec(0), b"", rec(1)]
        assert reports == [(segment, Position(0, 12, 1), b"", "empty line")]
        assert outbox.malformed == 1 and len(outbox) == 3


def test_a_finished_segment_whose_cut_was_undone_is_cut_again(tmp_path: Path) -> None:
    """A machine crash may undo the truncate that cut a rotated segment's zeroed
    tail: the writer that opens the outbox cuts it again, and nothing is lost."""
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=len(rec(0)) * 2 + 2) as outbox:
        for i in range(5):  # two records a segment
            outbox.log.append_line(rec(i))
    first = tmp_path / segment_name("outbox", 0)
    assert len(list(tmp_path.glob("*.jsonl"))) == 3
    clean = first.read_bytes()
    with first.open("ab") as f:
        f.write(bytes(8192))  # the preallocated tail is back
    with Outbox(tmp_path, max_bytes=1 << 20) as again:
        assert first.read_bytes() == clean
        assert [raw for _, raw in again.peek(10)] == [rec(i) for i in range(5)]
        assert again.pending_bytes == sum(len(rec(i)) + 1 for i in range(5))


KILLED_MID_COPY = """
import os, signal, sys
from mcp_budget_governor.producers.record_log import RecordLog
log = RecordLog(sys.argv[1], prefix="outbox", mapped=True)
for i in range(int(sys.argv[2])):
    log.append_line(('{"n":"%03d"}' % i).encode())
offset = log.end.offset
log._map[offset : offset + 8] = b'{"n":"to'  # killed in the middle of the next copy
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_mapped_writer_killed_mid_copy_loses_no_returned_record(tmp_path: Path) -> None:
    """SIGKILL of a mapped writer: every record whose append returned is in the
    file (the page cache has it), the half-copied one is a torn tail, and the
    preallocated zeros are no damage; the next writer continues on a clean line."""
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_COPY, str(tmp_path), "7"], capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (segment,) = tmp_path.glob("*.jsonl")
    assert segment.read_bytes().endswith(b"\0")  # left preallocated
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        assert [raw for _, raw in outbox.peek(10)] == [rec(i) for i in range(7)]
        outbox.log.append_line(rec(7))
        assert [raw for _, raw in outbox.peek(10)] == [rec(i) for i in range(8)]
    assert segment.read_bytes() == b"".join(rec(i) + b"\n" for i in range(8))
