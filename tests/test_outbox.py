"""The durable outbox and the record log under it: order, acks, crashes, damage, a full disk."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mcp_budget_governor.producers.outbox import Outbox, OutboxFullError
from mcp_budget_governor.producers.record_log import (
    Position,
    RecordLog,
    RecordLogError,
    json_object,
    segment_name,
)


def rec(i: int) -> bytes:
    return json.dumps({"i": i, "pad": "x" * (i % 7)}, separators=(",", ":")).encode()


def numbers(batch: list[tuple[Position, bytes]]) -> list[int]:
    return [json.loads(raw)["i"] for _, raw in batch]


def segment_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.jsonl"))


def test_order_is_kept_across_segments_and_restarts(tmp_path: Path) -> None:
    n = 0
    for _ in range(5):
        with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=256) as outbox:
            for size in (1, 3, 7):
                outbox.append([rec(n + k) for k in range(size)])
                n += size
    assert len(segment_files(tmp_path)) > 3
    # Every segment is named by the sequence number of its first record.
    first = 0
    for name in segment_files(tmp_path):
        assert name == segment_name("outbox", first)
        first += (tmp_path / name).read_bytes().count(b"\n")
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=256) as outbox:
        assert len(outbox) == n
        assert numbers(outbox.peek(1000)) == list(range(n))
        assert numbers(outbox.peek(4)) == [0, 1, 2, 3]  # peek changes nothing


def test_ack_persists_across_reopen_and_deletes_shipped_segments(tmp_path: Path) -> None:
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=200) as outbox:
        outbox.append([rec(i) for i in range(60)])
        outbox.append([rec(i) for i in range(60, 100)])  # a second segment at least
        segments_before = segment_files(tmp_path)
        assert len(segments_before) >= 2
        shipped = outbox.peek(70)
        outbox.ack(shipped[-1][0])
        assert len(outbox) == 30
        outbox.ack(shipped[10][0])  # an older cursor: nothing changes
        assert len(outbox) == 30
        with pytest.raises(ValueError, match="past the end"):
            outbox.ack(Position(outbox.log.end.segment, 10**9, 0))
    assert len(segment_files(tmp_path)) < len(segments_before)
    assert segments_before[0] not in segment_files(tmp_path)

    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=200) as outbox:
        assert len(outbox) == 30
        assert numbers(outbox.peek(1000)) == list(range(70, 100))
        outbox.append([rec(100)])
        rest = outbox.peek(1000)
        assert numbers(rest) == list(range(70, 101))
        outbox.ack(rest[-1][0])
        assert outbox.empty and outbox.pending_bytes == 0 and outbox.peek(10) == []
        # Disk use is at most the acknowledged part of the segment being written.
        assert outbox.total_bytes <= 200
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=200) as outbox:
        assert outbox.empty
        outbox.append([rec(101)])
        assert numbers(outbox.peek(10)) == [101]


def test_numbering_continues_when_every_segment_was_shipped(tmp_path: Path) -> None:
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=64) as outbox:
        for i in range(20):
            outbox.append([rec(i)])
        outbox.ack(outbox.peek(100)[-1][0])
    # Even with every shipped segment gone, new records sort after the cursor.
    for name in segment_files(tmp_path):
        (tmp_path / name).unlink()
    with Outbox(tmp_path, max_bytes=1 << 20, segment_bytes=64) as outbox:
        assert outbox.empty
        outbox.append([rec(20)])
        assert numbers(outbox.peek(10)) == [20]
        assert outbox.acked.seq == 20


def test_torn_tail_is_tolerated_then_truncated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        outbox.append([rec(i) for i in range(3)])
    (segment,) = tmp_path.glob("*.jsonl")
    clean = segment.stat().st_size
    with segment.open("ab") as f:  # a crash in the middle of the next write
        f.write(b'{"i":3,"pad":"xx')

    # A reader sees the records before it. While the line may still be being
    # written it stays quiet; once the file has been still for a while, it warns,
    # naming file and offset.
    caplog.set_level(logging.WARNING)
    reader = RecordLog(tmp_path, prefix="outbox", writable=False)
    assert [r.data for r in reader.read()] == [rec(i) for i in range(3)]
    assert "torn" not in caplog.text
    past = time.time() - 60
    os.utime(segment, (past, past))
    assert [r.data for r in reader.read()] == [rec(i) for i in range(3)]
    assert f"{segment}: torn tail at byte {clean}" in caplog.text
    caplog.clear()

    # The writer cuts it away on open, so the next record starts on a clean line.
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        assert f"{segment}: torn tail at byte {clean}" in caplog.text
        # (the segment being written is preallocated: zeros past its records)
        assert len(segment.read_bytes().rstrip(b"\0")) == clean
        assert numbers(outbox.peek(10)) == [0, 1, 2]
        outbox.append([rec(3)])
        assert numbers(outbox.peek(10)) == [0, 1, 2, 3]
    # Closing cut the zeroed tail: a plain JSON Lines file again.
    assert segment.read_bytes().endswith(b"\n")
    assert all(json.loads(line) for line in segment.read_bytes().splitlines())


def test_torn_tail_of_an_older_segment_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with RecordLog(tmp_path, segment_bytes=40) as writer:
        for i in range(6):
            writer.append([rec(i)])
    first = tmp_path / segment_name("log", 0)
    size = first.stat().st_size
    with first.open("ab") as f:
        f.write(b'{"damaged')
    caplog.set_level(logging.WARNING)
    records = list(RecordLog(tmp_path, writable=False).read())
    assert [json.loads(r.data)["i"] for r in records] == list(range(6))
    assert f"{first}: torn tail at byte {size}" in caplog.text


WRITER = textwrap.dedent(
    """
    import os, sys, time
    from mcp_budget_governor.producers.outbox import Outbox

    outbox = Outbox(sys.argv[1], max_bytes=1 << 30, fsync="always", segment_bytes=4096)
    n, stop = 0, int(sys.argv[2])
    while True:
        batch = [b'{"i":%d,"pad":"%s"}' % (n + k, b"y" * ((n + k) % 50)) for k in range(1 + n % 3)]
        outbox.append(batch)  # returns after its fsync
        n += len(batch)
        print(n, flush=True)
        if stop and n >= stop:
            os.kill(os.getpid(), 9)
    """
)


def expected(n: int) -> list[bytes]:
    return [b'{"i":%d,"pad":"%s"}' % (i, b"y" * (i % 50)) for i in range(n)]


def reported(stdout: str) -> int:
    # The last line may itself be torn by the kill; only whole lines count.
    lines = [line for line in stdout.split("\n")[:-1] if line.strip()]
    return int(lines[-1]) if lines else 0


def test_sigkilled_writer_loses_nothing_it_reported(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, str(tmp_path), "400"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    n = reported(proc.stdout)
    assert n >= 400
    with Outbox(tmp_path, max_bytes=1 << 30) as outbox:
        assert [raw for _, raw in outbox.peek(10_000)] == expected(n)
        assert len(outbox) == n
        assert len(segment_files(tmp_path)) > 1


def test_writer_killed_at_a_random_moment(tmp_path: Path) -> None:
    """Killed from outside, mid-append: every reported record survives, in order,
    and at most the two batches it could not report follow them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < 300 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen = int(line)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        # The rest through the same buffered reader: readline may have read lines
        # ahead, which communicate() (raw reads of the pipe) would not see.
        out = proc.stdout.read()
        err = proc.stderr.read() if proc.stderr is not None else b""
        proc.wait(timeout=30)
    assert seen >= 300, err
    n = max(seen, reported(out.decode()))
    with Outbox(tmp_path, max_bytes=1 << 30) as outbox:
        got = [raw for _, raw in outbox.peek(100_000)]
    assert len(got) >= n
    assert got == expected(len(got))
    # Past the last whole report line, at most two batches of up to 3 records:
    # one whose report line the kill tore, and one written but not yet reported.
    assert len(got) - n <= 6


def test_malformed_middle_line_is_reported_with_its_position(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        outbox.append([rec(0), rec(1)])
    (segment,) = tmp_path.glob("*.jsonl")
    bad_offset = segment.stat().st_size
    with segment.open("ab") as f:
        f.write(b"\x00\x00garbage\n[1,2]\n")
    reports: list[tuple[Path, Position, bytes, str]] = []
    with Outbox(tmp_path, max_bytes=1 << 20, on_malformed=lambda *a: reports.append(a)) as outbox:
        outbox.append([rec(2)])
        batch = outbox.peek(10)
        assert [raw for _, raw in batch] == [rec(0), rec(1), b"\x00\x00garbage", b"[1,2]", rec(2)]
        outbox.peek(10)  # reported once, not at every peek
        assert outbox.malformed == 2
        assert [(p, pos) for p, pos, _, _ in reports] == [
            (segment, Position(0, bad_offset, 2)),
            (segment, Position(0, bad_offset + 10, 3)),
        ]
        assert "not a JSON object" in reports[1][3]
        outbox.ack(batch[-1][0])
        assert outbox.empty

    # The reader API flags them in place, with their positions; nothing raises.
    reader = RecordLog(tmp_path, prefix="outbox", writable=False)
    records = list(reader.read(validate=json_object))
    assert [(r.position.index, r.error is not None) for r in records] == [
        (0, False),
        (1, False),
        (2, True),
        (3, True),
        (4, False),
    ]

    # The default handler logs an ERROR naming file, byte offset and index.
    caplog.set_level(logging.ERROR)
    (tmp_path / "outbox.cursor").unlink()
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        outbox.peek(10)
    assert f"{segment}: malformed record at byte {bad_offset} (record 2" in caplog.text


def test_full_outbox_refuses_and_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    with Outbox(tmp_path, max_bytes=1000, segment_bytes=256) as outbox:
        accepted = 0
        while outbox.pending_bytes + len(rec(accepted)) + len(rec(accepted + 1)) + 2 <= 1000:
            outbox.append([rec(accepted), rec(accepted + 1)])
            accepted += 2
        with pytest.raises(OutboxFullError) as info:
            outbox.append([rec(accepted), rec(accepted + 1)])
        assert info.value.max_bytes == 1000 and info.value.pending_bytes <= 1000
        assert outbox.pending_bytes <= 1000
        with pytest.raises(OutboxFullError):
            outbox.append([rec(accepted)])
        # Nothing accepted was dropped, and no part of a refused batch was written.
        assert numbers(outbox.peek(1000)) == list(range(accepted))
        assert len(outbox) == accepted
        assert caplog.text.count("is full") == 1  # rate-limited
        # Shipping frees room.
        outbox.ack(outbox.peek(10)[-1][0])
        outbox.append([rec(accepted)])
    with Outbox(tmp_path, max_bytes=1000, segment_bytes=256) as outbox:
        assert numbers(outbox.peek(1000)) == list(range(10, accepted + 1))


def test_full_outbox_can_admit_and_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    with Outbox(tmp_path, max_bytes=500, on_full="admit", segment_bytes=256) as outbox:
        for i in range(100):
            outbox.append([rec(i)])
        assert outbox.pending_bytes > 500
        assert numbers(outbox.peek(1000)) == list(range(100))
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "admitting past the limit" in errors[0].getMessage()
    with Outbox(tmp_path, max_bytes=500, on_full="admit", full_log_interval=0.0) as outbox:
        outbox.append([rec(100)])
        outbox.append([rec(101)])
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 3


def test_one_writer_per_directory(tmp_path: Path) -> None:
    with Outbox(tmp_path, max_bytes=1000), pytest.raises(RecordLogError, match="another process"):
        Outbox(tmp_path, max_bytes=1000)
    with Outbox(tmp_path, max_bytes=1000) as outbox:  # released on close
        assert outbox.empty


def test_records_must_be_single_lines(tmp_path: Path) -> None:
    with Outbox(tmp_path, max_bytes=1000) as outbox:
        for bad in (b'{"a":\n1}', b""):
            with pytest.raises(ValueError, match="one non-empty line"):
                outbox.append([rec(0), bad])
        assert outbox.empty


def test_append_line_is_append_of_one_record(tmp_path: Path) -> None:
    """The outbox's hot path writes what append() of one record writes, rotates the
    same way, returns the cursor just past the record, and refuses the same lines."""
    with (
        RecordLog(tmp_path / "one", segment_bytes=64) as one,
        RecordLog(tmp_path / "batch", segment_bytes=64) as batch,
    ):
        for i in range(40):
            at = one.append_line(rec(i))
            batch.append([rec(i)])
            assert Position(*at) == one.end == batch.end
        for bad in (b'{"a":\n1}', b""):
            with pytest.raises(ValueError, match="one non-empty line"):
                one.append_line(bad)
        assert one.end == batch.end  # nothing written
    assert segment_files(tmp_path / "one") == segment_files(tmp_path / "batch")
    assert len(segment_files(tmp_path / "one")) > 3
    for name in segment_files(tmp_path / "one"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "batch" / name).read_bytes()


def test_a_lost_cursor_ships_again_rather_than_drop(tmp_path: Path) -> None:
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        outbox.append([rec(i) for i in range(5)])
        outbox.ack(outbox.peek(2)[-1][0])
    (tmp_path / "outbox.cursor").write_bytes(b"{not json")
    with Outbox(tmp_path, max_bytes=1 << 20) as outbox:
        assert numbers(outbox.peek(10)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("policy", ["always", "batch", "never"])
def test_every_fsync_policy_reads_back(tmp_path: Path, policy: str) -> None:
    with RecordLog(tmp_path, fsync=policy, segment_bytes=1024) as writer:  # type: ignore[arg-type]
        for i in range(50):
            writer.append([rec(i)])
        assert writer.total_bytes == sum(len(rec(i)) + 1 for i in range(50))
    assert [r.data for r in RecordLog(tmp_path, writable=False).read()] == [
        rec(i) for i in range(50)
    ]
