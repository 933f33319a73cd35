"""``mcpbg budgets`` and ``caps list`` on Redis Cluster, and the ``caps_refresh`` setting.

The same charges and run-time changes (through the CLI) on one Redis and on
the real cluster the fixture starts: the cluster's rows, read by a SCAN of
every master, are one Redis's rows, effective caps and their sources
included, with counters on each of the three masters. A cluster is never
wiped, so the limits, tenants and users carry a fresh tag.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from mcp_budget_governor import Context, Governor, Policy, RedisBackend
from mcp_budget_governor.projections.counters import cluster as cluster_module
from mcp_budget_governor.projections.counters.cluster import ClusterBackend
from mcp_budget_governor.urls import parse_cluster_url
from testing.ledger_run import run_cli
from testing.services import RedisClusterService

#: A projected exhaustion time as the budgets table prints it.
PROJECTED = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC")

POLICY_TOML = """
[[limits]]
name = "calls{tag}"
cap = 3
window = "day"
scope = "tenant"
caps = {{ "acme{tag}" = 4 }}

[[limits]]
name = "spend{tag}"
cap_usd = "25.00"
window = "day"
scope = "tenant"

[[limits]]
name = "burst{tag}"
cap = 100
window = "day"
scope = "user"

[[limits]]
name = "all{tag}"
cap = 1000
window = "day"

[[limits]]
name = "par{tag}"
cap = 1000
scope = "user"
unit = "concurrent"

[plans.pro]
"calls{tag}" = 6
"""


def _masters(service: RedisClusterService) -> list[tuple[int, int, int]]:
    host, port = parse_cluster_url(service.url)[0]
    slots = redis.Redis(host=host, port=port).execute_command("CLUSTER SLOTS")
    return [(int(start), int(end), int(master[1])) for start, end, master, *_ in slots]


def _owner(ranges: list[tuple[int, int, int]], key: str) -> int:
    slot = key_slot(key.encode())
    return next(port for start, end, port in ranges if start <= slot <= end)


def _tenants(tag: str, ranges: list[tuple[int, int, int]], n: int) -> list[str]:
    """``n`` tenants whose ``calls`` counters cover every master."""
    from mcp_budget_governor import planning
    from mcp_budget_governor.policy_file import loads

    policy = loads(POLICY_TOML.format(tag=tag))
    now = time.time()
    chosen: dict[int, list[str]] = {}
    for i in range(1000):
        tenant = f"t{i}{tag}"
        key = next(
            s.key
            for s in planning.check_slots(policy, Context(tenant=tenant), now)
            if s.limit.name == f"calls{tag}"
        )
        chosen.setdefault(_owner(ranges, key), []).append(tenant)
        if len(chosen) == 3 and sum(len(v) for v in chosen.values()) >= n:
            break
    picks = [v.pop(0) for v in chosen.values()]  # one on each master first
    rest = [t for v in chosen.values() for t in v]
    return (picks + rest)[:n]


def _workload(url: str, policy_file: Path, tenants: list[str], tag: str) -> None:
    """Checks and meters on the store at ``url``, after run-time changes made by the CLI."""
    gamma, delta = tenants[0], tenants[1]
    common = ("--policy", str(policy_file), "--redis-url", url)
    for argv in (
        ("caps", "set", f"calls{tag}", *common, "--tenant", gamma, "--cap", "5",
         "--reason", "trial", "--actor", "ops"),
        ("grant", f"calls{tag}", *common, "--tenant", gamma, "--amount", "2",
         "--reason", "goodwill", "--actor", "ops"),
        ("plans", "assign", *common, "--tenant", delta, "pro", "--actor", "ops"),
        ("caps", "set", f"spend{tag}", *common, "--tenant", gamma, "--cap-usd", "1.50",
         "--actor", "ops"),
    ):  # fmt: skip
        assert run_cli_quiet(*argv) == 0, argv

    async def go() -> None:
        backend = RedisBackend.from_url(url, timeout=5.0)
        gov = Governor(Policy.from_file(policy_file), backend)
        try:
            for i, tenant in enumerate([*tenants, f"acme{tag}"]):
                for n in range(9):
                    await gov.check(Context(tenant=tenant, user=f"u{(i + n) % 5}{tag}"))
                await gov.meter(f"spend{tag}", 1_000 * (i + 1), Context(tenant=tenant))
        finally:
            await gov.aclose()

    asyncio.run(go())


def run_cli_quiet(*argv: str) -> int:
    from mcp_budget_governor.cli import main

    return main(list(argv))


def _ours(rows: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """The ``caps list`` rows of this test (the cluster holds other tests' too)."""
    return [r for r in rows if tag in r.get("limit", "") or tag in r["scope"]]


def test_budgets_and_caps_list_on_the_cluster_show_what_one_redis_shows(
    redis_cluster: RedisClusterService,
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tag = uuid.uuid4().hex[:8]
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(POLICY_TOML.format(tag=tag))
    ranges = _masters(redis_cluster)
    tenants = _tenants(tag, ranges, 6)
    out: dict[str, tuple[dict[str, Any], list[dict[str, Any]], str]] = {}
    for name, url in (("redis", redis_url), ("cluster", redis_cluster.url)):
        _workload(url, policy_file, tenants, tag)
        capsys.readouterr()
        common = ("--policy", str(policy_file), "--redis-url", url)
        code, text, err = run_cli(capsys, "budgets", *common, "--json")
        assert code == 1 and not err, err  # some rows are spent up
        budgets = json.loads(text)
        code, text, err = run_cli(capsys, "caps", "list", *common, "--json")
        assert code == 0 and not err, err
        listed = _ours(json.loads(text), tag)
        code, table, err = run_cli(capsys, "budgets", *common)
        assert code == 1 and not err, err
        out[name] = (budgets, listed, table)

    one, many = out["redis"], out["cluster"]
    for a, b in zip(many[0]["rows"], one[0]["rows"], strict=True):
        # The forecast extrapolates this period's rate from the instant of each run, so
        # two runs seconds apart project a far-off cap minutes apart; the rest is equal.
        a, b = ({k: v for k, v in r.items() if k != "projected_exhaust_at"} for r in (a, b))
        assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    assert many[0]["listed_keys"] == one[0]["listed_keys"] and not many[0]["truncated"]
    assert many[1] == one[1]
    # The tables likewise, but for that projection (a time to the minute, which shifts
    # when a period has just begun: a run right after midnight UTC failed on it).
    table, one_table = (
        [PROJECTED.sub("<projected>", line) for line in t.splitlines()[1:]]
        for t in (many[2], one[2])
    )
    assert table == one_table  # the title line holds no time, but pads

    rows = {(r["name"], r["scope_values"].get("tenant")): r for r in many[0]["rows"]}
    # Counters on every master, each with its effective cap and where it comes from.
    keys = [r["key"] for r in many[0]["rows"]]
    assert {_owner(ranges, k) for k in keys} == {port for _, _, port in ranges}
    gamma = rows[(f"calls{tag}", tenants[0])]
    assert (gamma["spent"], gamma["limit"], gamma["grant"]) == (7, 5, 2)
    assert gamma["limit_source"] == "run-time"
    delta = rows[(f"calls{tag}", tenants[1])]
    assert (delta["spent"], delta["limit"], delta["limit_source"]) == (6, 6, "plan:pro (run-time)")
    acme = rows[(f"calls{tag}", f"acme{tag}")]
    assert (acme["spent"], acme["limit"], acme["limit_source"]) == (4, 4, "value")
    other = rows[(f"calls{tag}", tenants[2])]
    assert (other["spent"], other["limit"], other["limit_source"]) == (3, 3, "default")
    spend = rows[(f"spend{tag}", tenants[0])]
    assert (spend["limit"], spend["limit_source"]) == (1_500_000, "run-time")
    assert rows[(f"all{tag}", None)]["spent"] == sum(
        r["spent"] for r in many[0]["rows"] if r["name"] == f"calls{tag}"
    )
    # Calls in progress: the lease sets (every master's), one lease per admitted check.
    held = [r for r in many[0]["rows"] if r["name"] == f"par{tag}"]
    admitted = sum(r["spent"] for r in many[0]["rows"] if r["name"] == f"calls{tag}")
    assert len(held) == 5 and sum(r["spent"] for r in held) == admitted == 7 + 6 + 4 + 3 * 4
    assert sorted((r["kind"], r.get("limit", ""), r["scope"]) for r in many[1]) == [
        ("cap", f"calls{tag}", f"tenant={tenants[0]}"),
        ("cap", f"spend{tag}", f"tenant={tenants[0]}"),
        ("grant", f"calls{tag}", f"tenant={tenants[0]}"),
        ("plan", "", f"tenant={tenants[1]}"),
    ]


async def test_a_listing_walks_every_master(redis_cluster: RedisClusterService) -> None:
    """``counter_keys`` finds keys of every master, and stops at its limit."""
    tag = uuid.uuid4().hex[:8]
    ranges = _masters(redis_cluster)
    keys = [f"mcpbg:v1:walk{tag}:user=u{i}:20261203" for i in range(60)]
    assert {_owner(ranges, k) for k in keys} == {port for _, _, port in ranges}
    backend = ClusterBackend.from_url(redis_cluster.url, timeout=5.0)
    try:
        for key in keys:
            await backend.client.hset(key, "c", 1)
            await backend.client.expire(key, 600)
        pattern = f"mcpbg:v1:walk{tag}:*"
        assert await backend.counter_keys(1000, match=pattern) == sorted(keys)
        assert len(await backend.counter_keys(7, match=pattern)) == 7
    finally:
        await backend.client.delete(*keys)
        await backend.aclose()


# -- caps_refresh, a setting -----------------------------------------------------


@pytest.mark.parametrize(("raw", "shown"), [("-1", "-1.0"), ("soon", "'soon'"), ("inf", "inf")])
@pytest.mark.parametrize("command", ["budgets", "caps list"])
def test_a_bad_caps_refresh_is_one_line_naming_the_variable_before_any_client(
    raw: str,
    shown: str,
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(POLICY_TOML.format(tag="x"))

    def no_client(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cluster client was built")

    monkeypatch.setattr(cluster_module, "RedisCluster", no_client)
    monkeypatch.setenv("MCPBG_CAPS_REFRESH", raw)
    argv = [*command.split(), "--policy", str(policy_file)]
    code, out, err = run_cli(capsys, *argv, "--redis-url", "redis+cluster://127.0.0.1:1")
    assert code == 2 and not out
    assert err.count("\n") == 1, err
    assert "MCPBG_CAPS_REFRESH: expected " in err and f"(got {shown})" in err, err


def test_caps_refresh_from_the_environment_reaches_the_cluster_backend(
    redis_cluster: RedisClusterService, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from mcp_budget_governor.cli.counters_args import open_counters

    monkeypatch.setenv("MCPBG_CAPS_REFRESH", "0.25")
    backend = open_counters(argparse.Namespace(redis_url=redis_cluster.url, postgres_url=None))
    assert isinstance(backend, ClusterBackend) and backend._runtime.refresh == 0.25
    asyncio.run(backend.aclose())
    monkeypatch.delenv("MCPBG_CAPS_REFRESH")
    backend = open_counters(argparse.Namespace(redis_url=redis_cluster.url, postgres_url=None))
    assert isinstance(backend, ClusterBackend)
    assert backend._runtime.refresh == cluster_module.CAPS_REFRESH == 1.0
    asyncio.run(backend.aclose())


def test_a_bad_caps_refresh_in_code_is_refused_before_the_client_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mcp_budget_governor.errors import InvalidInputError

    def no_client(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cluster client was built")

    monkeypatch.setattr(cluster_module, "RedisCluster", no_client)
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidInputError, match=r"^caps_refresh: expected seconds >= 0"):
            RedisBackend.from_url("redis+cluster://127.0.0.1:1", caps_refresh=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match=r"^caps_refresh: "):
            RedisBackend.from_url("redis://127.0.0.1:1/0", caps_refresh=bad)  # type: ignore[arg-type]


async def test_the_worker_takes_caps_refresh_from_the_environment(
    redis_cluster: RedisClusterService,
) -> None:
    pytest.importorskip("aiokafka", reason="needs the stream extra")
    from mcp_budget_governor.stream.config import WorkerConfig
    from mcp_budget_governor.stream.projection import Projection

    config = WorkerConfig.from_env(
        {"MCPBG_KAFKA_URL": "k:9092", "MCPBG_CAPS_REFRESH": "0.25"}, redis_url=redis_cluster.url
    )
    projection = Projection(config, send=None, stopping=asyncio.Event())
    projection.start()
    backend = projection._backend
    try:
        assert isinstance(backend, ClusterBackend) and backend._runtime.refresh == 0.25
    finally:
        assert backend is not None
        await backend.aclose()
