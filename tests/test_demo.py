"""``mcpbg demo`` end to end, as a user runs it: a subprocess, then its printout and files.

The embedded default needs no servers; the ``--redis`` run puts the counters
in the fixture's real Redis.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import redis

from mcp_budget_governor import format_usd, usd
from mcp_budget_governor.demo.report import FOCUS_FILE
from mcp_budget_governor.demo.runner import MARKER
from mcp_budget_governor.demo.scenario import MODEL, POLICY
from testing.services import start_kafka

#: FOCUS 1.2 columns every cost row must have (a subset of the mandatory ones).
FOCUS_COLUMNS = {
    "BilledCost",
    "EffectiveCost",
    "ChargeCategory",
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "BillingCurrency",
    "ConsumedQuantity",
    "ServiceName",
    "SubAccountId",
}


def run_demo(out: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [sys.executable, "-m", "mcp_budget_governor.cli", "demo", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def check_outputs(
    proc: subprocess.CompletedProcess[str], out: Path, ledger: str = "ledger/*.jsonl"
) -> dict[str, object]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    # The narrative: a burst cap refuses, a spend cap refuses, the breaker trips.
    assert "refused 429 budget_exceeded:user/minute" in text
    assert "refused 402 budget_exceeded:user/day" in text
    assert "global breaker tripped" in text
    assert "refused 503 budget_exceeded:global/day" in text
    # The projection caught up: every charge committed (conservation).
    assert "nothing left in flight" in text
    # The tables.
    for title in (
        "Calls by agent",
        "Budgets now",
        "Cost by tenant, user and tool",
        "Calls shed by the breaker",
    ):
        assert title in text, title
    shed = text[text.index("Calls shed by the breaker") :]
    assert "│ global_spend │" in shed.split("Ledger:")[0]
    cap = f"${format_usd(POLICY['global_spend'].cap)}"
    budget_line = next(line for line in text.splitlines() if "global_spend" in line)
    assert cap in budget_line and "yes" in budget_line  # exceeded
    # What it wrote.
    assert (out / MARKER).is_file()
    assert list(out.glob(ledger)), f"no ledger files {ledger}"
    focus = out / FOCUS_FILE
    assert f"{focus}" in text.replace("\n", "")
    with focus.open(newline="") as f:
        rows = list(csv.reader(f))
    assert len(rows) > 5
    header = set(rows[0])
    assert header >= FOCUS_COLUMNS, FOCUS_COLUMNS - header
    # The model calls' costs split into token meters, naming the model.
    meter, model = rows[0].index("SkuMeter"), rows[0].index("x_ModelId")
    meters = {(row[meter], row[model]) for row in rows[1:]}
    assert {("Input Tokens", MODEL), ("Output Tokens", MODEL), ("Tool Calls", "")} <= meters
    billed = rows[0].index("BilledCost")
    assert all("." in row[billed] for row in rows[1:])  # decimals, with a point
    # Each call's cost once: the file bills what the global breaker counted.
    total = sum(Decimal(row[billed]) for row in rows[1:])
    assert f"({len(rows) - 1} rows, ${format_usd(usd(total))} billed)" in text
    assert f"${format_usd(usd(total))}" in budget_line
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    assert summary["breaker_tripped_at_s"] is not None
    assert summary["global_spend_micros"] == usd(total) >= POLICY["global_spend"].cap
    outcomes = summary["outcomes"]
    assert isinstance(outcomes, dict)
    assert outcomes["runaway-loop budget_exceeded:user/minute"] > 0
    assert outcomes["alice admitted"] > 0
    # The charts: a self-contained report.html, and the demo says where.
    report = out / "report.html"
    assert summary["report_file"] == str(report) and "report.html" in text
    html = report.read_text()
    assert 'id="spend"' in html and 'id="reasons"' in html and "Chart.js v4" in html
    assert "<script src=" not in html  # inlined: opens offline
    return summary


def test_embedded_demo_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    summary = check_outputs(run_demo(out), out)
    assert "in-process counters" in run_demo(out).stdout  # a second run replaces the first
    # The same seed tells the same story.
    again = json.loads((out / "summary.json").read_text())
    assert again["outcomes"] == summary["outcomes"]


def test_demo_refuses_a_folder_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    proc = run_demo(tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--out" in proc.stderr and str(tmp_path) in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("option", "url"),
    [
        ("--redis", "redis://127.0.0.1:1/0"),
        ("--postgres", "postgresql://127.0.0.1:1/demo"),
        ("--postgres", "mysql://127.0.0.1/demo"),
        ("--kafka", "kafka://127.0.0.1:1"),
        ("--kafka", "x://y"),
    ],
)
def test_a_service_that_does_not_answer_is_named_before_anything_is_written(
    tmp_path: Path, option: str, url: str
) -> None:
    out = tmp_path / "demo"
    proc = run_demo(out, option, url)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"mcpbg demo: {option}: ") and url in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not out.exists()


def test_topic_without_kafka_is_refused(tmp_path: Path) -> None:
    proc = run_demo(tmp_path / "demo", "--topic", "mine")
    assert proc.returncode == 2
    assert proc.stderr == "mcpbg demo: --topic: only with --kafka (got 'mine')\n"
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_demo_against_redis(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "demo"
    proc = run_demo(out, "--redis", redis_url)
    check_outputs(proc, out)
    assert f"Redis at {redis_url}" in proc.stdout
    # The counters live in Redis: the global breaker's is committed past its cap.
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match="mcpbg:v1:global_spend:*"))
        assert len(keys) == 1
        committed = int(client.hget(keys[0], "c") or 0)
        assert committed >= POLICY["global_spend"].cap
    finally:
        client.close()


@pytest.mark.slow
def test_demo_against_postgres(tmp_path: Path, postgres_url: str) -> None:
    from mcp_budget_governor import PostgresBackend

    out = tmp_path / "demo"
    proc = run_demo(out, "--postgres", postgres_url)
    check_outputs(proc, out)
    assert "Postgres at " in proc.stdout

    async def global_spend() -> list[int]:
        backend = PostgresBackend.from_url(postgres_url, timeout=10.0)
        keys = await backend.counter_keys(10, match="mcpbg:v1:global_spend:*")
        used = await backend.usage(keys)
        await backend.aclose()
        return used

    # The counters live in Postgres: the global breaker's is committed past its cap.
    (used,) = asyncio.run(global_spend())
    assert used >= POLICY["global_spend"].cap


@pytest.mark.slow
def test_demo_with_the_kafka_ledger(tmp_path: Path, redis_url: str) -> None:
    out = tmp_path / "demo"
    kafka = start_kafka()
    try:
        proc = run_demo(out, "--kafka", f"kafka://{kafka.bootstrap}", "--redis", redis_url)
    finally:
        kafka.stop()
    # The topic read back into the counters and archived; DuckDB reads the archive.
    check_outputs(proc, out, ledger="archive/date=*/*.parquet")
    assert "read back from Kafka topic mcpbg.demo." in proc.stdout
