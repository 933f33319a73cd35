"""One budget, two languages, on Postgres: a Python and a TypeScript governor on one database.

The TypeScript governor (``ts/test/cross/driver.ts``, as in
``tests/test_typescript_cross.py``) runs ``PostgresBackend`` from
``ts/src/backends/postgres.ts`` with every setting at its default, on the
database of the fixtures (``testing/postgres.py``), against Python's
``PostgresBackend``: both call the same ``sql/`` functions on the same rows, so
Python admitting 30 of a cap of 50 leaves TypeScript exactly 20, and both read
50; calls from both at once admit exactly the cap; and a database the
TypeScript side migrates first is the schema Python finds (the same
``mcpbg_migrations``, the same lock).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from mcp_budget_governor import Context, Governor, PostgresBackend
from mcp_budget_governor.policy_file import load_file
from mcp_budget_governor.sql import latest
from testing.buckets import room
from testing.node import Driver as Node
from testing.node import prepare_driver, typescript_postgres_bench
from testing.postgres import scratch_database

POLICY = """
[[limits]]
name = "shared"
cap = 50
window = "hour"
scope = "user"

[[limits]]
name = "race"
cap = 50
window = "hour"
scope = "tenant"
"""

SPREAD = 2.0  # seconds over which each side starts its concurrent calls


@pytest.fixture(scope="module")
def node_ready() -> None:
    prepare_driver()


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY, encoding="utf-8")
    return path


@pytest.fixture
def node(node_ready: None, policy_file: Path, postgres_url: str) -> Iterator[Node]:
    n = Node(policy_file, postgres_url)
    yield n
    n.close()


@pytest.fixture
async def python_gov(policy_file: Path, postgres_url: str) -> AsyncIterator[Governor]:
    gov = Governor(load_file(policy_file), PostgresBackend.from_url(postgres_url))
    yield gov
    await gov.aclose()


@pytest.mark.slow
async def test_python_admits_30_then_typescript_exactly_20_and_both_read_50(
    node: Node, python_gov: Governor
) -> None:
    ctx = {"user": "shared-budget"}
    await room(3600, needed=60)  # "shared" is per hour: every call in one bucket
    py = [await python_gov.check(Context(**ctx)) for _ in range(30)]
    assert [d.status for d in py] == [200] * 30
    assert not any(d.degraded for d in py)
    # 40 at once from TypeScript: exactly the 20 left.
    ts = node("checks", n=40, ctx=ctx)
    print(f"typescript: {ts['statuses'].count(200)} of 40 admitted after python's 30 (cap 50)")
    assert ts["statuses"].count(200) == 20
    assert set(ts["statuses"]) == {200, 429}
    assert ts["degraded"] == 0
    assert await python_gov.usage("shared", Context(**ctx)) == 50
    assert node("usage", limit="shared", ctx=ctx)["usage"] == 50
    assert (await python_gov.check(Context(**ctx))).status == 429


@pytest.mark.slow
async def test_concurrent_calls_from_both_languages_admit_exactly_the_cap(
    node: Node, python_gov: Governor
) -> None:
    ctx = {"tenant": "racing"}  # only "race" (50 per hour per tenant) applies
    await python_gov.check(Context(tenant="warm-up"))  # connected, migrated
    node("check", ctx={"tenant": "warm-up"})
    await room(3600, needed=SPREAD + 30)

    async def spread(i: int) -> int:
        await asyncio.sleep(i * SPREAD / 60)
        return (await python_gov.check(Context(**ctx))).status

    # 60 calls from each language, both started over the same 2 seconds, all concurrent.
    node.send("checks", n=60, spread_ms=SPREAD * 1000, ctx=ctx)
    py = await asyncio.gather(*(spread(i) for i in range(60)))
    ts = node.read()
    admitted = py.count(200) + ts["statuses"].count(200)
    print(f"concurrent: {admitted} of 120 admitted against cap 50 "
          f"(python {py.count(200)}, typescript {ts['statuses'].count(200)})")  # fmt: skip
    assert admitted == 50
    assert set(py) | set(ts["statuses"]) <= {200, 429}
    assert await python_gov.usage("race", Context(**ctx)) == 50
    assert node("usage", limit="race", ctx=ctx)["usage"] == 50


@pytest.mark.slow
async def test_a_database_typescript_migrated_is_the_one_python_uses(
    node_ready: None, policy_file: Path, postgres_server: str
) -> None:
    with scratch_database(postgres_server, prefix="mcpbg_ts_first") as url:
        node = Node(policy_file, url)
        try:
            assert node("check", ctx={"user": "first"})["status"] == 200  # migrates, then charges
            with psycopg.connect(url) as conn:
                versions = [r[0] for r in conn.execute("SELECT version FROM mcpbg_migrations")]
            assert sorted(versions) == list(range(1, latest() + 1))
            gov = Governor(load_file(policy_file), PostgresBackend.from_url(url))
            try:
                assert await gov.usage("shared", Context(user="first")) == 1
                assert (await gov.check(Context(user="first"))).status == 200
            finally:
                await gov.aclose()
            assert node("usage", limit="shared", ctx={"user": "first"})["usage"] == 2
        finally:
            node.close()


@pytest.mark.slow
def test_the_benchmark_hook_reads_the_typescript_figures(
    node_ready: None, postgres_url: str
) -> None:
    """benchmarks/bench_postgres.py's hook: ts/bench/postgres.ts runs and its JSON line
    parses (a few calls, both commit modes; the figures themselves are the benchmark's)."""
    for durable in (True, False):
        out = typescript_postgres_bench(postgres_url, calls=20, rounds=1, durable=durable)
        assert (out["bench"], out["durable"], out["calls"]) == ("ts_postgres_check", durable, 20)
        assert out["check_us"] > 0 and out["select1_us"] > 0
        assert out["ratio"] == pytest.approx(out["check_us"] / out["select1_us"], rel=0.01)
        assert "concurrent_ratio" not in out
    out = typescript_postgres_bench(postgres_url, calls=10, rounds=1, callers=8, seconds=0.3)
    assert out["callers"] == 8 and out["degraded"] == 0
    assert out["concurrent_checks_per_s"] > 0 and out["concurrent_select1_per_s"] > 0
