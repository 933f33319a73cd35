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
