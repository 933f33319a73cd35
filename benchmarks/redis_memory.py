"""What Redis holds per counter and per applied event id, measured with ``MEMORY USAGE``.

A governor with a ledger charges 2,000 users (a calls limit and a spend limit
per user and day), the ``Projector`` applies the events, and each kind of key
is measured: a counter with an event in flight, the same counter once
projected, a seen-id set (per id, also over 200,000 UUIDv7 ids), the
watermark hash, an inline charge's operation marker. Then the figures at a
given rate (default 5,000 events/s):

    .venv/bin/python -m benchmarks.redis_memory [--rate 5000] [--redis URL]

Memory, not time: the numbers are the server's own accounting (``samples 0``:
every field counted), stable across runs of one Redis version.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import redis
import uuid_utils

from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Unit, Window, usd
from mcp_budget_governor.counters import CounterOp
from mcp_budget_governor.events import encode
from mcp_budget_governor.keys import OP_HORIZON_SECONDS, SEEN_PREFIX, WATERMARK_KEY, op_key
from mcp_budget_governor.ledger import new_id
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections.counters.redis import RedisBackend
from mcp_budget_governor.stream.projector import Projector
from testing.bench import redis_server

SECONDS_PER_DAY = 86_400


async def measure(url: str, rate: int) -> None:
    sync = redis.Redis.from_url(url)
    sync.flushdb()
    backend = RedisBackend.from_url(url, timeout=5.0)
    await backend.mark_ready("memory")
    ledger = MemoryLedger()
    policy = Policy.of(
        Limit("daily", cap=10**6, window=Window.DAY, scope=Scope.USER),
        Limit("spend", cap=usd(10**6), window=Window.DAY, unit=Unit.USD_MICROS,
              scope=Scope.USER, gated=False),
    )  # fmt: skip
    gov = Governor(policy, backend, ledger=ledger)
    for i in range(2000):
        ctx = Context(user=f"u_{i:06d}")
        await gov.check(ctx)
        await gov.meter("spend", 1234 + i, ctx)
    key = ledger.entries[0].charges[0].key
    in_flight = sync.memory_usage(key, samples=0)
    projector = Projector(backend, "memory.ledger", dlq=lambda letter: None, require_epoch=True)
    records = [(i, encode(e, "/memory")) for i, e in enumerate(ledger.entries)]
    for i in range(0, len(records), 500):
        await projector.apply_batch(0, records[i : i + 500])
    committed = sync.memory_usage(key, samples=0)
    (seen,) = list(sync.scan_iter(match=f"{SEEN_PREFIX}:*"))
    small = sync.memory_usage(seen, samples=0) / sync.scard(seen)
    big = f"{SEEN_PREFIX}:measure"
    pipe = sync.pipeline(transaction=False)
    for i in range(200_000):
        pipe.sadd(big, str(uuid_utils.uuid7()))
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    per_id = sync.memory_usage(big, samples=0) / sync.scard(big)
    sync.delete(big)
    print(f"Redis {sync.info()['redis_version']}")
    ttl = sync.ttl(key)
    print(f"counter {key!r} ({len(key)} chars): {in_flight} B with one event in flight, "
          f"{committed} B projected; TTL {ttl} s (the day's end + 1 h grace)")  # fmt: skip
    print(f"seen-id set {seen.decode()}: {small:.1f} B per id (4,000 ids), "
          f"{per_id:.1f} B per id (200,000 ids); TTL {sync.ttl(seen)} s")  # fmt: skip
    print(f"watermark hash (1 partition): {sync.memory_usage(WATERMARK_KEY, samples=0)} B")
    # Inline mode (no ledger): each charge leaves its operation marker for a while.
    op = new_id()
    ops = [CounterOp(key, 1, 10**6, True, int(time.time()) + 3600)]
    await backend.charge(ops, op_id=op)
    marker = sync.memory_usage(op_key(op), samples=0)
    horizon = sync.ttl(op_key(op))
    print(f"inline charge marker {op_key(op)}: {marker} B, TTL {horizon} s; at {rate:,} "
          f"charges/s: {rate * OP_HORIZON_SECONDS * marker / 2**30:.2f} GiB")  # fmt: skip
    day = rate * SECONDS_PER_DAY
    gib = day * per_id / 2**30
    print(f"at {rate:,} events/s: {day:,} event ids a UTC day, {gib:.1f} GiB; the sets "
          f"of today and yesterday are kept: up to {2 * gib:.1f} GiB")  # fmt: skip
    await backend.aclose()
    sync.flushdb()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=5000, help="events per second")
    parser.add_argument("--redis", help="an empty Redis database to use (flushed!)")
    args = parser.parse_args()
    with redis_server(args.redis) as server:
        asyncio.run(measure(server.url, args.rate))


if __name__ == "__main__":
    main()
