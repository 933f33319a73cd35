"""Cross-language ledger: TypeScript writes, the Python worker projects, each event once.

A Node process (``ts/test/ledgerDriver.ts`` under tsx) appends ledger entries through
the TypeScript ``KafkaLedger``; it is SIGKILLed mid-way at several points and
restarted on the same outbox folder each time; then ``mcpbg worker`` projects the
topic into Redis and archives it, and every entry must be counted exactly once in the
counters and in the ledger view. The outbox folder format is shared: either language
drains what the other wrote, and the writer lock excludes the other language too.
Needs Node 20+ (skipped with the reason otherwise) and ``ts/node_modules`` (``npm ci``
is run once when it is missing).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mcp_budget_governor import Governor
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import partition_key, partition_of
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.producers.outbox import Outbox
from mcp_budget_governor.producers.record_log import RecordLogError
from testing.services import free_port
from testing.stream_support import (
    PARTITIONS,
    Stream,
    assert_exact,
    backend,
    charge_totals,
    engine,
    kafka,
    names,
    policy,
    stream,
    unique_events,
    workers,
    workload,
)

__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name

REPO = Path(__file__).resolve().parent.parent
TS = REPO / "ts"
DRIVER = "test/ledgerDriver.ts"


def _node_problem() -> str | None:
    node = shutil.which("node")
    if node is None:
        return "node is not on the PATH (the TypeScript sibling needs Node 20+)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    try:
        major = int(version.lstrip("v").split(".")[0])
    except ValueError:
        return f"node --version said {version!r}; the TypeScript sibling needs Node 20+"
    return None if major >= 20 else f"node {version} is too old: the TypeScript sibling needs 20+"


pytestmark = pytest.mark.skipif(_node_problem() is not None, reason=str(_node_problem()))


@pytest.fixture(scope="module")
def tsx() -> list[str]:
    """The command that runs the driver (``npm ci`` first if the packages are missing):
    node itself with tsx's loader, one process, so a SIGKILL hits the process that
    appends (the ``tsx`` command would run it in a child)."""
    if not (TS / "node_modules" / "tsx").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=TS, check=True)
    node = shutil.which("node")
    assert node is not None
    return [node, "--import", "tsx", DRIVER]


def _to_ts() -> Any:
    spec = importlib.util.spec_from_file_location(
        "conformance_events", REPO / "conformance" / "events.py"
    )
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.to_ts


async def read_raw(bootstrap: str, topic: str) -> list[tuple[int, bytes, bytes]]:
    """Every record of the topic as (partition, key, value), read to the highwater marks."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]  # as the driver made it
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        out: list[tuple[int, bytes, bytes]] = []
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(*parts, timeout_ms=500)
            got = [r for records in batch.values() for r in records]
            idle = 0 if got else idle + 1
            out += [(r.partition, r.key or b"", r.value or b"") for r in got]
        return out
    finally:
        await consumer.stop()


def _open_outbox(folder: Path, within: float = 10.0) -> Outbox:
    """The outbox a killed driver left: its lock is dropped a moment after the kill (the
    ``flock`` child that held it sees its standard input close and exits)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return Outbox(folder, max_bytes=1 << 30)
        except RecordLogError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Driver:
    """One driver process; ``lines`` are what it printed so far."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            argv, cwd=TS, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log, env=env
        )
        self.lines: list[str] = []

    def until(self, predicate: Any, within: float = 120.0) -> None:
        """Read lines until ``predicate(line)`` holds (or the process ends)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            raw = self.proc.stdout.readline()
            if not raw:
                return
            line = raw.decode().strip()
            self.lines.append(line)
            if predicate(line):
                return
        pytest.fail(f"driver: no matching line within {within}s; last: {self.lines[-3:]}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def finish(self, within: float = 120.0) -> int:
        self.until(lambda _: False, within)
        code = self.proc.wait(within)
        self.log.close()
        return code

    @property
    def last_appended(self) -> int:
        done = [int(line.split()[1]) for line in self.lines if line.startswith("appended ")]
        return done[-1] if done else -1


@pytest.mark.slow
async def test_typescript_events_are_projected_exactly_once(stream: Stream, tsx: list[str]) -> None:
    # Entries a governor made on the real Redis (in-flight amounts there), captured in
    # memory; the TypeScript ledger ships them, the worker moves them to committed.
    captured = MemoryLedger()
    gov = Governor(policy(), stream.backend, ledger=captured)
    await workload(gov, 240, random.Random(13))
    entries = captured.entries
    n = len(entries)
    to_ts = _to_ts()
    file = stream.tmp_path / "entries.json"
    file.write_text(json.dumps([to_ts(e) for e in entries]), encoding="utf-8")
    outbox = stream.tmp_path / "ts-outbox"

    def driver(start: int, stop: int, run: int, kill_at: str = "") -> Driver:
        argv = [*tsx, "kafka", stream.kafka.bootstrap, stream.topic, str(outbox), str(file),
                str(start), str(stop), "7"]  # fmt: skip
        env = {**os.environ, "MCPBG_TS_KILL_AT": kill_at}
        return Driver(argv, stream.tmp_path / f"driver-{run}.log", env)

    # The folder starts with a Python KafkaLedger's leftovers (written while its broker
    # was unreachable): the TypeScript ledger ships them first, in the same format.
    python_part = 20
    dead = KafkaLedger(f"127.0.0.1:{free_port()}", topic=stream.topic, outbox_dir=outbox,
                       request_timeout=0.3, retry_interval=0.1)  # fmt: skip
    for entry in entries[:python_part]:
        await dead.append(entry)
    await dead.aclose(within=0.2)
    assert dead.unshipped == python_part

    # Six SIGKILLs. Three from outside, after the appends at about 20, 50 and 80 %;
    # three inside the shipper (ledgerDriver.ts' MCPBG_TS_KILL_AT): about to send its
    # 3rd batch, after the broker acknowledged its 2nd (the cursor not yet written: that
    # batch is sent again), right after its 2nd cursor was written. Each restart resumes
    # after the last append the killed run reported (one it may have appended unreported
    # is appended again: the same id, counted once).
    assert n >= 250, n
    stages = [("", n * 2 // 10), ("before_send:3", 40), ("", n * 5 // 10),
              ("after_send:2", 40), ("", n * 8 // 10), ("after_ack:2", 25)]  # fmt: skip
    start, kills = python_part, []
    for run, (kill_at, point) in enumerate(stages):
        if kill_at:  # appends `point` entries; dies in the shipper
            d = driver(start, start + point, run, kill_at)
            code = d.finish()
            assert code == -signal.SIGKILL, (kill_at, code, d.lines[-3:])
        else:
            d = driver(start, n, run)
            d.until(lambda line, p=point: line == f"appended {p}")
            d.kill()
        with _open_outbox(outbox) as left:  # what the restart must ship
            kills.append((kill_at or "outside", d.last_appended, len(left)))
        start = d.last_appended + 1
    last = driver(start, n, len(stages))
    code = last.finish()
    log = (stream.tmp_path / f"driver-{len(stages)}.log").read_text(errors="replace")
    assert code == 0, log
    assert last.lines[-1] == "closed 0", (last.lines[-3:], log)

    archive = stream.tmp_path / "archive"
    stream.start_worker("--archive-dir", str(archive))
    records = await stream.caught_up()
    events = unique_events(records)
    assert sorted(e.id for e in events) == sorted(e.id for e in entries)
    # Keyed and partitioned as the Python ledger keys them, with Python's exact bytes.
    by_id = {e.id: e for e in entries}
    raw = await read_raw(stream.kafka.bootstrap, stream.topic)
    assert len(raw) == len(records)
    for partition, key, value in raw:
        entry = by_id[json.loads(value)["id"]]
        assert key == partition_key(entry.context.tenant, entry.context.user)
        assert partition == partition_of(key, PARTITIONS)
        assert value == encode(entry, json.loads(value)["source"])
    # Exactly once in Redis: every counter is the sum of the entries' charges, nothing
    # left in flight (the charges as made by the governor, not as read back).
    expected = Counter[str]()
    for entry in entries:
        for charge in entry.charges:
            expected[charge.key] += charge.amount
    assert charge_totals(events) == dict(expected)
    assert await assert_exact(stream.backend, records) == n
    duplicates = len(records) - n
    # At most one batch (25) re-sent per kill, plus the one unreported append each; the
    # kill after the broker's acknowledgement re-sends its batch for certain.
    assert 1 <= duplicates <= len(kills) * 26, f"{duplicates} re-sent records for kills {kills}"
    print(
        f"{n} entries; killed after appends (last reported, left unshipped): {kills}; "
        f"{duplicates} records re-sent"
    )

    # And in the ledger view over the worker's archive: each event once.
    from mcp_budget_governor.projections.ledger_view import open_ledger

    deadline = time.monotonic() + 30
    while True:
        con = open_ledger(archive_dir=archive)
        try:
            ((ids,),) = con.sql("SELECT count(DISTINCT id) FROM ledger").fetchall()
            sums = dict(
                con.sql(
                    "SELECT key, sum(amount) FROM ledger WHERE key IS NOT NULL GROUP BY key"
                ).fetchall()
            )
        finally:
            con.close()
        if ids == n or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert ids == n
    assert sums == dict(expected)


def _lines(count: int, tag: str) -> list[str]:
    return [json.dumps({"id": f"{tag}{i}", "pad": "x" * 200}) for i in range(count)]


@pytest.mark.slow
def test_outbox_folders_drain_in_either_language(tmp_path: Path, tsx: list[str]) -> None:
    """TypeScript appends (and is SIGKILLed), Python reads it all, acknowledges part and
    appends; TypeScript drains the rest in order; and the other way round."""
    box = tmp_path / "box"
    ts_lines = _lines(60, "ts")
    (tmp_path / "lines.json").write_text(json.dumps(ts_lines))
    argv = [*tsx, "outbox-append", str(box), str(tmp_path / "lines.json"), "kill"]
    proc = subprocess.run(argv, cwd=TS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(list(box.glob("outbox-*.jsonl"))) > 1  # several segments (4 KiB each)

    with _open_outbox(box) as outbox:
        batch = outbox.peek(1000)
        assert [raw.decode() for _, raw in batch] == ts_lines
        outbox.ack(batch[39][0])  # shipped 40: the segments they fill are deleted
        outbox.append([line.encode() for line in _lines(5, "py")])

    drain = [*tsx, "outbox-drain", str(box), "10"]
    proc = subprocess.run(drain, cwd=TS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rest = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rest == ts_lines[40:] + _lines(5, "py")

    with Outbox(box, max_bytes=1 << 20) as outbox:  # TypeScript's cursor, read by Python
        assert [raw.decode() for _, raw in outbox.peek(1000)] == rest[10:]


@pytest.mark.slow
def test_one_writer_per_outbox_across_languages(tmp_path: Path, tsx: list[str]) -> None:
    """The writer lock is the same kernel lock: neither language opens a folder the other
    is writing."""
    box = tmp_path / "box"
    with Outbox(box, max_bytes=1 << 20):
        proc = subprocess.run([*tsx, "outbox-hold", str(box)], cwd=TS, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 1
        assert "another process is writing this log" in proc.stderr
    hold = subprocess.Popen([*tsx, "outbox-hold", str(box)], cwd=TS, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert hold.stdout is not None and hold.stdout.readline().strip() == b"locked"
        with pytest.raises(RecordLogError, match="another process is writing this log"):
            Outbox(box, max_bytes=1 << 20)
    finally:
        assert hold.stdin is not None
        hold.stdin.close()
        assert hold.wait(60) == 0
    with Outbox(box, max_bytes=1 << 20):  # released
        pass
