"""``mcpbg replay``: counters rebuilt from the ledger equal the live ones, and the live
projection resumes after a replay counting nothing twice (real Redis and real Postgres,
``store_url``; real Kafka and the real worker for ``--source kafka``)."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis as redis_sync

from mcp_budget_governor import Governor, RedisBackend
from mcp_budget_governor.events import parse
from mcp_budget_governor.keys import EPOCH_KEY, WATERMARK_KEY
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
from mcp_budget_governor.projections.counters.sync import (
    ConcurrentProjectionError,
    redis_client,
    write_counters,
)
from mcp_budget_governor.stream.archiver import Archiver
from mcp_budget_governor.stream.projector import Projector
from testing.ledger_run import (
    TOPIC,
    extend,
    live_counters,
    mixed_run,
    policy,
    run_cli,
    watermarks,
    workload,
)
from testing.postgres import scratch_database
from testing.stores import (
    add_committed,
    backend_for,
    has_epoch,
    is_empty,
    is_postgres,
    seen_ids,
    set_watermark,
    store_args,
    wipe,
)


def flush(url: str) -> None:
    wipe(url)


def replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "replay", *argv)


@pytest.mark.parametrize("outage", ["wiped", "corrupted"])
async def test_archive_replay_equals_the_live_counters(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], outage: str
) -> None:
    run = await mixed_run(store_url, tmp_path)
    live, marks = live_counters(store_url), watermarks(store_url)
    assert live and all(f == 0 for _, f in live.values())
    assert {k: c for k, (c, _) in live.items()} == run.totals()  # the projector is exact
    if outage == "wiped":
        flush(store_url)
    else:  # counters that drifted, one lost: the replay sets them, the rest stay
        for i, key in enumerate(sorted(live)[:5]):
            add_committed(store_url, key, 1000 + i)

    code, out, _ = replay(capsys, "--all", "--archive-dir", str(run.archive),
                          *store_args(store_url))  # fmt: skip
    assert code == 0, out
    assert live_counters(store_url) == live
    assert watermarks(store_url) == marks
    assert has_epoch(store_url)
    seen, alive = seen_ids(store_url)
    assert seen == set(run.ids) and alive
    assert "replay from archive" in out and f"{TOPIC}:0" in out


async def test_default_replays_the_current_buckets_only(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(store_url, tmp_path)  # events spread over the last 3 minutes
    live = live_counters(store_url)
    flush(store_url)
    code, out, _ = replay(capsys, "--archive-dir", str(run.archive), *store_args(store_url))
    assert code == 0, out
    rebuilt = live_counters(store_url)
    left_out = set(live) - set(rebuilt)
    assert left_out, "the workload should span more than one minute bucket"
    import time

    current_minute = time.strftime("%Y%m%dT%H%M", time.gmtime())
    for key in left_out:  # only ended minute buckets, still alive in their grace hour
        assert key.startswith("mcpbg:v1:burst:") and key.rsplit(":", 1)[1] < current_minute
    assert {k: live[k] for k in rebuilt} == rebuilt


async def test_dry_run_lists_the_changes_and_writes_nothing(
    store_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = await mixed_run(store_url, tmp_path)
    some_key = next(iter(run.totals()))
    flush(store_url)
    # Settings from the worker's environment variables.
    monkeypatch.setenv("MCPBG_ARCHIVE_DIR", str(run.archive))
    monkeypatch.delenv("MCPBG_REDIS_URL", raising=False)
    monkeypatch.delenv("MCPBG_POSTGRES_URL", raising=False)
    env = "MCPBG_POSTGRES_URL" if is_postgres(store_url) else "MCPBG_REDIS_URL"
    monkeypatch.setenv(env, store_url)
    code, out, _ = replay(capsys, "--all", "--dry-run", "--show", "1000")
    assert code == 0
    assert "dry run: nothing written" in out and some_key in out
    assert is_empty(store_url)


async def test_live_projection_resumes_after_a_replay_counting_nothing_twice(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(store_url, tmp_path)
    flush(store_url)  # the outage: the store restarted empty
    code, out, _ = replay(capsys, "--all", "--archive-dir", str(run.archive),
                          *store_args(store_url))  # fmt: skip
    assert code == 0, out
    new = await extend(store_url, run, 150, seed=5)
    # A producer retry of an event the replay counted, at a new offset.
    p0 = min(run.partitions)
    old = run.partitions[p0][3][1]
    run.partitions[p0].append((len(run.partitions[p0]), old))
    new[p0].append(run.partitions[p0][-1])

    backend = backend_for(store_url)
    projector = Projector(backend, TOPIC, dlq=lambda letter: None, require_epoch=True)
    for p, records in sorted(new.items()):
        # Redelivered from before the replay's watermark, as a consumer group may.
        first_new = records[0][0]
        overlap = [r for r in run.partitions[p] if first_new - 25 <= r[0] < first_new]
        await projector.apply_batch(p, overlap + records)
    await backend.aclose()

    rebuilt = live_counters(store_url)
    assert {k: c for k, (c, _) in rebuilt.items() if c or k in run.totals()} == run.totals()
    assert all(f == 0 for _, f in rebuilt.values()), "something was left in flight"


@pytest.mark.parametrize("buckets", [["--all"], []], ids=["all", "current"])
async def test_replay_over_a_live_store_moves_the_in_flight_of_archived_events(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], buckets: list[str]
) -> None:
    """The worker archives a batch, then dies before applying it: the archive has events
    Redis holds in flight. Replay commits them and drops those in-flight entries (the live
    projector, resuming after the new watermark, will never move them), also on counters of
    ended buckets a default replay leaves otherwise alone; the newer events' in-flight
    entries stay for the projector."""
    redis_url = store_url
    run = await mixed_run(redis_url, tmp_path)
    # Over three minute buckets, by users with room left in them.
    archived = await extend(redis_url, run, 60, seed=8, back=150, users="v")
    unarchived = await extend(redis_url, run, 40, seed=9)
    archiver = Archiver(run.archive, topic=TOPIC)
    for p, records in archived.items():
        archiver.write_batch(p, [(o, parse(raw)) for o, raw in records])
    code, out, _ = replay(
        capsys, *buckets, "--archive-dir", str(run.archive), *store_args(redis_url)
    )
    assert code == 0, out
    minutes = {
        c.key
        for records in archived.values()
        for _, raw in records
        for c in parse(raw).data.charges
        if c.key.startswith("mcpbg:v1:burst:")
    }
    assert len({k.rsplit(":", 1)[1] for k in minutes}) > 1  # ended minute buckets too
    upto = {p: records[-1][0] for p, records in archived.items()}
    for p in run.partitions:
        upto.setdefault(
            p,
            max(
                o
                for o, _ in run.partitions[p]
                if o < min([r[0] for r in unarchived.get(p, [])] or [10**9])
            ),
        )
    assert watermarks(redis_url) == {f"{TOPIC}:{p}": o for p, o in upto.items()}

    backend = backend_for(redis_url)
    in_flight_ids = set()
    for key in live_counters(redis_url):
        in_flight_ids |= set((await backend.state(key)).pending)
    want_pending = {parse(raw).id for records in unarchived.values() for _, raw in records}
    assert in_flight_ids <= want_pending and in_flight_ids
    # The worker comes back: it redelivers the archived batch (skipped) and goes on.
    projector = Projector(backend, TOPIC, dlq=lambda letter: None)
    for p in sorted(run.partitions):
        batch = archived.get(p, []) + unarchived.get(p, [])
        if batch:
            await projector.apply_batch(p, batch)
    await backend.aclose()
    counters = live_counters(redis_url)
    assert {k: c for k, (c, _) in counters.items() if k in run.totals()} == run.totals()
    assert all(f == 0 for _, f in counters.values())


async def test_file_ledger_replay_equals_the_file_projector(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    redis_url = store_url
    backend = backend_for(redis_url)
    folder = tmp_path / "ledger"
    gov = Governor(
        policy(), backend, ledger=FileLedger(folder, fsync="never"), prices=PriceTable.builtin()
    )
    await workload(gov, 200, random.Random(4))
    await gov.ledger.aclose()  # type: ignore[union-attr]
    projector = FileProjector(folder, backend)
    assert await projector.catch_up() > 0
    await backend.aclose()
    live, marks = live_counters(redis_url), watermarks(redis_url)
    flush(redis_url)
    code, out, _ = replay(
        capsys, "--source", "file", "--all", "--ledger-dir", str(folder), *store_args(redis_url)
    )
    assert code == 0, out
    assert live_counters(redis_url) == live
    assert watermarks(redis_url) == marks and all(k.startswith("file:") for k in marks)


async def test_replay_refuses_when_the_store_is_ahead_of_the_archive(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(store_url, tmp_path)
    set_watermark(store_url, f"{TOPIC}:0", 10**6)
    before = live_counters(store_url)
    code, _, err = replay(capsys, "--all", "--archive-dir", str(run.archive),
                          *store_args(store_url))  # fmt: skip
    assert code == 2
    assert err.count("\n") == 1 and f"partition {TOPIC}:0" in err and "ledger ends at" in err
    assert live_counters(store_url) == before and has_epoch(store_url)


def test_a_projector_moving_meanwhile_makes_the_write_refuse(redis_url: str) -> None:
    client = redis_client(redis_url)
    client.hset(WATERMARK_KEY, "t:0", 5)
    with pytest.raises(ConcurrentProjectionError):
        write_counters(client, [("mcpbg:v1:x:global:20261129", 7, 2**40)], watermarks={"t:0": 4})
    assert not client.exists("mcpbg:v1:x:global:20261129")
    write_counters(client, [("mcpbg:v1:x:global:20261129", 7, 2**40)], watermarks={"t:0": 5})
    assert client.hget("mcpbg:v1:x:global:20261129", "c") == b"7"
    client.close()


def test_a_projector_moving_meanwhile_makes_the_postgres_write_refuse(postgres_url: str) -> None:
    from mcp_budget_governor.projections.counters.pg_sync import PostgresStore

    asyncio.run(_migrated(postgres_url))
    set_watermark(postgres_url, "t:0", 5)
    store = PostgresStore.connect(postgres_url)
    try:
        key = "mcpbg:v1:x:global:20261129"
        with pytest.raises(ConcurrentProjectionError):
            store.rewrite([(key, 7, 2**40)], expected={"t:0": 4}, epoch="e1")
        assert key not in live_counters(postgres_url) and not has_epoch(postgres_url)
        store.rewrite([(key, 7, 2**40)], expected={"t:0": 5})
        assert live_counters(postgres_url)[key] == (7, 0)
    finally:
        store.close()


async def _migrated(url: str) -> None:
    backend = backend_for(url)
    await backend.migrate()
    await backend.aclose()


async def test_postgres_replay_is_one_transaction(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the replay commits, another session sees the store as it was (here: wiped,
    no epoch) and the store lock is held exclusive, so no charge writes in between;
    after it, everything at once."""
    from mcp_budget_governor.projections.counters import rebuild
    from mcp_budget_governor.projections.counters.pg_sync import PostgresStore
    from mcp_budget_governor.projections.ledger_view import open_ledger

    run = await mixed_run(postgres_url, tmp_path)
    live = live_counters(postgres_url)
    flush(postgres_url)
    seen_inside: list[tuple[Any, ...]] = []

    def progress(phase: str, done: int, total: int | None) -> None:
        if phase == "commit" and done == 0:
            with psycopg.connect(postgres_url, autocommit=True) as other:
                locks = other.execute(
                    "SELECT mode, granted FROM pg_locks WHERE locktype = 'advisory' "
                    "AND classid = 1835233380"
                ).fetchall()
            seen_inside.append(
                (live_counters(postgres_url), watermarks(postgres_url), has_epoch(postgres_url),
                 locks)
            )  # fmt: skip

    store = PostgresStore.connect(postgres_url)
    con = open_ledger(archive_dir=run.archive)
    try:
        report = await asyncio.to_thread(
            rebuild.rebuild_from_ledger, con, store, all_buckets=True, progress=progress
        )
    finally:
        con.close()
        store.close()
    assert seen_inside == [({}, {}, False, [("ExclusiveLock", True)])]
    assert live_counters(postgres_url) == live and has_epoch(postgres_url)
    assert report.counters == len(live) and report.epoch


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--postgres", "redis://127.0.0.1:6379/0"], "--postgres: expected postgresql://"),
        (["--postgres", "postgresql://postgres@127.0.0.1:1/x"], "postgres postgresql://"),
        (["--postgres", "{unmigrated}"], "not migrated): run mcpbg migrate --postgres"),
    ],
)
@pytest.mark.parametrize("command", ["replay", "reconcile"])
def test_bad_postgres_is_one_line_and_exit_code_2(
    postgres_server: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    problem: str,
    command: str,
) -> None:
    for var in ("MCPBG_REDIS_URL", "MCPBG_POSTGRES_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "ledger").mkdir()
    with scratch_database(postgres_server, "mcpbg_unmigrated") as unmigrated:
        argv = [a.format(unmigrated=unmigrated) for a in argv]
        code, _, err = run_cli(capsys, command, "--ledger-dir", str(tmp_path / "ledger"), *argv)
    assert code == 2
    assert err.startswith(f"mcpbg {command}: ") and err.count("\n") == 1, err
    assert problem in err, err


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--source", "tape"], "--source: one of archive, file, kafka (got 'tape')"),
        (["--redis-url", "http://localhost"], "--redis-url: expected redis://host:port/db"),
        (["--redis-url", "redis://127.0.0.1:1/0"], "redis redis://127.0.0.1:1/0"),
        (["--archive-dir", "{empty}"], "empty ledger"),
        (["--archive-dir", "{corrupt}"], "corrupt Parquet file"),
        (["--archive-dir", "{tmp}/nope"], "no such folder"),
        (["--source", "kafka", "--kafka-url", "http://x:1"], "expected kafka://host:port"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    problem: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in ("MCPBG_ARCHIVE_DIR", "MCPBG_LEDGER_DIR", "MCPBG_REDIS_URL", "MCPBG_KAFKA_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "empty").mkdir()
    corrupt = tmp_path / "corrupt" / "date=2026-11-29"
    corrupt.mkdir(parents=True)
    (corrupt / "x.parquet").write_bytes(b"garbage")
    argv = [a.format(empty=tmp_path / "empty", corrupt=tmp_path / "corrupt", tmp=tmp_path)
            for a in argv]  # fmt: skip
    if "--redis-url" not in argv:
        argv += ["--redis-url", redis_url]
    if "--archive-dir" not in argv:
        argv += ["--archive-dir", str(tmp_path / "empty")]
    code, _, err = replay(capsys, *argv)
    assert code == 2
    assert err.startswith("mcpbg replay: ") and err.count("\n") == 1, err
    assert problem in err


# -- the real worker and Kafka ------------------------------------------------------


@pytest.mark.slow
async def test_kafka_and_archive_replays_equal_the_real_workers_counters(
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real worker projects a Kafka ledger and archives it; after an outage both
    replay paths rebuild exactly its counters, and the worker resumes after a replay
    with every counter equal to its ledger sum and nothing in flight."""
    pytest.importorskip("mcp_budget_governor.stream.worker")
    from testing import stream_support as sw
    from testing.services import start_kafka

    kafka = start_kafka()
    started: list[sw.Worker] = []
    backend = RedisBackend.from_url(redis_url, timeout=5.0)
    try:
        await backend.mark_ready("test")
        names = sw.Names(f"ledger-replay-{random.randrange(10**9)}", "projector-replay")
        archive = tmp_path / "archive"

        async def project(operations: int, seed: int) -> sw.Worker:
            """The operations' events, projected and archived by a worker, exactly."""
            async with sw.governor(kafka, backend, names.topic, tmp_path) as gov:
                await sw.workload(gov, operations, random.Random(seed))
            worker = sw.start_worker(
                started, kafka, redis_url, names, tmp_path, "--archive-dir", str(archive)
            )
            records = await sw.wait_caught_up(kafka, backend, names.topic, started)
            await sw.assert_exact(backend, records)
            return worker

        worker = await project(400, 11)
        assert worker.terminate() == 0
        live, marks = live_counters(redis_url), watermarks(redis_url)

        common = ["--all", "--redis-url", redis_url]
        flush(redis_url)
        code, out, _ = await asyncio.to_thread(
            replay, capsys, "--archive-dir", str(archive), *common
        )
        assert code == 0, out
        assert (live_counters(redis_url), watermarks(redis_url)) == (live, marks)

        # The worker resumes on the replayed Redis: new events, nothing counted twice.
        worker = await project(200, 12)
        assert "rebuild: " not in worker.text()  # the replay's epoch marker was found
        assert worker.terminate() == 0
        live, marks = live_counters(redis_url), watermarks(redis_url)

        flush(redis_url)
        kafka_args = ["--source", "kafka", "--kafka-url", f"kafka://{kafka.bootstrap}",
                      "--topic", names.topic, *common]  # fmt: skip
        caplog.set_level(logging.INFO)
        caplog.clear()
        code, out, err = await asyncio.to_thread(
            replay, capsys, "--dry-run", "--show", "100000", *kafka_args
        )
        assert code == 0 and "dry run: nothing written" in out
        # A dry run neither says it replays nor that the counters are ready.
        said = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
        assert "replaying" not in said + err and "ready" not in said + err, said
        # every counter would change (from nothing), unless its total is zero
        assert all(key in out for key, (committed, _) in live.items() if committed)
        assert redis_sync.Redis.from_url(redis_url).dbsize() == 0
        caplog.clear()
        code, out, _ = await asyncio.to_thread(replay, capsys, *kafka_args)
        assert code == 0, out
        assert "counters ready" in caplog.text  # the real replay does say so
        assert (live_counters(redis_url), watermarks(redis_url)) == (live, marks)
        assert redis_sync.Redis.from_url(redis_url).exists(EPOCH_KEY)
    finally:
        for w in started:
            if w.proc.poll() is None:
                w.kill()
        await backend.aclose()
        kafka.stop()


def test_the_seen_day_in_sql_is_the_python_one() -> None:
    """The rebuild and reconcile --fix fill seen-id sets by the SQL rule; the
    projection by AppliedEvent's: both must name the same day and expiry."""
    import duckdb

    from mcp_budget_governor.counters import AppliedEvent
    from mcp_budget_governor.projections.counters.sync import SEEN_DAY_SQL, SEEN_EXPIRE_SQL

    times = [0.0, 86_399.999, 86_400.0, 1_764_547_199.5, 1_764_547_200.0, 1_800_000_000.25]
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    got = con.execute(
        f'SELECT {SEEN_DAY_SQL}, {SEEN_EXPIRE_SQL} FROM (SELECT to_timestamp(t) AS "time" '
        'FROM unnest(?::DOUBLE[]) AS u(t)) ORDER BY "time"',
        [times],
    ).fetchall()
    want = [(e.seen_day, e.seen_expire_at) for e in (AppliedEvent(0, "x", t, ()) for t in times)]
    assert got == want
