"""The benchmarks' harness: a Redis to talk to, stats, tables, cleanup, CPU seconds.

The scripts of ``benchmarks/`` import it (``python -m benchmarks.<script>`` from the
repository root), as the tests import the services it starts them with.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import uuid
from collections.abc import Iterator, Sequence
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
