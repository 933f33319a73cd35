"""``mcpbg reconcile``: finds a tampered counter (exit 1, the table names the key), ``--fix``
repairs it, and a stream caught mid-flight (archived but not applied, or in flight)
is no drift; on Redis and on Postgres alike (``store_url``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcp_budget_governor.caps import PLANS_KEY, caps_key
from mcp_budget_governor.events import parse
from mcp_budget_governor.stream.archiver import Archiver
from testing.ledger_run import (
    TENANTS,
    TOPIC,
    extend,
    live_counters,
    mixed_run,
    project,
    run_cli,
    run_time_changes,
)
from testing.services import KafkaService, start_kafka
from testing.stores import (
    add_committed,
    backend_for,
    committed_of,
    drop_counter,
    granted_keys,
    is_postgres,
    pending_of,
    put_counter,
    put_in_flight,
    run_time_state,
    set_cap_entry,
    set_grant,
    set_plan_entry,
    set_watermark,
    store_args,
    watermarks,
)


def reconcile(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return run_cli(capsys, "reconcile", *argv)


async def test_tampered_counter_is_found_and_fixed(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(store_url, tmp_path)
    args = ["--archive-dir", str(run.archive), *store_args(store_url)]
    code, out, _ = reconcile(capsys, *args)
    assert code == 0 and "no drift" in out, out

    totals = run.totals()
    key = max(totals, key=lambda k: (k.startswith("mcpbg:v1:spend:"), totals[k]))
    add_committed(store_url, key, 12_345)
    gone = next(k for k in totals if k.startswith("mcpbg:v1:daily:"))
    drop_counter(store_url, gone)  # a lost counter is drift too
    stray = "mcpbg:v1:spend:tenant=nobody:20261129"
    put_counter(store_url, stray, 99)

    code, out, _ = reconcile(capsys, *args)
    assert code == 1
    assert key in out and "+12345" in out and gone in out and stray in out
    code, out, _ = reconcile(capsys, "--json", *args)
    report = json.loads(out)
    drift = {d["key"]: d["drift"] for d in report["drift"]}
    assert drift == {key: 12_345, gone: -totals[gone], stray: 99}

    code, out, _ = reconcile(capsys, "--fix", *args)
    assert code == 1 and "(fixed)" in out
    assert committed_of(store_url, key) == (totals[key], True)
    assert committed_of(store_url, gone) == (totals[gone], True)
    assert committed_of(store_url, stray) == (0, True)
    code, out, _ = reconcile(capsys, *args)
    assert code == 0, out


async def test_events_archived_but_not_applied_and_in_flight_are_no_drift(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker archives a batch before applying it, and the hot path writes in flight:
    a reconcile in between compares at the watermarks and reports no drift."""
    run = await mixed_run(store_url, tmp_path)
    archived = await extend(store_url, run, 80, seed=21)  # in flight in the store
    archiver = Archiver(run.archive, topic=TOPIC)
    for p, records in archived.items():
        archiver.write_batch(p, [(o, parse(raw)) for o, raw in records])
    assert any(f for _, f in live_counters(store_url).values())
    code, out, _ = reconcile(capsys, "--archive-dir", str(run.archive), *store_args(store_url))
    assert code == 0, out
    assert "no drift" in out and "in flight: 0" not in out


async def test_stale_in_flight_entry_is_drift_and_fix_drops_it(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(store_url, tmp_path)
    event_id = run.ids[5]
    key = next(c.key for c in parse(run.partitions[0][0][1]).data.charges)
    put_in_flight(store_url, key, event_id, 3)  # an applied event left in flight
    args = ["--archive-dir", str(run.archive), *store_args(store_url)]
    code, out, _ = reconcile(capsys, "--json", *args)
    assert code == 1
    ((entry,),) = [json.loads(out)["drift"]]
    assert (entry["key"], entry["drift"], entry["stale_in_flight"]) == (key, 0, 1)
    code, _, _ = reconcile(capsys, "--fix", *args)
    assert code == 1
    assert pending_of(store_url, key) == ({}, 0)
    assert reconcile(capsys, *args)[0] == 0


def test_bad_input_is_one_line_and_exit_code_2(
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MCPBG_ARCHIVE_DIR", raising=False)
    monkeypatch.delenv("MCPBG_LEDGER_DIR", raising=False)
    (tmp_path / "empty").mkdir()
    for argv, problem in [
        (["--archive-dir", str(tmp_path / "empty"), "--redis-url", redis_url], "empty ledger"),
        (["--archive-dir", str(tmp_path), "--redis-url", "redis://127.0.0.1:1/0"], "redis "),
        (["--redis-url", redis_url], "no ledger given"),
    ]:
        code, _, err = reconcile(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and problem in err, err


async def test_file_ledger_reconcile(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded mode: a FileLedger projected by the FileProjector reconciles too."""
    import random

    from mcp_budget_governor import Governor
    from mcp_budget_governor.prices import PriceTable
    from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
    from testing.ledger_run import policy, workload

    backend = backend_for(store_url)
    folder = tmp_path / "ledger"
    ledger = FileLedger(folder, fsync="never")
    gov = Governor(policy(), backend, ledger=ledger, prices=PriceTable.builtin())
    await workload(gov, 150, random.Random(31))
    await ledger.aclose()
    await FileProjector(folder, backend).catch_up()
    await backend.aclose()
    args = ["--ledger-dir", str(folder), *store_args(store_url)]
    assert reconcile(capsys, *args)[0] == 0
    key = next(iter(live_counters(store_url)))
    add_committed(store_url, key, -1)
    code, out, _ = reconcile(capsys, *args)
    assert code == 1 and key in out and "-1" in out


# --------------------------------------------------------------------------- #
# orphaned in-flight amounts: a process died between its Redis charge and its append
# --------------------------------------------------------------------------- #


class LostLedger:
    """The ledger of a process killed right after each Redis charge: nothing is appended
    (the entries are kept here only to play the late original later)."""

    accepting = True

    def __init__(self) -> None:
        self.entries: list[Any] = []

    async def append(self, entry: Any) -> None:
        self.entries.append(entry)

    async def aclose(self) -> None:
        return None


async def orphan_ops(redis_url: str) -> LostLedger:
    """A check (calls) and a meter (USD micros) whose events never reach the ledger."""
    from mcp_budget_governor import Context, Governor
    from testing.ledger_run import TENANTS, policy

    lost = LostLedger()
    gov = Governor(policy(), backend_for(redis_url), ledger=lost)
    ctx = Context(user="orphan-user", tenant=TENANTS[0], tool="search")  # a fresh burst budget
    assert (await gov.check(ctx)).admitted
    assert (await gov.meter("spend", 12_345, ctx)).charged == 12_345
    await gov.aclose()
    return lost


def per_unit(entries: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        for c in e.charges:
            out[c.unit.value] = out.get(c.unit.value, 0) + c.amount
    return out


@pytest.fixture(scope="module")
def kafka() -> Iterator[KafkaService]:
    svc = start_kafka()
    yield svc
    svc.stop()


async def test_orphaned_in_flight_is_listed_per_unit_and_settled_through_the_topic(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], kafka: KafkaService
) -> None:
    """Orphans are listed per unit once older than the bound; ``--fix`` appends one
    ``recovered`` event per operation to the topic (the lost ids and charges); the worker's
    projection settles them, so counters, ledger and the costs view agree; a late
    original changes nothing; a limit the ledger never named is listed, not settled."""
    from mcp_budget_governor.ledger import EntryType, new_id
    from mcp_budget_governor.projections.ledger_view import open_ledger
    from mcp_budget_governor.stream.projector import Projector
    from mcp_budget_governor.stream.topic_reader import read_topic

    redis_url = store_url
    run = await mixed_run(redis_url, tmp_path)
    args = ["--archive-dir", str(run.archive), *store_args(redis_url)]
    assert reconcile(capsys, *args)[0] == 0
    lost = await orphan_ops(redis_url)
    expected = per_unit(lost.entries)
    assert set(expected) == {"calls", "usd_micros"}

    # Young orphans are not listed (their events may still be on their way).
    code, out, _ = reconcile(capsys, "--json", "--older-than", "3600", *args)
    assert code == 0 and json.loads(out)["orphans"] == []
    code, out, _ = reconcile(capsys, "--json", "--older-than", "0", *args)
    report = json.loads(out)
    assert code == 1 and report["drift"] == []
    assert report["orphaned_by_unit"] == expected  # one number per unit, never mixed
    assert {o["event_id"] for o in report["orphans"]} == {e.id for e in lost.entries}
    code, out, _ = reconcile(capsys, "--older-than", "0", *args)
    assert code == 1 and "orphaned in flight" in out and "usd_micros" in out

    # An orphan of a limit no ledger event names: its unit is unknown.
    ghost, ghost_id = "mcpbg:v1:ghost:user=u9:20261201", new_id()
    put_in_flight(redis_url, ghost, ghost_id, 5)
    topic = f"mcpbg.recovery.{new_id()[-8:]}"
    fix = ["--fix", "--older-than", "0", "--kafka-url", kafka.bootstrap, "--topic", topic]
    # The command runs its own event loop (asyncio.run), as from a shell.
    code, out, err = await asyncio.to_thread(reconcile, capsys, *fix, *args)
    assert code == 1, err
    assert "settled: 2 recovery events appended to the ledger; not settled: 1 entries" in out
    assert "orphaned per unit: 3 calls, 5 of unknown unit, 12,345 usd_micros" in out, out

    records = await read_topic(kafka.bootstrap, topic)
    assert sorted(r.event.id for r in records) == sorted(e.id for e in lost.entries)
    by_id = {e.id: e for e in lost.entries}
    for r in records:
        assert r.event.type == "mcpbg.recovered.v1"
        mine = {(c.key, c.amount, c.unit) for c in r.event.data.charges}
        theirs = {(c.key, c.amount, c.unit) for c in by_id[r.event.id].charges if c.amount}
        assert mine == theirs
        # The context is what the keys name (here the tenant; the user where a key has it).
        named = {k: v for k, v in r.event.data.context.model_dump().items() if v is not None}
        original = by_id[r.event.id].context
        assert named and all(getattr(original, k) == v for k, v in named.items()), named

    # The worker projects (and archives) the topic: the orphans are settled, once.
    backend = backend_for(redis_url)
    archiver = Archiver(run.archive, topic=topic)
    projector = Projector(backend, topic, dlq=lambda letter: None, archive=archiver.write_batch)

    async def project(rows: list[Any]) -> None:
        by_p: dict[int, list[tuple[int, bytes]]] = {}
        for r in rows:
            by_p.setdefault(r.partition, []).append((r.offset, r.event.model_dump_json().encode()))
        for p, batch in by_p.items():
            await projector.apply_batch(p, batch)

    await project(list(records))
    drop_counter(redis_url, ghost)
    code, out, _ = reconcile(capsys, "--json", "--older-than", "0", *args)
    assert code == 0, out
    con = open_ledger(run.archive)
    (usd,) = con.execute(
        "SELECT sum(usd_micros) FROM costs WHERE type = 'mcpbg.recovered.v1'"
    ).fetchone() or (None,)
    con.close()
    assert usd == expected["usd_micros"]

    # The late original (an outbox shipped after all): a duplicate id, skipped.
    before = live_counters(redis_url)
    from mcp_budget_governor.producers.kafka_ledger import KafkaLedger

    late = KafkaLedger(kafka.bootstrap, topic=topic, outbox_dir=tmp_path / "late", partitions=3)
    for entry in lost.entries:
        assert entry.type in (EntryType.ADMITTED, EntryType.METERED)
        await late.append(entry)
    assert await late.flush(30)
    await late.aclose()
    seen = {(r.partition, r.offset) for r in records}
    await project([r for r in await read_topic(kafka.bootstrap, topic)
                   if (r.partition, r.offset) not in seen])  # fmt: skip
    await backend.aclose()
    assert live_counters(redis_url) == before
    assert reconcile(capsys, "--older-than", "0", *args)[0] == 0


async def test_orphans_of_the_file_ledger_are_settled_in_it(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded mode: ``--fix`` appends the recovery events to the file ledger itself,
    and the FileProjector settles them; no --kafka-url needed. With a planted drift too:
    one ``--fix`` repairs both, and the next reconcile is clean."""
    import random

    from mcp_budget_governor import Governor
    from mcp_budget_governor.prices import PriceTable
    from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
    from testing.ledger_run import policy, workload

    redis_url = store_url
    backend = backend_for(redis_url)
    folder = tmp_path / "ledger"
    ledger = FileLedger(folder, fsync="never")
    gov = Governor(policy(), backend, ledger=ledger, prices=PriceTable.builtin())
    await workload(gov, 80, random.Random(5))
    await ledger.aclose()
    await FileProjector(folder, backend).catch_up()
    lost = await orphan_ops(redis_url)
    drifted = next(k for k in live_counters(redis_url) if k.startswith("mcpbg:v1:daily:"))
    add_committed(redis_url, drifted, 7)
    args = ["--ledger-dir", str(folder), *store_args(redis_url), "--older-than", "0"]
    code, out, _ = reconcile(capsys, "--json", *args)
    report = json.loads(out)
    assert code == 1 and report["orphaned_by_unit"] == per_unit(lost.entries)
    assert {d["key"]: d["drift"] for d in report["drift"]} == {drifted: 7}
    code, out, err = await asyncio.to_thread(reconcile, capsys, "--fix", *args)
    assert code == 1 and "settled: 2 recovery events appended to the ledger" in out, err
    assert "(fixed)" in out
    await FileProjector(folder, backend).catch_up()
    await backend.aclose()
    assert all(f == 0 for _, f in live_counters(redis_url).values())
    code, out, _ = reconcile(capsys, *args)
    assert code == 0 and "no orphaned in-flight amounts" in out and "no drift" in out, out


def test_fix_without_a_ledger_to_append_to_is_one_line(
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MCPBG_KAFKA_URL", raising=False)
    run = asyncio.run(mixed_run(redis_url, tmp_path))
    asyncio.run(orphan_ops(redis_url))
    argv = ["--archive-dir", str(run.archive), "--redis-url", redis_url, "--older-than", "0"]
    code, _, err = reconcile(capsys, "--fix", *argv)
    assert code == 2 and err.count("\n") == 1 and "--kafka-url" in err, err
    # A number that is not a whole number of seconds is a usage error: argparse's exit 2
    # (one line naming the option and the value), before anything runs.
    with pytest.raises(SystemExit) as usage:
        reconcile(capsys, *argv[:-2], "--older-than", "-1")
    err = capsys.readouterr().err
    assert usage.value.code == 2 and err.count("\n") == 1, err
    assert "--older-than" in err and "'-1'" in err, err


async def test_run_time_changes_a_store_lost_are_reported_and_put_back(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caps, plan assignments and grants are compared with what the ledger's changes leave
    live: an entry lost, altered, or one the ledger never gave is drift, ``--fix`` puts
    it back; a store that matches shows none."""
    run = await mixed_run(store_url, tmp_path)
    await project(store_url, run, await run_time_changes(store_url, run))
    args = ["--archive-dir", str(run.archive), *store_args(store_url)]
    code, out, _ = reconcile(capsys, *args)
    assert code == 0 and "run-time drift" not in out, out
    code, out, _ = reconcile(capsys, "--json", *args)
    assert code == 0 and json.loads(out)["run_time_drift"] == [], out

    granted = granted_keys(store_url)
    assert len(granted) == 3, granted  # the tenant's calls, u1's and u3's day
    before = run_time_state(store_url)
    tenant_field = f"tenant={TENANTS[0]}"
    grant_key = next(k for k in granted if k.startswith("mcpbg:v1:tenant_calls:"))
    daily_key = next(k for k in granted if k.startswith("mcpbg:v1:daily:user=u1"))
    set_cap_entry(store_url, caps_key("tenant_calls"), tenant_field, None)  # a cap set, lost
    set_cap_entry(store_url, caps_key("daily"), "user=u9", 5)  # a cap the ledger never set
    set_grant(store_url, grant_key, None)  # its grants, lost
    set_grant(store_url, daily_key, 5)  # a grant, altered
    set_plan_entry(store_url, "user=u1", "free")  # an assignment, altered

    code, out, _ = reconcile(capsys, *args)
    assert code == 1 and "run-time drift: 5" in out and grant_key in out, out
    code, out, _ = reconcile(capsys, "--json", *args)
    report = json.loads(out)
    assert code == 1 and report["drift"] == [], out
    side = "postgres" if is_postgres(store_url) else "redis"
    drift = {
        (d["kind"], d["key"], d["field"]): (d[side], d["ledger"]) for d in report["run_time_drift"]
    }
    assert drift == {
        ("cap", caps_key("tenant_calls"), tenant_field): (None, "5000 until for good (ops: trial)"),
        ("cap", caps_key("daily"), "user=u9"): ("5 until for good", None),
        ("grant", grant_key, "g"): (None, "42"),
        ("grant", daily_key, "g"): ("5", "7"),
        ("plan", PLANS_KEY, "user=u1"): ("free", "pro"),
    }

    code, out, _ = reconcile(capsys, "--fix", "--json", *args)
    assert code == 1 and json.loads(out)["run_time_fixed"] == 5, out
    assert run_time_state(store_url) == before
    code, out, _ = reconcile(capsys, *args)
    assert code == 0 and "run-time drift" not in out, out


async def test_run_time_changes_archived_but_not_applied_are_no_drift(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker archives a batch before applying it: run-time changes past the store's
    watermarks are not yet live, so they are no drift (and ``--fix`` writes none)."""
    run = await mixed_run(store_url, tmp_path)
    changes = await run_time_changes(store_url, run)
    archiver = Archiver(run.archive, topic=TOPIC)
    for p, records in changes.items():
        archiver.write_batch(p, [(o, parse(raw)) for o, raw in records])
    before = run_time_state(store_url)
    args = ["--archive-dir", str(run.archive), *store_args(store_url)]
    code, out, _ = reconcile(capsys, "--fix", "--json", *args)
    report = json.loads(out)
    assert code == 0 and report["run_time_drift"] == [] and report["run_time_fixed"] == 0, out
    assert run_time_state(store_url) == before


async def test_run_time_fix_is_refused_when_a_projector_applied_meanwhile(
    store_url: str, tmp_path: Path
) -> None:
    """The watermarks moved between the read and the fix: nothing is written."""
    from mcp_budget_governor.projections.counters import changes_sync
    from mcp_budget_governor.projections.counters.pg_sync import PostgresStore
    from mcp_budget_governor.projections.counters.rebuild import open_store
    from mcp_budget_governor.projections.counters.sync import ConcurrentProjectionError
    from mcp_budget_governor.projections.ledger_view import open_ledger

    run = await mixed_run(store_url, tmp_path)
    await project(store_url, run, await run_time_changes(store_url, run))
    field = f"tenant={TENANTS[0]}"
    set_cap_entry(store_url, caps_key("tenant_calls"), field, None)
    before = run_time_state(store_url)
    con = open_ledger(str(run.archive))

    def applied() -> None:  # a projector applied one more event
        name, offset = next(iter(watermarks(store_url).items()))
        set_watermark(store_url, name, offset + 1)

    postgres = is_postgres(store_url)
    owner: Any = PostgresStore if postgres else changes_sync
    name = "run_time" if postgres else "read_hashes"
    read = getattr(owner, name)

    def read_then_apply(*a: Any, **k: Any) -> Any:
        got = read(*a, **k)
        applied()
        return got

    setattr(owner, name, read_then_apply)
    store = open_store(store_url)
    try:
        with pytest.raises(ConcurrentProjectionError):
            changes_sync.reconcile_changes(con, store, fix=True)
    finally:
        setattr(owner, name, read)
        store.close()
        con.close()
    assert run_time_state(store_url) == before


async def test_run_time_changes_of_segments_older_than_the_change_column_are_not_compared(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An archive written before the ``change`` column keeps no change: what it set is
    unknown, so nothing run-time is reported (or unset by --fix); a warning says so."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    run = await mixed_run(store_url, tmp_path)
    await project(store_url, run, await run_time_changes(store_url, run))
    for segment in run.archive.rglob("*.parquet"):
        table = pq.read_table(segment)
        if "change" in table.column_names:
            pq.write_table(table.drop_columns(["change"]), segment)
    before = run_time_state(store_url)
    args = ["--archive-dir", str(run.archive), *store_args(store_url)]
    code, out, _ = reconcile(capsys, "--fix", *args)
    assert code == 0 and "not compared" in out, out
    assert run_time_state(store_url) == before
    code, out, _ = reconcile(capsys, "--json", *args)
    assert code == 0 and json.loads(out)["run_time_unreadable"] == 11, out


async def test_a_lost_settlement_is_recovered_against_its_reservation(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process died between a settlement's charge and its append: the refund is in
    flight under an id the ledger never saw. ``--fix`` recovers it naming the open
    reservation it draws on (the projection refuses a refund of none), and the
    counter ends at the real cost, nothing in flight."""
    from mcp_budget_governor import Context, Governor
    from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
    from testing.ledger_run import TENANTS, policy

    backend = backend_for(store_url)
    folder = tmp_path / "ledger"
    ledger = FileLedger(folder, fsync="never")
    gov = Governor(policy(), backend, ledger=ledger)
    ctx = Context(user="settle-lost", tenant=TENANTS[0], tool="search")
    held = await gov.reserve("spend", 50_000, ctx)
    gov.ledger = LostLedger()  # type: ignore[assignment]  # the settlement's append is lost
    await gov.settle(held, 10_000)
    await ledger.aclose()
    await FileProjector(folder, backend).catch_up()
    args = ["--ledger-dir", str(folder), *store_args(store_url), "--older-than", "0"]
    code, out, err = await asyncio.to_thread(reconcile, capsys, "--fix", *args)
    assert code == 1 and "settled: 1 recovery events appended to the ledger" in out, out + err
    assert "not settled" not in out, out
    await FileProjector(folder, backend).catch_up()
    spend = [v for k, v in live_counters(store_url).items() if k.startswith("mcpbg:v1:spend:")]
    await backend.aclose()
    assert spend == [(10_000, 0)], spend
    code, out, _ = reconcile(capsys, *args)
    assert code == 0 and "no orphaned in-flight amounts" in out, out
