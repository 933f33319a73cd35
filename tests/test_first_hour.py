"""The defects a newcomer met in the first hour (issue 34), one test each.

Each runs the command as a person would (``mcpbg`` in this process, or a subprocess
where the point is what an install prints) and checks the one line they see.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testing.ledger_gen import write_archive
from testing.ledger_run import run_cli

pytest.importorskip("duckdb")


@pytest.fixture(scope="module")
def november(tmp_path_factory: pytest.TempPathFactory) -> Path:
    archive = tmp_path_factory.mktemp("nov") / "archive"
    write_archive(archive, 300, seed=5, month="2026-11")
    return archive


def test_costs_for_a_period_the_ledger_lacks_exits_2_like_export_focus(
    november: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "costs", "--archive-dir", str(november), "--period", "2026-03")
    assert (code, out) == (2, "")
    assert err == (
        "mcpbg costs: --period 2026-03: the ledger has no event in this period "
        "(it holds 2026-11-01 to 2026-11-30)\n"
    )
    csv = str(tmp_path / "f.csv")
    code, _, focus_err = run_cli(
        capsys, "export", "focus", "--archive-dir", str(november), "--period", "2026-03",
        "--out", csv,
    )  # fmt: skip
    assert code == 2
    assert focus_err.endswith(err.split(": ", 1)[1])  # one rule, one message
    code, out, _ = run_cli(capsys, "costs", "--archive-dir", str(november), "--period", "2026-11")
    assert code == 0 and "spend by tenant" in out.lower()


def test_costs_by_help_names_every_grouping(capsys: pytest.CaptureFixture[str]) -> None:
    from mcp_budget_governor.projections.costs import DIMENSIONS

    with pytest.raises(SystemExit):
        run_cli(capsys, "costs", "--help")
    text = " ".join(capsys.readouterr().out.split())
    by = text[text.index("--by BY") :]
    assert all(name in by for name in DIMENSIONS), by[:300]


@pytest.mark.parametrize(
    ("until", "says"),
    [
        ("2020-01-01", "--until: must be in the future (2020-01-01T00:00:00"),
        ("2020-01-01T10:00Z", "--until: must be in the future (2020-01-01T10:00:00+00:00)"),
        ("next tuesday", "--until: expected an ISO date or time (got 'next tuesday')"),
    ],
)
def test_a_bad_until_is_one_line_in_the_users_words(
    until: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = str(Path(__file__).parents[1] / "examples" / "policy.toml")
    code, _, err = run_cli(
        capsys, "caps", "set", "user_spend", "--user", "u1", "--cap-usd", "5",
        "--until", until, "--policy", policy, "--redis-url", "redis://127.0.0.1:1/0",
    )  # fmt: skip
    assert code == 2 and says in err and err.count("\n") == 1
    assert "datetime" not in err and "ZoneInfo" not in err


def test_the_admin_builder_names_a_past_until_as_iso_not_a_repr() -> None:
    from datetime import UTC, datetime

    from mcp_budget_governor.admin import _until
    from mcp_budget_governor.errors import InvalidInputError

    with pytest.raises(InvalidInputError) as caught:
        _until(datetime(2020, 1, 1, tzinfo=UTC), now=1.9e9)
    assert caught.value.value == "2020-01-01T00:00:00+00:00"


#: A count of four or more digits with no separator, outside dates, times, ids and money.
BARE_COUNT = re.compile(r"(?<![\w,.:$/-])\d{4,}(?![\w,.:%/-])")


def test_the_demo_prints_counts_with_thousands_separators(tmp_path: Path) -> None:
    from tests.test_demo import run_demo

    proc = run_demo(tmp_path / "demo")
    assert proc.returncode == 0, proc.stderr[-2000:]
    bare = BARE_COUNT.findall(proc.stdout)
    assert bare == [], bare
    assert re.search(r"\b\d{1,3}(,\d{3})+ refused\b", proc.stdout)


EXAMPLE = Path(__file__).parents[1] / "examples" / "policy.toml"


def test_the_docs_caps_commands_run_against_the_shipped_example_policy(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shlex

    text = (Path(__file__).parents[1] / "docs" / "policies.md").read_text()
    block = text[text.index("mcpbg caps set tenant_spend --tenant acme --cap-usd 500") :]
    lines = [ln.split("  #")[0] for ln in block[: block.index("```")].splitlines() if ln]
    assert len(lines) == 7
    monkeypatch.setenv("MCPBG_POLICY", str(EXAMPLE))
    monkeypatch.setenv("MCPBG_REDIS_URL", redis_url)
    for line in lines:
        code, _, err = run_cli(capsys, *shlex.split(line)[1:])
        assert code == 0, f"{line}: {err}"


def _meter_something(redis_url: str) -> None:
    import asyncio

    from mcp_budget_governor import Context, Governor, RedisBackend, usd
    from mcp_budget_governor.policy_file import load_policy

    async def go() -> None:
        backend = RedisBackend.from_url(redis_url)
        async with Governor(load_policy(str(EXAMPLE)), backend) as gov:
            await gov.meter("user_spend", usd("1.25"), Context(user="u_42", tenant="acme"))

    asyncio.run(go())


def test_budgets_list_prints_a_table_and_json_from_policy_toml_here(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    import json
    import shutil

    _meter_something(redis_url)
    monkeypatch.delenv("MCPBG_POLICY", raising=False)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "budgets", "list", "--redis-url", redis_url)
    assert code == 2 and err.count("\n") == 1
    assert "--policy: required" in err and "MCPBG_POLICY" in err and "policy.toml" in err
    shutil.copy(EXAMPLE, tmp_path / "policy.toml")  # the obvious default: ./policy.toml
    code, out, err = run_cli(capsys, "budgets", "list", "--redis-url", redis_url)
    assert code == 0, err
    assert "user_spend" in out and "$1.250000" in out and "u_42" in out
    code, out, _ = run_cli(capsys, "budgets", "list", "--json", "--redis-url", redis_url)
    (row,) = [r for r in json.loads(out)["rows"] if r["name"] == "user_spend"]
    assert row["spent"] == 1_250_000 and row["scope_values"] == {"user": "u_42"}


def test_budgets_reads_mcpbg_policy_from_anywhere(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    _meter_something(redis_url)
    monkeypatch.chdir(tmp_path)  # no policy.toml here
    monkeypatch.setenv("MCPBG_POLICY", str(EXAMPLE))
    code, out, err = run_cli(capsys, "budgets", "--redis-url", redis_url)
    assert code == 0 and "$1.250000" in out, err


@pytest.mark.parametrize("module", ["fastmcp", "lowlevel"])
def test_an_integration_without_its_extra_names_the_extra(module: str) -> None:
    """Installed without [fastmcp], the import says what to install (it said
    ``No module named 'mcp_types'``); run as a fresh interpreter would meet it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('mcp_types', 'fastmcp', 'mcp'): sys.modules[name] = None  # not installed\n"
        f"import mcp_budget_governor.integrations.{module}\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: mcp_budget_governor.integrations.")
    assert "pip install 'mcpbg[fastmcp]'" in last


def test_the_typescript_suite_alone_starts_its_own_redis_never_6379() -> None:
    """``npm test`` without pytest's Redis used the shared 127.0.0.1:6379 database 13;
    now it goes through scripts/test-services.mjs, which starts a private one."""
    import json
    import os
    import shutil
    import subprocess

    ts = Path(__file__).parents[1] / "ts"
    if shutil.which("node") is None or shutil.which("redis-server") is None:
        pytest.skip("node and redis-server are needed")  # scripts/test requires node
    assert "127.0.0.1:6379" not in (ts / "test" / "services.ts").read_text()
    script = json.loads((ts / "package.json").read_text())["scripts"]["test"]
    assert "node scripts/test-services.mjs tsx --test" in script
    env = {k: v for k, v in os.environ.items() if k != "MCPBG_TEST_REDIS_URL"}
    show = "console.log(process.env.MCPBG_TEST_REDIS_URL)"
    done = subprocess.run(
        ["node", "scripts/test-services.mjs", "node", "-e", show],
        cwd=ts, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    url = done.stdout.strip()
    assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", url) and ":6379/" not in url
    given = subprocess.run(
        ["node", "scripts/test-services.mjs", "node", "-e", show],
        cwd=ts, env={**env, "MCPBG_TEST_REDIS_URL": "redis://127.0.0.1:7777/3"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert given.stdout.strip() == "redis://127.0.0.1:7777/3"  # pytest's own, passed on


def test_scripts_test_help_answers_before_installing_anything(tmp_path: Path) -> None:
    import os
    import subprocess

    root = Path(__file__).parents[1]
    venv = tmp_path / "venv"  # where a first run would install
    env = {**os.environ, "MCPBG_VENV": str(venv)}
    for flag in ("--help", "-h"):
        done = subprocess.run(
            [str(root / "scripts" / "test"), flag], env=env, capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout.startswith("usage: scripts/test")
        assert "MCPBG_TEST_REDIS_URL" in done.stdout
    assert not venv.exists()


def _admits(node_range: str, major: int) -> bool:
    """Whether an npm ``engines.node`` range admits Node ``major`` (majors only)."""
    for alternative in node_range.split("||"):
        ok = True
        for op, version in re.findall(r"(>=|<=|>|<|\^|~|=)?\s*v?(\d+)(?:\.[\dx*]+)*", alternative):
            n = int(version)
            ok &= {
                ">=": major >= n, "<=": major <= n, ">": major > n, "<": major < n,
            }.get(op, major == n)  # ^, ~, = and a bare version pin the major
        if ok:
            return True
    return False


def test_every_locked_npm_package_runs_on_the_node_we_declare() -> None:
    """``npm ci`` warned EBADENGINE (pipenet, under fastmcp's mcp-proxy, wants Node 22)
    while ts/package.json declares Node >= 20."""
    import json

    ts = Path(__file__).parents[1] / "ts"
    declared = json.loads((ts / "package.json").read_text())["engines"]["node"]
    lowest = int(re.findall(r"\d+", declared)[0])
    lock = json.loads((ts / "package-lock.json").read_text())["packages"]
    refused = {
        name: meta["engines"]["node"]
        for name, meta in lock.items()
        if isinstance(meta.get("engines"), dict)
        and "node" in meta["engines"]
        and not _admits(meta["engines"]["node"], lowest)
    }
    assert refused == {}
    assert _admits(">=22.0.0", 22) and not _admits(">=22.0.0", 20)
    assert _admits("^18.18.0 || ^20.9.0 || >=21.1.0", 20)
