"""scripts/reference-suite's judgement: the guide lists every reference test that fails.

The run itself (download, unpack, pytest against a private Redis) is
``scripts/reference-suite``, which ``scripts/test`` runs before this suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testing import reference_suite as rs


def test_the_guide_lists_reference_test_ids_each_once() -> None:
    listed = rs.expected_failures()
    assert listed, "docs/migrating.md lists no reference test"
    text = rs.GUIDE.read_text(encoding="utf-8")
    for test in listed:
        assert test.startswith("tests/test_") and text.count(f"`{test}`") == 1, test


def test_a_failure_the_guide_lacks_fails_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = {"tests/test_a.py::T::one": "failed", "tests/test_a.py::T::two": "passed"}
    assert rs.judge(outcome, {"tests/test_a.py::T::one"}, full=True) == 0
    assert rs.judge(outcome, set(), full=True) == 1
    assert "FAILS, not in migrating.md: tests/test_a.py::T::one" in capsys.readouterr().err


def test_a_listed_test_that_passes_fails_a_full_run_only() -> None:
    outcome = {"tests/test_a.py::T::one": "passed"}
    assert rs.judge(outcome, {"tests/test_a.py::T::one"}, full=True) == 1
    assert rs.judge(outcome, {"tests/test_a.py::T::one"}, full=False) == 0


def test_junit_results_become_pytest_ids(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_keys.TestBucket" name="test_day[day-1]"/>'
        '<testcase classname="tests.test_keys" name="test_now"><failure/></testcase>'
        '<testcase classname="tests.test_x.T" name="test_s"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert rs.results(junit) == {
        "tests/test_keys.py::TestBucket::test_day[day-1]": "passed",
        "tests/test_keys.py::test_now": "failed",
        "tests/test_x.py::T::test_s": "skipped",
    }


def test_a_tampered_sdist_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCPBG_REFERENCE_CACHE", str(tmp_path))
    (tmp_path / rs.SDIST).write_bytes(b"not the sdist")
    with pytest.raises(SystemExit, match="expected " + rs.SHA256):
        rs.sdist()
    assert not (tmp_path / rs.SDIST).exists()
