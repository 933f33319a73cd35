"""The package's doctests run in the suite (root conftest.py), under the one import name.

Run in a child pytest so that what it imports (or refuses to) stays out of this one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["mcp_budget_governor", "edges", "producers", "stream", "projections", "lua"]
#: The optional extras' modules; the core needs none of them.
EXTRAS = [
    "duckdb",
    "pyarrow",
    "aiokafka",
    "aiohttp",
    "fastmcp",
    "rich",
    "redis",
    "prometheus_client",
    "faust",
]


def _pytest(*args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for name in {list(block)!r}: sys.modules[name] = None  # import raises\n"
        "import pytest\n"
        f"sys.exit(pytest.main({['-p', 'no:cacheprovider', *args]!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_doctests_of_every_folder_are_collected_by_the_package_name() -> None:
    run = _pytest("--collect-only", "-q", *FOLDERS)
    assert run.returncode == 0, run.stdout + run.stderr
    ids = run.stdout.splitlines()
    assert "producers/emit.py::mcp_budget_governor.producers.emit" in ids
    assert "stream/alerts/__init__.py::mcp_budget_governor.stream.alerts" in ids
    assert "projections/ledger_view.py::mcp_budget_governor.projections.ledger_view" in ids
    assert "mcp_budget_governor/governor.py::mcp_budget_governor.governor" in ids
    # Only the package's modules: the tests are not imported a second time for doctests.
    assert not [i for i in ids if i.startswith("tests/")]


def test_a_module_whose_extra_is_missing_is_skipped_not_an_error() -> None:
    run = _pytest("-q", "-rs", *FOLDERS, block=tuple(EXTRAS))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mcp_budget_governor.projections.ledger_view needs duckdb (an optional extra)" in (
        run.stdout
    )
    assert "mcp_budget_governor.stream.worker needs aiokafka (an optional extra)" in run.stdout
    summary = run.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" in summary and "error" not in summary
