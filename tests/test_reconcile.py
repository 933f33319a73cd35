"""``mcpbg reconcile``: finds a tampered counter (exit 1, the table names the key), ``--fix``
repairs it, and a stream caught mid-flight (archived but not applied, or in flight)
is no drift."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis as redis_sync
from test_ledger_view import TOPIC, live_counters, mixed_run
from test_replay import extend

from mcp_budget_governor.cli import main
from mcp_budget_governor.events import parse
from mcp_budget_governor.stream.archiver import Archiver


def reconcile(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["reconcile", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_tampered_counter_is_found_and_fixed(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(redis_url, tmp_path)
    args = ["--archive-dir", str(run.archive), "--redis-url", redis_url]
    code, out, _ = reconcile(capsys, *args)
    assert code == 0 and "no drift" in out, out

    totals = run.totals()
    key = max(totals, key=lambda k: (k.startswith("mcpbg:v1:spend:"), totals[k]))
    client = redis_sync.Redis.from_url(redis_url)
    client.hincrby(key, "c", 12_345)
    gone = next(k for k in totals if k.startswith("mcpbg:v1:daily:"))
    client.delete(gone)  # a lost counter is drift too
    stray = "mcpbg:v1:spend:tenant=nobody:20261129"
    client.hset(stray, "c", 99)
    client.expire(stray, 3600)

    code, out, _ = reconcile(capsys, *args)
    assert code == 1
    assert key in out and "+12345" in out and gone in out and stray in out
    code, out, _ = reconcile(capsys, "--json", *args)
    report = json.loads(out)
    drift = {d["key"]: d["drift"] for d in report["drift"]}
    assert drift == {key: 12_345, gone: -totals[gone], stray: 99}

    code, out, _ = reconcile(capsys, "--fix", *args)
    assert code == 1 and "(fixed)" in out
    assert int(client.hget(key, "c") or 0) == totals[key]
    assert int(client.hget(gone, "c") or 0) == totals[gone] and client.ttl(gone) > 0
    assert int(client.hget(stray, "c") or 0) == 0 and client.ttl(stray) > 0
    code, out, _ = reconcile(capsys, *args)
    assert code == 0, out
    client.close()


async def test_events_archived_but_not_applied_and_in_flight_are_no_drift(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker archives a batch before applying it, and the hot path writes in flight:
    a reconcile in between compares at the watermarks and reports no drift."""
    run = await mixed_run(redis_url, tmp_path)
    archived = await extend(redis_url, run, 80, seed=21)  # in flight in Redis
    archiver = Archiver(run.archive, topic=TOPIC)
    for p, records in archived.items():
        archiver.write_batch(p, [(o, parse(raw)) for o, raw in records])
    assert any(f for _, f in live_counters(redis_url).values())
    code, out, _ = reconcile(capsys, "--archive-dir", str(run.archive), "--redis-url", redis_url)
    assert code == 0, out
    assert "no drift" in out and "in flight: 0" not in out


async def test_stale_in_flight_entry_is_drift_and_fix_drops_it(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = await mixed_run(redis_url, tmp_path)
    event_id = run.ids[5]
    key = next(c.key for c in parse(run.partitions[0][0][1]).data.charges)
    client = redis_sync.Redis.from_url(redis_url)
    client.hincrby(key, "f", 3)
    client.hincrby(key, f"e:{event_id}", 3)  # an applied event left in flight
    args = ["--archive-dir", str(run.archive), "--redis-url", redis_url]
    code, out, _ = reconcile(capsys, "--json", *args)
    assert code == 1
    ((entry,),) = [json.loads(out)["drift"]]
    assert (entry["key"], entry["drift"], entry["stale_in_flight"]) == (key, 0, 1)
    code, _, _ = reconcile(capsys, "--fix", *args)
    assert code == 1
    assert client.hget(key, f"e:{event_id}") is None and int(client.hget(key, "f") or 0) == 0
    assert reconcile(capsys, *args)[0] == 0
    client.close()


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
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded mode: a FileLedger projected by the FileProjector reconciles too."""
    import random

    from test_ledger_view import policy, workload

    from mcp_budget_governor import Governor, RedisBackend
    from mcp_budget_governor.prices import PriceTable
    from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector

    backend = RedisBackend.from_url(redis_url, timeout=5.0)
    folder = tmp_path / "ledger"
    ledger = FileLedger(folder, fsync="never")
    gov = Governor(policy(), backend, ledger=ledger, prices=PriceTable.builtin())
    await workload(gov, 150, random.Random(31))
    await ledger.aclose()
    await FileProjector(folder, backend).catch_up()
    await backend.aclose()
    args = ["--ledger-dir", str(folder), "--redis-url", redis_url]
    assert reconcile(capsys, *args)[0] == 0
    key = next(iter(live_counters(redis_url)))
    client = redis_sync.Redis.from_url(redis_url)
    client.hincrby(key, "c", -1)
    code, out, _ = reconcile(capsys, *args)
    assert code == 1 and key in out and "-1" in out
    client.close()
