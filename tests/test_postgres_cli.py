"""``mcpbg budgets``, ``caps``, ``plans``, ``grant``, ``reset`` with ``--postgres URL``.

A cap, a plan and a grant set through the CLI on the Postgres the fixtures
find show in ``mcpbg budgets --postgres ... --json`` and ``caps list``, and a
governor on that Postgres enforces them; bad input is one line, exit 2.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mcp_budget_governor import Context, Governor, Policy, PostgresBackend
from mcp_budget_governor.cli import main

POLICY_TOML = """
[[limits]]
name = "tenant_calls"
cap = 3
window = "day"
scope = "tenant"

[[limits]]
name = "tenant_spend"
cap_usd = "25.00"
window = "day"
scope = "tenant"

[plans.pro]
tenant_calls = 6
"""


@pytest.fixture
def policy_file(tmp_path: pytest.TempPathFactory) -> str:
    path = tmp_path / "policy.toml"  # type: ignore[operator]
    path.write_text(POLICY_TOML)
    return str(path)


async def cli(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


async def admitted(gov: Governor, ctx: Context, tries: int) -> int:
    return sum([(await gov.check(ctx)).admitted for _ in range(tries)])


async def test_cli_changes_on_postgres_show_in_budgets_and_are_enforced(
    postgres_url: str, policy_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ("--policy", policy_file, "--postgres", postgres_url)
    assert await cli("caps", "set", "tenant_calls", *common, "--tenant", "gamma", "--cap", "5",
                     "--reason", "trial", "--actor", "ops") == 0  # fmt: skip
    assert await cli("grant", "tenant_calls", *common, "--tenant", "gamma", "--amount", "2",
                     "--reason", "goodwill") == 0  # fmt: skip
    assert await cli("plans", "assign", *common, "--tenant", "delta", "pro") == 0
    assert await cli("caps", "set", "tenant_spend", *common, "--tenant", "gamma",
                     "--cap-usd", "1.50") == 0  # fmt: skip
    capsys.readouterr()

    backend = PostgresBackend.from_url(postgres_url, timeout=10.0)
    gov = Governor(Policy.from_file(policy_file), backend)
    try:
        assert await admitted(gov, Context(tenant="gamma"), 9) == 7  # cap 5 + grant 2
        assert await admitted(gov, Context(tenant="delta"), 9) == 6  # the plan's cap
        assert await admitted(gov, Context(tenant="other"), 9) == 3  # the policy's

        assert await cli("budgets", *common, "--json") == 1  # every row is spent up
        rows = {
            (r["name"], r["scope_values"]["tenant"]): r
            for r in json.loads(capsys.readouterr().out)["rows"]
        }
        gamma = rows[("tenant_calls", "gamma")]
        assert (gamma["spent"], gamma["limit"], gamma["grant"]) == (7, 5, 2)
        assert gamma["limit_source"].startswith("run-time")
        assert gamma["exceeded"] is True
        delta = rows[("tenant_calls", "delta")]
        assert (delta["spent"], delta["limit"]) == (6, 6)
        assert delta["limit_source"] == "plan:pro (run-time)"
        assert rows[("tenant_calls", "other")]["limit"] == 3

        assert await cli("caps", "list", "--policy", policy_file, "--postgres", postgres_url,
                         "--json") == 0  # fmt: skip
        listed = json.loads(capsys.readouterr().out)
        assert sorted((r["kind"], r.get("limit", ""), r["scope"]) for r in listed) == [
            ("cap", "tenant_calls", "tenant=gamma"),
            ("cap", "tenant_spend", "tenant=gamma"),
            ("grant", "tenant_calls", "tenant=gamma"),
            ("plan", "", "tenant=delta"),
        ]
        cap = next(r for r in listed if r["kind"] == "cap" and r["limit"] == "tenant_spend")
        assert cap["cap"] == 1_500_000  # micros

        # A reset gives the room back (the spend stays); an unset restores the policy's cap.
        assert await cli("reset", "tenant_calls", *common, "--tenant", "delta") == 0
        assert await admitted(gov, Context(tenant="delta"), 9) == 6
        assert await gov.usage("tenant_calls", Context(tenant="delta")) == 12
        assert await cli("caps", "unset", "tenant_calls", *common, "--tenant", "gamma") == 0
        capsys.readouterr()
        assert await cli("caps", "list", *common, "--json") == 0
        listed = json.loads(capsys.readouterr().out)
        assert [r["limit"] for r in listed if r["kind"] == "cap"] == ["tenant_spend"]
    finally:
        await gov.aclose()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ("--postgres", "redis://localhost:6379/0"),
            "--postgres: expected postgresql://user@host:port/database "
            "(got 'redis://localhost:6379/0')",
        ),
        (("--postgres", "postgresql://postgres@127.0.0.1:1/x"), "unreachable: connection failed"),
        (
            ("--postgres", "postgresql://postgres@127.0.0.1:1/x", "--redis-url", "redis://h:1/0"),
            "--postgres: give --redis-url or --postgres, not both",
        ),
    ],
)
@pytest.mark.parametrize("command", ["budgets", "caps list", "grant"])
def test_bad_postgres_input_is_one_line_exit_2(
    policy_file: str,
    argv: tuple[str, ...],
    line: str,
    command: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = ("tenant_calls", "--tenant", "a", "--amount", "1") if command == "grant" else ()
    code = main([*command.split(), *extra, "--policy", policy_file, *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert line in err
