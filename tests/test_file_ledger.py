"""The embedded mode: a file ledger, projected into counters by a file projector."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    LimitExceeded,
    MemoryBackend,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.counters import AppliedEvent, ChargeResult, CounterOp, CounterState
from mcp_budget_governor.events import encode, parse
from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
from mcp_budget_governor.producers.memory_ledger import MemoryLedger


def policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=5, window=Window.MINUTE, scope=Scope.USER),
        Limit("daily", cap=40, window=Window.DAY, scope=Scope.USER),
        Limit(
            "spend", cap=usd(2), window=Window.DAY, unit=Unit.USD_MICROS, breaker=True, gated=False
        ),
    )


async def workload(gov: Governor, n: int, seed: int) -> dict[str, int]:
    """Checks (some refused), meters, and reservations settled, released or refused."""
    rng = random.Random(seed)
    done: dict[str, int] = defaultdict(int)
    for _ in range(n):
        ctx = Context(user=f"u{rng.randrange(4)}", tool=rng.choice(["search", "fetch"]))
        op = rng.random()
        if op < 0.55:
            d = await gov.check(ctx)
            done["admitted" if d.admitted else "rejected"] += 1
        elif op < 0.8:
            await gov.meter("spend", rng.randrange(1, 50_000), ctx)
            done["metered"] += 1
        else:
            try:
                async with gov.reserved("spend", 20_000, ctx) as r:
                    if rng.random() < 0.2:
                        r.release()
                        done["released"] += 1
                    else:
                        r.actual = rng.randrange(0, 40_000)
                        done["settled"] += 1
                done["reserved"] += 1
            except LimitExceeded:
                done["rejected"] += 1
    return done


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.jsonl"))


def append_bytes(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def lines(directory: Path) -> list[bytes]:
    out: list[bytes] = []
    for segment in segments(directory):
        data = segment.read_bytes()
        assert data.endswith(b"\n")
        out += data.splitlines()
    return out


async def test_projection_of_the_file_ledger_conserves_every_charge(
    backend: Backend, tmp_path: Path
) -> None:
    ledger = FileLedger(tmp_path, segment_bytes=16 * 1024, source="/mcpbg/test")
    gov = Governor(policy(), backend, ledger=ledger)
    projector = FileProjector(tmp_path, backend)

    # Projected while the ledger is still being written: a tailing reader.
    done = await workload(gov, 300, seed=1)
    first = await projector.catch_up()
    # One event per check, meter, reservation, settlement and release.
    assert first == sum(done.values())
    more = await workload(gov, 300, seed=2)
    await ledger.aclose()
    for k, v in more.items():
        done[k] += v

    raw = lines(tmp_path)
    assert len(segments(tmp_path)) > 3
    # Every line is a standalone JSON object and a valid event; ids are unique.
    assert all(isinstance(json.loads(line), dict) for line in raw)
    events = [parse(line) for line in raw]
    assert len({e.id for e in events}) == len(events)
    kinds: dict[str, int] = defaultdict(int)
    for e in events:
        kinds[e.type.split(".")[1]] += 1
    for kind in ("admitted", "rejected", "metered", "released", "settled"):
        assert kinds[kind] == done[kind], kind
    assert kinds["reserved"] == done["reserved"]
    assert all(not e.data.charges for e in events if e.type == "mcpbg.rejected.v1")

    assert first + await projector.catch_up() == len(events)
    assert projector.malformed == 0

    totals: dict[str, int] = defaultdict(int)
    for e in events:
        for c in e.data.charges:
            totals[c.key] += c.amount
    for key, total in totals.items():
        state = await backend.state(key)
        assert (state.committed, state.in_flight, state.pending) == (total, 0, {}), key

    # Idempotent and restartable: nothing is applied twice.
    assert await projector.catch_up() == 0
    assert await FileProjector(tmp_path, backend).catch_up() == 0
    # Even a projector that cannot read watermarks (it re-reads every record)
    # applies nothing twice: the backend's own guards hold.
    blind = NoWatermark(backend)
    assert await FileProjector(tmp_path, blind).catch_up() == 0
    assert blind.applied_calls >= len(segments(tmp_path))  # it did offer everything again
    for key, total in totals.items():
        assert (await backend.state(key)).committed == total


class NoWatermark:
    """A backend seen only through the Backend protocol (no ``watermark``)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.applied_calls = 0

    async def charge(
        self,
        ops: Sequence[CounterOp],
        *,
        event_id: str | None = None,
        want_used: bool = True,
        op_id: str | None = None,
    ) -> ChargeResult:
        return await self.inner.charge(ops, event_id=event_id, want_used=want_used, op_id=op_id)

    async def usage(self, keys: Sequence[str]) -> list[int]:
        return await self.inner.usage(keys)

    async def apply(self, partition: str, events: Sequence[AppliedEvent]) -> int:
        self.applied_calls += 1
        return await self.inner.apply(partition, events)

    async def state(self, key: str) -> CounterState:
        return await self.inner.state(key)

    async def aclose(self) -> None:
        return None


async def test_malformed_records_are_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = MemoryBackend()
    ledger = FileLedger(tmp_path)
    gov = Governor(policy(), backend, ledger=ledger)
    await gov.meter("spend", 1000, Context(user="a"))
    await ledger.aclose()
    (segment,) = segments(tmp_path)
    offset = segment.stat().st_size
    append_bytes(segment, b'not json\n{"specversion":"1.0","id":"nope"}\n')
    ledger = FileLedger(tmp_path)
    gov = Governor(policy(), backend, ledger=ledger)
    await gov.meter("spend", 500, Context(user="b"))
    await ledger.aclose()

    caplog.set_level(logging.WARNING)
    projector = FileProjector(tmp_path, backend)
    assert await projector.catch_up() == 2
    assert projector.malformed == 2
    assert f"{segment}: malformed event at byte {offset} (record 1)" in caplog.text
    assert f"{segment}: malformed event at byte {offset + 9} (record 2)" in caplog.text
    assert await gov.usage("spend") == 1500
    assert await projector.catch_up() == 0 and projector.malformed == 2


async def test_a_line_being_written_is_applied_once_complete(tmp_path: Path) -> None:
    """A tailing projector never consumes half a line: it waits for the newline."""
    source = MemoryLedger()
    emitter = Governor(policy(), MemoryBackend(), ledger=source)
    for user in ("a", "b", "c"):
        await emitter.meter("spend", 100, Context(user=user))
    raw = [encode(e, "/mcpbg/test") for e in source.entries]
    segment = tmp_path / "ledger-00000000000000000000.jsonl"
    append_bytes(segment, raw[0] + b"\n" + raw[1] + b"\n" + raw[2][:40])

    backend = MemoryBackend()
    projector = FileProjector(tmp_path, backend)
    assert await projector.catch_up() == 2
    append_bytes(segment, raw[2][40:] + b"\n")
    assert await projector.catch_up() == 1
    assert await Governor(policy(), backend).usage("spend") == 300


async def test_always_fsync_shares_one_fsync_among_concurrent_appends(tmp_path: Path) -> None:
    backend = MemoryBackend()
    ledger = FileLedger(tmp_path, fsync="always")
    gov = Governor(policy(), backend, ledger=ledger)
    await asyncio.gather(*(gov.meter("spend", 10, Context(user=f"u{i}")) for i in range(50)))
    assert ledger.log.unsynced_bytes == 0
    await ledger.aclose()
    assert len(lines(tmp_path)) == 50
    assert await FileProjector(tmp_path, backend).catch_up() == 50
    assert await gov.usage("spend") == 500


async def test_run_keeps_projecting_until_cancelled(tmp_path: Path) -> None:
    backend = MemoryBackend()
    ledger = FileLedger(tmp_path)
    gov = Governor(policy(), backend, ledger=ledger)
    projector = FileProjector(tmp_path, backend)
    task = asyncio.create_task(projector.run(poll_interval=0.01))
    for i in range(20):
        await gov.meter("spend", 5, Context(user=f"u{i % 3}"))
    for _ in range(200):
        if projector.applied == 20:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await ledger.aclose()
    assert projector.applied == 20
    state = await backend.state(_spend_key(tmp_path))
    assert (state.committed, state.in_flight) == (100, 0)


def _spend_key(directory: Path) -> str:
    keys = {c.key for line in lines(directory) for c in parse(line).data.charges}
    (key,) = keys
    return key


async def test_records_after_a_lost_tail_are_not_mistaken_for_applied_ones(
    tmp_path: Path,
) -> None:
    """A machine crash can take back the unsynced tail a projector already
    applied; what is written after the restart must still be applied."""
    backend = MemoryBackend()
    ledger = FileLedger(tmp_path)
    gov = Governor(policy(), backend, ledger=ledger)
    for i in range(5):
        await gov.meter("spend", 100, Context(user=f"u{i}"))
    projector = FileProjector(tmp_path, backend)
    assert await projector.catch_up() == 5
    await ledger.aclose()
    (segment,) = segments(tmp_path)
    keep = b"".join(line + b"\n" for line in lines(tmp_path)[:3])
    segment.write_bytes(keep)  # the last two records never reached the disk

    ledger = FileLedger(tmp_path)
    gov = Governor(policy(), backend, ledger=ledger)
    for i in range(2):
        await gov.meter("spend", 7, Context(user=f"v{i}"))
    await ledger.aclose()
    assert len(segments(tmp_path)) == 2
    assert await projector.catch_up() == 2
    assert await FileProjector(tmp_path, backend).catch_up() == 0
    assert await gov.usage("spend") == 514


FILE_CHILD = """
import asyncio, os, signal, sys
from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Scope, Window
from mcp_budget_governor.producers.file_ledger import FileLedger

folder, redis_url, report_path, point = sys.argv[1:5]
report = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

class Spy:
    def __init__(self, inner):
        self.inner = inner
    async def append(self, entry):
        await self.inner.append(entry)
        os.write(report, (entry.id + "\\n").encode())
    async def aclose(self):
        await self.inner.aclose()

async def main():
    # fsync="never": nothing reaches the disk before the kill but the write() itself.
    ledger = FileLedger(folder, fsync=sys.argv[5])
    policy = Policy.of(Limit("burst", cap=10**6, window=Window.MINUTE, scope=Scope.USER))
    gov = Governor(policy, RedisBackend.from_url(redis_url, timeout=5.0), ledger=Spy(ledger))
    for i in range(300):
        await gov.check(Context(user=f"u{i % 7}"))
    if point == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    # "unclosed": the script ends without closing; the ledger warns when collected

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "fsync"), [("kill", "never"), ("kill", "batch"), ("unclosed", "never")]
)
def test_killed_or_unclosed_process_loses_no_file_ledger_event(
    redis_url: str, tmp_path: Path, point: str, fsync: str
) -> None:
    """Every event whose append returned is in the files after SIGKILL (or an unclosed
    exit, which warns with the byte count), exactly once, through a real Redis."""
    import subprocess
    import sys

    folder, report = tmp_path / "ledger", tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-c", FILE_CHILD, str(folder), redis_url, str(report), point, fsync],
        capture_output=True,
        timeout=120,
        check=False,
    )
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == (-9 if point == "kill" else 0), stderr[-2000:]
    appended = report.read_text().split()
    assert len(appended) == 300
    if point == "unclosed":
        assert "garbage-collected unclosed with" in stderr and str(folder) in stderr, stderr
    ids = [json.loads(line)["id"] for f in sorted(folder.glob("*.jsonl")) for line in f.open()]
    assert sorted(ids) == sorted(appended)
