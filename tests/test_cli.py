"""``mcpbg`` as people run it: the real console script in a subprocess.

Bad input of every kind is one line on stderr and exit code 2, never a
traceback; tables escape control characters and fit 80 columns; ``--to``
includes its day; ``--version``; URLs shown without their passwords.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest
import redis

from mcp_budget_governor import (
    DISTRIBUTION,
    Context,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.cli import version
from mcp_budget_governor.cli.render import install_hint, print_table, printable
from mcp_budget_governor.money import format_dollars
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger

MCPBG = Path(sys.executable).with_name("mcpbg")
#: A caller id that would open a hyperlink and recolour the terminal if printed raw.
HOSTILE = "\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07\x1b[2J\x9b31m"
LONG = "customer-" + "x" * 70  # longer than an 80-column table allows
DAYS = {2: 1_100_000, 3: 2_345_678, 4: 3_000_001}  # day of 2026-11 -> USD micros metered


def mcpbg(
    *argv: str,
    env: dict[str, str] | None = None,
    stdout: int | None = subprocess.PIPE,
    module: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``mcpbg`` (or ``python -m mcp_budget_governor.cli``)."""
    command = [sys.executable, "-m", "mcp_budget_governor.cli"] if module else [str(MCPBG)]
    full_env = {**os.environ, **(env or {})}
    for name in [n for n in full_env if n.startswith("MCPBG_") and not n.startswith("MCPBG_T")]:
        del full_env[name]  # the commands read MCPBG_*: only what the test gives
    return subprocess.run(
        [*command, *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        timeout=120,
        check=False,
    )


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file ledger: each day of :data:`DAYS` metered, by a hostile and a long caller."""
    folder = tmp_path_factory.mktemp("cli") / "ledger"

    async def write() -> None:
        now = [0.0]
        gov = Governor(
            Policy.of(Limit("spend", cap=10**12, window=Window.DAY, unit=Unit.USD_MICROS)),
            MemoryBackend(),
            ledger=FileLedger(folder),
            prices=PriceTable(),
            clock=lambda: now[0],
        )
        async with gov:
            for day, micros in DAYS.items():
                now[0] = datetime(2026, 11, day, 12, tzinfo=UTC).timestamp()
                who = Context(user=HOSTILE if day == 3 else LONG, tenant="acme", tool="search")
                await gov.meter("spend", micros, who)

    asyncio.run(write())
    return folder


@pytest.fixture(scope="module")
def deep_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policy") / "deep.toml"
    path.write_text("x = " + "[" * 50_000 + "]" * 50_000 + "\n")
    return path


def _db_out_of_range(url: str) -> str:
    return url.rsplit("/", 1)[0] + "/9999"


#: (argv, where) for every bad input of the issue; ``{L}`` the ledger, ``{R}`` a real Redis,
#: ``{D}`` a database index that Redis lacks, ``{P}`` a policy nested 50,000 deep.
BAD: list[list[str]] = [
    ["costs", "--period", "9999-12", "--ledger-dir", "{L}"],
    ["costs", "--period", "99999-01", "--ledger-dir", "{L}"],
    ["costs", "--from", "9999-12-31", "--ledger-dir", "{L}"],
    ["costs", "--to", "0001-01-01T00:00+01:00", "--ledger-dir", "{L}"],
    ["costs", "--from", "1969-12-31", "--ledger-dir", "{L}"],
    ["costs", "--top", "many", "--ledger-dir", "{L}"],
    ["export", "focus", "--period", "9999-12", "--out", "{O}", "--ledger-dir", "{L}"],
    ["export", "focus", "--from", "2026-11-01", "--to", "9999-12-31", "--out", "{O}"],
    ["budgets", "--policy", "{P}", "--redis-url", "{R}"],
    ["worker", "--policy", "{P}", "--redis-url", "{R}", "--kafka-url", "kafka://127.0.0.1:1"],
    *(
        [command, *extra, "--redis-url", url]
        for command, extra in (
            ("budgets", ["--policy", "examples/policy.toml"]),
            ("reconcile", ["--ledger-dir", "{L}"]),
            ("replay", ["--source", "file", "--ledger-dir", "{L}"]),
        )
        for url in (
            "http://127.0.0.1:6379/0",
            "redis://127.0.0.1:99999/0",
            "redis://127.0.0.1:port/0",
            "redis://127.0.0.1:6379/first",
            "redis://127.0.0.1:6379/0?db=x",
            "{D}",
        )
    ),
    *(
        ["worker", "--redis-url", url, "--kafka-url", "kafka://127.0.0.1:1"]
        for url in ("http://127.0.0.1:6379/0", "redis://127.0.0.1:0/0", "redis://h:6379/-1")
    ),
    ["demo", "--redis", "ftp://127.0.0.1/0", "--out", "{O}"],
    ["demo", "--redis", "{D}", "--out", "{O}"],
    ["schema", "--type", "nope"],
    [],
]
#: Commands whose reader went away (``mcpbg schema | head -1``): stdout is a closed pipe.
PIPED: list[list[str]] = [
    ["schema"],
    ["costs", "--ledger-dir", "{L}"],
    ["sql", "SELECT * FROM range(100000)", "--ledger-dir", "{L}"],
    ["sql", "SELECT * FROM range(100000)", "--csv", "--ledger-dir", "{L}"],
]


def _fill(argv: list[str], ledger: Path, redis_url: str, deep: Path, tmp: Path) -> list[str]:
    values = {
        "{L}": str(ledger),
        "{R}": redis_url,
        "{D}": _db_out_of_range(redis_url),
        "{P}": str(deep),
        "{O}": str(tmp / "out.csv"),
    }
    root = Path(__file__).resolve().parent.parent
    return [values.get(a, str(root / a) if a.startswith("examples/") else a) for a in argv]


def assert_one_line(result: subprocess.CompletedProcess[str]) -> str:
    err = result.stderr
    assert result.returncode == 2, (result.returncode, err)
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1 and err.startswith("mcpbg"), err
    return err


@pytest.mark.parametrize("argv", BAD, ids=lambda a: " ".join(a)[:70])
def test_bad_input_is_one_line_and_exit_code_2(
    argv: list[str], ledger: Path, redis_url: str, deep_policy: Path, tmp_path: Path
) -> None:
    err = assert_one_line(mcpbg(*_fill(argv, ledger, redis_url, deep_policy, tmp_path)))
    assert not (tmp_path / "out.csv").exists()
    # Each has its own message naming what was wrong, not the last-resort "SomeError: ...".
    assert not re.match(r"mcpbg [a-z]+: [A-Za-z]+(Error|Exception): ", err), err
    if "{D}" in argv:
        assert "--redis" in err and "DB index is out of range" in err, err
    print(err, end="")


@pytest.mark.parametrize("argv", PIPED, ids=lambda a: " ".join(a)[:40])
def test_a_closed_pipe_is_one_line_and_exit_code_2(
    argv: list[str], ledger: Path, redis_url: str, deep_policy: Path, tmp_path: Path
) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader left before the first line, as `| head` does eventually
    try:
        result = mcpbg(*_fill(argv, ledger, redis_url, deep_policy, tmp_path), stdout=write)
    finally:
        os.close(write)
    assert "broken pipe" in assert_one_line(result)


def test_the_module_runs_like_the_console_script(ledger: Path) -> None:
    result = mcpbg("costs", "--period", "9999-12", "--ledger-dir", str(ledger), module=True)
    assert assert_one_line(result) == "mcpbg costs: --period: ends past year 9999 (got '9999-12')\n"


def test_version() -> None:
    from importlib.metadata import version as installed

    result = mcpbg("--version")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"mcpbg {installed('mcpbg')}\n" == f"mcpbg {version()}\n"


def test_the_distribution_name_is_pyprojects() -> None:
    """Install hints and --version name the distribution pyproject.toml builds."""
    import tomllib

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    with pyproject.open("rb") as f:
        project = tomllib.load(f)["project"]
    assert project["name"] == DISTRIBUTION and project["license"] == "MIT"
    assert install_hint("duckdb") == "pip install 'mcpbg[duckdb]'"


# -- tables for people ---------------------------------------------------------------


def test_tables_escape_control_characters(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(HOSTILE, ["user\x1b[8m", "usd"], [[HOSTILE, "$1.000000"]], numeric=["usd"])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert out.count(printable(HOSTILE)) == 2 and "user\\x1b[8m" in out
    assert printable(HOSTILE) == HOSTILE.encode("unicode_escape").decode("ascii")


def test_commands_print_caller_ids_escaped(ledger: Path) -> None:
    costs = mcpbg("costs", "--ledger-dir", str(ledger), "--by", "user")
    query = 'SELECT chr(27) || \']0;owned\' || chr(7) AS "x\x1b[1m", "user" FROM costs'
    sql = mcpbg("sql", query, "--ledger-dir", str(ledger))
    for result in (costs, sql):
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    assert "\\x1b]8;;http://evil.example/\\x07click" in costs.stdout
    assert "\\x1b]0;owned\\x07" in sql.stdout and "x\\x1b[1m" in sql.stdout


def test_tables_fit_80_columns_and_never_split_an_amount(ledger: Path) -> None:
    result = mcpbg("costs", "--ledger-dir", str(ledger), env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    for micros in (*DAYS.values(), sum(DAYS.values())):
        assert format_dollars(micros) in result.stdout  # whole, on one line
    amounts = re.findall(r"\$[0-9.]+", result.stdout)
    assert amounts and all(re.fullmatch(r"\$\d+\.\d{6}", a) for a in amounts), amounts


# -- --to includes its day -----------------------------------------------------------


def test_costs_to_includes_its_day(ledger: Path) -> None:
    result = mcpbg(
        *("costs", "--from", "2026-11-03", "--to", "2026-11-03", "--by", "day", "--json"),
        *("--ledger-dir", str(ledger)),
    )
    assert result.returncode == 0, result.stderr
    (rows,) = json.loads(result.stdout).values()
    assert [(r["day"], r["usd_micros"]) for r in rows] == [("2026-11-03", DAYS[3])]
    both = mcpbg(
        *("costs", "--from", "2026-11-02", "--to", "2026-11-03", "--json"),
        *("--ledger-dir", str(ledger)),
    )
    summary = next(iter(json.loads(both.stdout).values()))
    assert summary[0]["usd_micros"] == DAYS[2] + DAYS[3]


def test_export_to_includes_its_day(ledger: Path, tmp_path: Path) -> None:
    import csv

    for granularity in ("day", "hour"):
        out = tmp_path / f"{granularity}.csv"
        result = mcpbg(
            *("export", "focus", "--from", "2026-11-03", "--to", "2026-11-03", "--quiet"),
            *("--granularity", granularity, "--ledger-dir", str(ledger), "--out", str(out)),
        )
        assert result.returncode == 0, result.stderr
        with out.open(newline="") as f:
            rows = list(csv.DictReader(f))
        assert {r["ChargePeriodStart"][:10] for r in rows} == {"2026-11-03"}
        assert sum(Decimal(r["BilledCost"]) for r in rows) * 10**6 == DAYS[3]


# -- URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:1/0",
        "redis://127.0.0.1:1/0?password=s3cret",
        "redis://user:s3cret@127.0.0.1:1/first",
        "redis://127.0.0.1:99999/0?password=s3cret",
    ],
)
def test_a_password_in_a_url_is_never_shown(url: str, ledger: Path) -> None:
    result = mcpbg("reconcile", "--ledger-dir", str(ledger), "--redis-url", url)
    err = assert_one_line(result)
    assert "s3cret" not in err and "***" in err, err


def test_budgets_stopped_early_still_exits_1_and_says_partial(
    redis_url: str, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    policy = tmp_path / "p.toml"
    policy.write_text('[[limits]]\nname = "calls"\ncap = 1\nwindow = "day"\nscope = "user"\n')

    async def spend() -> None:
        from mcp_budget_governor import RedisBackend

        async with Governor(
            Policy.of(Limit("calls", cap=1, window=Window.DAY, scope=Scope.USER)),
            RedisBackend.from_url(redis_url),
        ) as gov:
            for user in ("a", "b", "c"):
                await gov.check(Context(user=user))

    asyncio.run(spend())
    assert len(client.keys("mcpbg:v1:calls:*")) == 3
    client.close()
    result = mcpbg("budgets", "--policy", str(policy), "--redis-url", redis_url, "--max-keys", "2")
    assert result.returncode == 1, result.stderr
    assert result.stdout.count(" yes ") == 2 and "listing stopped at 2 keys" in result.stdout


def test_a_missing_optional_dependency_names_its_extra(tmp_path: Path) -> None:
    """A new user's `scripts/demo --postgres URL` on an install without psycopg: one line
    naming the extra that brings it, not "ModuleNotFoundError: No module named ..."."""
    code = (
        "import sys; sys.modules['psycopg'] = None; sys.modules['psycopg_pool'] = None\n"
        "from mcp_budget_governor.cli import main\n"
        f"sys.exit(main(['demo', '--postgres', 'postgresql://u@127.0.0.1:1/d', "
        f"'--out', {str(tmp_path / 'out')!r}]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    err = assert_one_line(result)
    assert "psycopg is not installed; install the postgres extra: pip install" in err, err
