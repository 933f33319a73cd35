"""Rebuild of the Redis counters from 1,000,000 archived ledger events (``mcpbg replay``).

Side by side, in one run, on one Redis:

- **archive replay, current buckets** (``mcpbg replay``'s default): the
  outage case. A month of 1,000,000 events (``ledger_gen.write_archive``,
  the current month), replayed "at the month's last minute": every event is
  read, deduplicated and summed; the counters of the current minute, day and
  month are written, with the watermarks, the seen-id sets of the last two
  days and the epoch marker.
- **archive replay, ``--all`` worst case**: the same million events in a
  month that has not started yet, replayed at its first second, so every
  bucket is alive: ~500,000 counters and 1,000,000 seen ids are written.
- **baseline, the live projection's path**: the ``Projector`` (parse each
  CloudEvent record, then ``apply.lua``, batches of 500: what the worker and
  the Kafka rebuild do per record) over the first ``--baseline-events``
  events of the worst-case archive, rebuilt as JSON records from its rows,
  into an empty Redis. A Kafka replay also fetches every record, so this is
  a lower bound for it; the time for 1,000,000 is extrapolated from its rate
  (stated as such).

Every replay is checked: its counters are compared with the generator's own
per-key sums (computed with pyarrow, not DuckDB), so a fast wrong answer fails
the run (exit status 1).

    .venv/bin/python -m benchmarks.bench_replay                 # 1,000,000 events
    .venv/bin/python -m benchmarks.bench_replay --events 200000 --baseline-events 50000

A throwaway local ``redis-server`` is started and stopped (``testing/services.py``);
``--redis URL`` uses that server instead, which must be an empty database (it
is flushed between the scenarios).
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import redis

from mcp_budget_governor.projections.counters.rebuild import RebuildReport, rebuild_from_ledger
from mcp_budget_governor.projections.counters.redis import RedisBackend
from mcp_budget_governor.projections.ledger_view import open_ledger
from mcp_budget_governor.stream.projector import Projector
from testing.bench import environment, loadavg, progress, redis_server, table
from testing.ledger_gen import write_archive


def month_bounds(year: int, month: int) -> tuple[int, int]:
    start = int(datetime(year, month, 1, tzinfo=UTC).timestamp())
    return start, start + calendar.monthrange(year, month)[1] * 86_400


def check(client: redis.Redis, want: dict[str, int]) -> int:
    """Counters that differ from the generator's sums (0 when the replay is right)."""
    keys = list(want)
    bad = 0
    for i in range(0, len(keys), 5000):
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + 5000]:
            pipe.hget(key, "c")
        for key, value in zip(keys[i : i + 5000], pipe.execute(), strict=True):
            bad += int(value or 0) != want[key]
    return bad


def timed_replay(url: str, archive: Path, now: int, *, all_buckets: bool) -> RebuildReport:
    client = redis.Redis.from_url(url, socket_timeout=60)
    client.flushdb()
    phases: list[str] = []

    def report(phase: str, done: int, total: int | None) -> None:
        if phase not in phases:
            phases.append(phase)
            progress(f"  {phase}...")

    started = time.perf_counter()
    con = open_ledger(archive)
    result = rebuild_from_ledger(con, client, all_buckets=all_buckets, now=now, progress=report)
    result.seconds = time.perf_counter() - started  # opening the view included
    con.close()
    client.close()
    return result


def raw_events(archive: Path, events: int) -> dict[int, list[tuple[int, bytes]]]:
    """The first ``events`` events as the CloudEvent JSON records of their partitions,
    rebuilt from the archive rows (which hold everything an event carries)."""
    con = open_ledger(archive)
    rows = con.execute(
        f"""
        SELECT "partition", "offset", id, type, strftime("time", '%Y-%m-%dT%H:%M:%S.%fZ'),
               event_source, subject, "user", tenant, tool, "session", agent,
               list(struct_pack(l := "limit", u := unit, a := amount, w := "window",
                                b := bucket, k := "key", e := expire_at)
                    ORDER BY charge_index) FILTER (WHERE "key" IS NOT NULL),
               any_value(decision_limit), any_value(status), any_value("over"),
               any_value(degraded), any_value(model), any_value(input_tokens),
               any_value(output_tokens), any_value(cache_read_tokens),
               any_value(cache_write_tokens), any_value(price_version), any_value(reservation)
        FROM ledger GROUP BY ALL ORDER BY 5 LIMIT {int(events)}
        """
    ).fetchall()
    con.close()
    out: dict[int, list[tuple[int, bytes]]] = {}
    for (partition, offset, event_id, kind, when, source, subject, user, tenant, tool, session,
         agent, charges, limit, status, over, degraded, model, inp, outp, cread, cwrite,
         version, reservation) in rows:  # fmt: skip
        usage = None
        if model is not None:
            usage = {"model": model, "input_tokens": inp, "output_tokens": outp,
                     "cache_read_tokens": cread, "cache_write_tokens": cwrite,
                     "price_version": version}  # fmt: skip
        event = {
            "specversion": "1.0", "id": event_id, "source": source, "type": kind,
            "time": when, "subject": subject, "datacontenttype": "application/json",
            "data": {
                "context": {"user": user, "tenant": tenant, "tool": tool, "session": session,
                            "agent": agent},
                "charges": [
                    {"limit": c["l"], "unit": c["u"], "amount": c["a"], "window": c["w"],
                     "bucket": c["b"], "key": c["k"], "expire_at": c["e"]}
                    for c in charges or ()
                ],
                "decision": {"limit": limit, "status": status, "over": over or [],
                             "degraded": degraded},
                "usage": usage,
                "reservation": reservation,
            },
        }  # fmt: skip
        out.setdefault(partition, []).append((offset, orjson.dumps(event)))
    for records in out.values():
        records.sort()
    return out


async def baseline(url: str, records: dict[int, list[tuple[int, bytes]]]) -> float:
    """``Projector.apply_batch`` (parse + ``apply.lua``) over ``records``, batches of 500."""
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    backend = RedisBackend.from_url(url, timeout=60.0)
    projector = Projector(backend, "mcpbg.ledger", dlq=_dead)
    started = time.perf_counter()
    for partition, recs in sorted(records.items()):
        for i in range(0, len(recs), 500):
            await projector.apply_batch(partition, recs[i : i + 500])
    seconds = time.perf_counter() - started
    await backend.aclose()
    if projector.dead:
        raise SystemExit(f"baseline: {projector.dead} records were not valid events")
    return seconds


def _dead(letter: object) -> None:
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--baseline-events", type=int, default=100_000)
    parser.add_argument("--redis", help="an empty Redis database to use (flushed)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()

    today = datetime.now(UTC)
    nxt = (today.year + 1, 1) if today.month == 12 else (today.year, today.month + 1)
    current = f"{today.year:04d}-{today.month:02d}"
    future = f"{nxt[0]:04d}-{nxt[1]:02d}"
    _cur_start, cur_end = month_bounds(today.year, today.month)
    fut_start, _ = month_bounds(*nxt)

    with (
        tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp,
        redis_server(args.redis) as server,
    ):
        if args.redis and redis.Redis.from_url(server.url).dbsize():
            print(f"--redis {args.redis}: the database is not empty", file=sys.stderr)
            return 2
        results: dict[str, Any] = {"events": args.events, "environment": environment(
            server.url, server.origin)}  # fmt: skip
        progress(f"generating {args.events:,} events of {current} and of {future}...")
        gen_cur = write_archive(Path(tmp) / "current", args.events, seed=1, month=current,
                                keep_totals=True)  # fmt: skip
        gen_fut = write_archive(Path(tmp) / "future", args.events, seed=1, month=future,
                                keep_totals=True)  # fmt: skip
        progress(f"  {gen_cur.rows:,} rows in {gen_cur.files} files, {gen_cur.seconds:.1f} s each")

        rows = []
        bad = 0
        # "Now" = the month's last minute: its minute, day and month buckets are current.
        now_end = cur_end - 30
        progress(f"archive replay of {current}, current buckets, as of its last minute...")
        a = timed_replay(server.url, gen_cur.directory, now_end, all_buckets=False)
        want_a = {
            k: v
            for k, v in gen_cur.amount_by_key.items()
            if k.endswith((":" + time.strftime("%Y%m%d", time.gmtime(now_end)),
                           ":" + time.strftime("%Y%m", time.gmtime(now_end)),
                           ":" + time.strftime("%Y%m%dT%H%M", time.gmtime(now_end))))
        }  # fmt: skip
        client = redis.Redis.from_url(server.url)
        bad += check(client, want_a) + abs(a.counters - len(want_a))
        progress(f"worst case: archive replay of {future} with --all, as of its first second...")
        b = timed_replay(server.url, gen_fut.directory, fut_start + 1, all_buckets=True)
        bad += check(client, gen_fut.amount_by_key) + abs(b.counters - len(gen_fut.amount_by_key))
        client.close()
        progress(f"baseline: the Projector over the first {args.baseline_events:,} events...")
        records = raw_events(gen_fut.directory, args.baseline_events)
        n = sum(len(r) for r in records.values())
        secs = asyncio.run(baseline(server.url, records))
        rate = n / secs
        for label, r in (("archive replay, current buckets (default)", a),
                         ("archive replay, --all, every bucket alive", b)):  # fmt: skip
            rows.append([label, f"{r.events:,}", f"{r.counters:,}", f"{r.seen_ids:,}",
                         f"{r.seconds:.2f}", f"{r.events / r.seconds:,.0f}",
                         f"{(args.events / rate) / r.seconds:.1f}x"])  # fmt: skip
        rows.append([f"baseline: Projector, {n:,} events", f"{n:,}", "-", "-", f"{secs:.2f}",
                     f"{rate:,.0f}", "1.0x"])  # fmt: skip
        rows.append([f"  extrapolated to {args.events:,} events", f"{args.events:,}", "-", "-",
                     f"{args.events / rate:.1f}", f"{rate:,.0f}", "-"])  # fmt: skip
        print(table(["path", "events", "counters written", "seen ids", "seconds",
                     "events/s", "vs baseline"], rows,
                    [False, True, True, True, True, True, True]))  # fmt: skip
        print(f"\ncounters checked against the generator's sums: {bad if bad else 'all equal'}")
        print(f"load average at the end: {loadavg()}")
        results.update(
            current={"seconds": a.seconds, "counters": a.counters, "seen_ids": a.seen_ids},
            worst_case={"seconds": b.seconds, "counters": b.counters, "seen_ids": b.seen_ids},
            baseline={"events": n, "seconds": secs, "events_per_second": rate},
            mismatches=bad,
            loadavg=loadavg(),
        )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
