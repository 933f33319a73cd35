"""The benchmarks' harness: a Redis to talk to, stats, tables, cleanup, CPU seconds,
instruction counts (:func:`instructions_per_op`, valgrind's callgrind).

The scripts of ``benchmarks/`` import it (``python -m benchmarks.<script>`` from the
repository root), as the tests import the services it starts them with.
"""

from __future__ import annotations

import contextlib
import os
import platform
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from testing.services import start_redis

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Server:
    url: str
    origin: str  # "local (started by the benchmark)" or "--redis"


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[Server]:
    """Use ``url`` as given, or start a throwaway local redis-server and stop it at the end."""
    if url:
        yield Server(url, "--redis (not started or stopped by the benchmark)")
        return
    service = start_redis(prefer_local=True)
    try:
        yield Server(service.url, f"local redis-server started by the benchmark ({service.url})")
    finally:
        service.stop()


def noop(client: Any) -> Any:
    """``noop.lua`` (``return 1``) registered on ``client``: awaiting ``noop(client)()`` is
    one EVALSHA that does nothing, the baseline round trip. The benchmarks' own script:
    production backends do not load it."""
    return client.register_script((Path(__file__).parent / "noop.lua").read_text("utf-8"))


def run_id() -> str:
    """A short id that keeps this run's keys apart from anything else in the Redis."""
    return uuid.uuid4().hex[:8]


def cleanup(url: str, patterns: Sequence[str]) -> int:
    """Delete this run's keys (matters with ``--redis``, where the server is not ours)."""
    client = redis.Redis.from_url(url, socket_timeout=5.0)
    deleted = 0
    try:
        for pattern in patterns:
            batch: list[bytes] = []
            for key in client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += int(client.delete(*batch))
                    batch.clear()
            if batch:
                deleted += int(client.delete(*batch))
    finally:
        client.close()
    return deleted


def environment(url: str, origin: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    client = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        info = client.info("server")
    finally:
        client.close()
    from redis.utils import HIREDIS_AVAILABLE

    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "redis_server": info.get("redis_version"),
        "redis_origin": origin,
        "redis_py": redis.__version__,
        "hiredis": HIREDIS_AVAILABLE,
        "event_loop": "asyncio (default selector loop)",
    }


def loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """Plain aligned text: no dependency needed to read the results."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for cell, width, is_right in zip(cells, widths, right, strict=True):
            out.append(cell.rjust(width) if is_right else cell.ljust(width))
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process (all its threads) so far, from /proc."""
    if pid is None:
        return float("nan")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent by named processes (and this one) between start() and stop()."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.start_at: dict[str, float] = {}

    def start(self) -> None:
        self.start_at = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self.start_at["this process"] = time.process_time()

    def stop(self) -> dict[str, float]:
        used = {name: cpu_seconds(pid) - self.start_at[name] for name, pid in self.pids.items()}
        used["this process"] = time.process_time() - self.start_at["this process"]
        return used


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def naive_check(client: Any, policy: Any, ctx: Any, now: float) -> bool:
    """What the Lua script replaces, written the obvious way with redis-py.

    Per limit: GET, compare in Python; then, if every limit fits, INCRBY and
    EXPIRE per limit. Each command is its own awaited round trip (3 per
    limit), and other tasks run between the GET and the INCRBY, as in any
    async app. Keys come from the same planning code the governor uses, so
    the only difference from ``Governor.check`` is the Redis side.
    """
    from mcp_budget_governor import planning

    slots = planning.check_slots(policy, ctx, now)
    for s in slots:
        raw = await client.get(s.key)
        if int(raw or 0) + s.amount > s.limit.cap:
            return False
    for s in slots:
        await client.incrby(s.key, s.amount)
        await client.expire(s.key, s.expire_at - int(now))
    return True


#: Groups :func:`profile_summary` treats apart: time spent waiting, and builtins
#: (``isinstance``, ``len``...), whose time counts for the group of their caller.
IDLE = "idle"
BUILTINS = "builtins, caller unknown"


def profile_summary(
    stats: pstats.Stats,
    total_events: int,
    group_of: Callable[[str, str], str],
    top: int = 14,
) -> list[str]:
    """cProfile own time by layer (``group_of(filename, function)``), then the top functions."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    groups: dict[str, float] = {}
    total = idle = 0.0
    rows = []
    for (filename, line, name), (_cc, _nc, tt, _ct, callers) in raw.items():
        group = group_of(filename, name)
        if group == IDLE:
            idle += tt
            continue
        total += tt
        rows.append((tt, f"{short_path(filename)}:{line}({name})"))
        if filename == "~" and group == BUILTINS and callers:
            for (cfile, _cline, cname), caller_stats in callers.items():
                g = group_of(cfile, cname)
                groups[g] = groups.get(g, 0.0) + caller_stats[2]
            continue
        groups[group] = groups.get(group, 0.0) + tt
    out = [
        f"busy {total:.2f} s ({total * 1e6 / max(total_events, 1):.1f} us/event), "
        f"waiting (epoll, locks) {idle:.2f} s; shares of the busy time:"
    ]
    for group, tt in sorted(groups.items(), key=lambda x: -x[1]):
        if tt / total >= 0.01:
            out.append(f"  {tt / total * 100:5.1f}%  {group}")
    out.append("  top functions (own time):")
    for tt, where in sorted(rows, reverse=True)[:top]:
        out.append(f"  {tt / total * 100:5.1f}%  {where}")
    return out


def short_path(filename: str) -> str:
    """A profiled file's path without its site-packages, stdlib or repository prefix."""
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    stdlib = re.sub(r"^.*/lib/python3\.\d+/", "", filename)
    return stdlib if stdlib != filename else filename.replace(str(REPO) + "/", "")


# -- instruction counts ------------------------------------------------------------
#
# Wall-clock ratios on a shared machine move by more than the 2 % a hot-path target
# allows. valgrind's callgrind counts the instructions a process executes, which
# does not depend on the load: running the same workload with n and 2n operations
# and subtracting cancels start-up, imports and set-up, leaving n operations' worth.


def callgrind_available() -> bool:
    return shutil.which("valgrind") is not None


def callgrind_instructions(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path = REPO
) -> int:
    """Instructions (callgrind's ``Ir``) that the process ``argv`` executes, all its
    threads, not its children. ``PYTHONHASHSEED=0`` unless ``env`` sets it: the
    same dict layouts in every run. Raises ``RuntimeError`` with the tail of the
    output when the process fails."""
    if not callgrind_available():
        raise RuntimeError("valgrind is not installed (apt-get install valgrind)")
    environ = {**os.environ, **(env or {})}
    environ.setdefault("PYTHONHASHSEED", "0")
    with tempfile.TemporaryDirectory(prefix="mcpbg-callgrind-") as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
            "--trace-children=no", *argv,
        ]  # fmt: skip
        done = subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeError(f"{' '.join(argv)} failed under callgrind:\n{tail}")
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no instruction total in callgrind's output for {' '.join(argv)}")


def instructions_per_op(
    argv_for: Callable[[int], Sequence[str]], n: int, *, env: Mapping[str, str] | None = None
) -> float:
    """Instructions per operation: ``(I(argv_for(2n)) - I(argv_for(n))) / n``, where
    ``argv_for(k)`` is a command doing the same set-up then ``k`` operations."""
    once = callgrind_instructions(argv_for(n), env=env)
    twice = callgrind_instructions(argv_for(2 * n), env=env)
    return (twice - once) / n
