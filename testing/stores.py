"""The counters' store of a test, Redis or Postgres, read and tampered with directly.

The replay and reconcile suites run once per store (``store_url`` in
tests/conftest.py); these helpers read what a store holds (counters, watermarks,
seen ids, the epoch) and plant what an outage or a bug leaves behind (a lost
counter, a drifted amount, an orphaned in-flight entry), behind one signature,
by the store's own means (Redis commands, SQL), never through the code under test.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import redis as redis_sync

from mcp_budget_governor import PostgresBackend, RedisBackend
from mcp_budget_governor.caps import CAPS_PREFIX, GRANT_FIELD, PLANS_KEY
from mcp_budget_governor.keys import EPOCH_KEY, SEEN_PREFIX, WATERMARK_KEY
from testing.postgres import truncate_all


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql:", "postgres:"))


def backend_for(url: str, timeout: float = 5.0) -> Any:
    """A RedisBackend or PostgresBackend on ``url``."""
    if is_postgres(url):
        return PostgresBackend.from_url(url, timeout=timeout, max_connections=4)
    return RedisBackend.from_url(url, timeout=timeout)


def store_args(url: str) -> list[str]:
    """The CLI option naming the store."""
    return ["--postgres", url] if is_postgres(url) else ["--redis-url", url]


def _sql(url: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, params or None)
        return list(cur.fetchall()) if cur.description else []


def wipe(url: str) -> None:
    """The outage: the store comes back empty (Postgres keeps its schema)."""
    if is_postgres(url):
        truncate_all(url)
        return
    client = redis_sync.Redis.from_url(url)
    client.flushdb()  # the fixture's own database
    client.close()


def is_empty(url: str) -> bool:
    if is_postgres(url):
        return not _sql(
            url,
            "SELECT 1 FROM mcpbg_counter UNION ALL SELECT 1 FROM mcpbg_watermark "
            "UNION ALL SELECT 1 FROM mcpbg_seen UNION ALL SELECT 1 FROM mcpbg_meta LIMIT 1",
        )
    client = redis_sync.Redis.from_url(url)
    try:
        return int(client.dbsize()) == 0
    finally:
        client.close()


def live_counters(url: str) -> dict[str, tuple[int, int]]:
    """Every counter: committed and in-flight."""
    if is_postgres(url):
        rows = _sql(
            url,
            "SELECT key, committed, in_flight FROM mcpbg_counter "
            "WHERE expire_at > extract(epoch FROM clock_timestamp()) "
            "AND key NOT LIKE 'mcpbg:v1:\\_%'",
        )
        return {k: (int(c), int(f)) for k, c, f in rows}
    client = redis_sync.Redis.from_url(url)
    out = {}
    for raw in client.scan_iter(match="mcpbg:v1:[^_]*", count=1000):
        fields = client.hgetall(raw)
        out[raw.decode()] = (int(fields.get(b"c", 0)), int(fields.get(b"f", 0)))
    client.close()
    return out


def watermarks(url: str) -> dict[str, int]:
    if is_postgres(url):
        return {p: int(a) for p, a in _sql(url, "SELECT partition, applied FROM mcpbg_watermark")}
    client = redis_sync.Redis.from_url(url)
    marks = {k.decode(): int(v) for k, v in client.hgetall(WATERMARK_KEY).items()}
    client.close()
    return marks


def set_watermark(url: str, partition: str, offset: int) -> None:
    if is_postgres(url):
        _sql(
            url,
            "INSERT INTO mcpbg_watermark (partition, applied) VALUES (%s, %s) "
            "ON CONFLICT (partition) DO UPDATE SET applied = excluded.applied",
            (partition, offset),
        )
        return
    client = redis_sync.Redis.from_url(url)
    client.hset(WATERMARK_KEY, partition, offset)
    client.close()


def has_epoch(url: str) -> bool:
    if is_postgres(url):
        return bool(_sql(url, "SELECT 1 FROM mcpbg_meta WHERE name = 'epoch'"))
    client = redis_sync.Redis.from_url(url)
    try:
        return bool(client.exists(EPOCH_KEY))
    finally:
        client.close()


def seen_ids(url: str) -> tuple[set[str], bool]:
    """Every seen event id, and whether every seen set (row) expires in the future."""
    if is_postgres(url):
        rows = _sql(url, "SELECT event_id, expire_at FROM mcpbg_seen")
        return {r[0] for r in rows}, all(r[1] > time.time() for r in rows)
    client = redis_sync.Redis.from_url(url)
    seen: set[str] = set()
    alive = True
    for key in client.scan_iter(match=f"{SEEN_PREFIX}:*"):
        seen |= {m.decode() for m in client.smembers(key)}
        alive = alive and client.ttl(key) > 0
    client.close()
    return seen, alive


def add_committed(url: str, key: str, delta: int) -> None:
    if is_postgres(url):
        _sql(
            url, "UPDATE mcpbg_counter SET committed = committed + %s WHERE key = %s", (delta, key)
        )
        return
    client = redis_sync.Redis.from_url(url)
    client.hincrby(key, "c", delta)
    client.close()


def committed_of(url: str, key: str) -> tuple[int, bool]:
    """A counter's committed amount (0 when absent) and whether it has a future expiry."""
    if is_postgres(url):
        rows = _sql(url, "SELECT committed, expire_at FROM mcpbg_counter WHERE key = %s", (key,))
        if not rows:
            return 0, False
        return int(rows[0][0]), time.time() < float(rows[0][1]) < float("inf")
    client = redis_sync.Redis.from_url(url)
    try:
        return int(client.hget(key, "c") or 0), int(client.ttl(key)) > 0
    finally:
        client.close()


def drop_counter(url: str, key: str) -> None:
    if is_postgres(url):
        _sql(url, "DELETE FROM mcpbg_pending WHERE key = %s", (key,))
        _sql(url, "DELETE FROM mcpbg_counter WHERE key = %s", (key,))
        return
    client = redis_sync.Redis.from_url(url)
    client.delete(key)
    client.close()


def put_counter(url: str, key: str, committed: int, ttl: int = 3600) -> None:
    """A counter the ledger never made (committed, alive ``ttl`` seconds)."""
    if is_postgres(url):
        _sql(
            url,
            "INSERT INTO mcpbg_counter (key, committed, expire_at) VALUES "
            "(%s, %s, extract(epoch FROM clock_timestamp()) + %s)",
            (key, committed, ttl),
        )
        return
    client = redis_sync.Redis.from_url(url)
    client.hset(key, "c", committed)
    client.expire(key, ttl)
    client.close()


def put_in_flight(url: str, key: str, event_id: str, amount: int, ttl: int = 3600) -> None:
    """An in-flight entry under ``event_id`` (the counter made, alive ``ttl`` s, if absent)."""
    if is_postgres(url):
        _sql(
            url,
            "INSERT INTO mcpbg_counter AS t (key, in_flight, expire_at) VALUES "
            "(%s, %s, extract(epoch FROM clock_timestamp()) + %s) "
            "ON CONFLICT (key) DO UPDATE SET in_flight = t.in_flight + excluded.in_flight",
            (key, amount, ttl),
        )
        _sql(
            url,
            "INSERT INTO mcpbg_pending (key, event_id, amount) VALUES (%s, %s, %s)",
            (key, event_id, amount),
        )
        return
    client = redis_sync.Redis.from_url(url)
    fresh = not client.exists(key)
    client.hincrby(key, "f", amount)
    client.hincrby(key, f"e:{event_id}", amount)
    if fresh:
        client.expire(key, ttl)
    client.close()


def pending_of(url: str, key: str) -> tuple[dict[str, int], int]:
    """A counter's in-flight entries and its in-flight total."""
    if is_postgres(url):
        rows = _sql(url, "SELECT event_id, amount FROM mcpbg_pending WHERE key = %s", (key,))
        total = _sql(url, "SELECT in_flight FROM mcpbg_counter WHERE key = %s", (key,))
        return {e: int(a) for e, a in rows}, int(total[0][0]) if total else 0
    client = redis_sync.Redis.from_url(url)
    try:
        fields = {k.decode(): int(v) for k, v in client.hgetall(key).items()}
    finally:
        client.close()
    entries = {k[2:]: v for k, v in fields.items() if k.startswith("e:")}
    return entries, fields.get("f", 0)


def run_time_state(url: str) -> dict[str, Any]:
    """Every run-time value cap, plan assignment and counter grant (with its why), as the
    store keeps them (compared only with the same store's)."""
    if is_postgres(url):
        return {
            "caps": sorted(_sql(url, "SELECT caps_key, field, cap, until, why FROM mcpbg_cap")),
            "plans": sorted(_sql(url, "SELECT field, plan FROM mcpbg_plan")),
            "grants": sorted(
                _sql(
                    url,
                    "SELECT key, grant_amount, why FROM mcpbg_counter WHERE why IS NOT NULL "
                    "OR grant_amount <> 0",
                )
            ),
        }
    client = redis_sync.Redis.from_url(url, decode_responses=True)
    try:
        caps = {k: client.hgetall(k) for k in client.scan_iter(match=f"{CAPS_PREFIX}:*")}
        grants = {
            k: (client.hget(k, GRANT_FIELD), client.hget(k, "w"))
            for k in client.scan_iter(match="mcpbg:v1:[^_]*")
            if client.hexists(k, GRANT_FIELD)
        }
        return {"caps": caps, "plans": client.hgetall(PLANS_KEY), "grants": grants}
    finally:
        client.close()


def granted_keys(url: str) -> list[str]:
    """The counters holding a grant (a grant or a reset wrote them)."""
    if is_postgres(url):
        rows = _sql(url, "SELECT key FROM mcpbg_counter WHERE why IS NOT NULL ORDER BY key")
        return [r[0] for r in rows]
    return sorted(run_time_state(url)["grants"])


def set_cap_entry(url: str, caps_key: str, field: str, cap: int | None) -> None:
    """A caps entry written (``cap``, for good, no why) or, with None, deleted."""
    if is_postgres(url):
        if cap is None:
            _sql(url, "DELETE FROM mcpbg_cap WHERE caps_key = %s AND field = %s", (caps_key, field))
        else:
            _sql(
                url,
                "INSERT INTO mcpbg_cap (caps_key, field, cap, until) VALUES (%s, %s, %s, 0) "
                "ON CONFLICT (caps_key, field) DO UPDATE SET cap = excluded.cap",
                (caps_key, field, cap),
            )
        return
    client = redis_sync.Redis.from_url(url)
    if cap is None:
        client.hdel(caps_key, field)
    else:
        client.hset(caps_key, field, f"{cap} 0 -")
    client.close()


def set_plan_entry(url: str, field: str, plan: str | None) -> None:
    """A plan assignment written or, with None, deleted."""
    if is_postgres(url):
        if plan is None:
            _sql(url, "DELETE FROM mcpbg_plan WHERE field = %s", (field,))
        else:
            _sql(
                url,
                "INSERT INTO mcpbg_plan (field, plan) VALUES (%s, %s) "
                "ON CONFLICT (field) DO UPDATE SET plan = excluded.plan",
                (field, plan),
            )
        return
    client = redis_sync.Redis.from_url(url)
    if plan is None:
        client.hdel(PLANS_KEY, field)
    else:
        client.hset(PLANS_KEY, field, plan)
    client.close()


def set_grant(url: str, key: str, grant: int | None) -> None:
    """A counter's grant overwritten or, with None, deleted (the counter kept)."""
    if is_postgres(url):
        if grant is None:
            _sql(
                url, "UPDATE mcpbg_counter SET grant_amount = 0, why = NULL WHERE key = %s", (key,)
            )
        else:
            _sql(url, "UPDATE mcpbg_counter SET grant_amount = %s WHERE key = %s", (grant, key))
        return
    client = redis_sync.Redis.from_url(url)
    if grant is None:
        client.hdel(key, GRANT_FIELD)
    else:
        client.hset(key, GRANT_FIELD, grant)
    client.close()
