"""Run the reference package's own test suite, unchanged, against this package.

The reference governor (``mcp-budget-governor`` 0.1.0 on PyPI) ships its tests in
its sdist. They are its authors' code, so they are never copied into this
repository: the sdist is downloaded (once, then cached), checked against the
sha256 pinned here, and its ``tests/`` unpacked into a temporary folder that is
deleted afterwards. They run against the installed ``mcp_budget_governor`` (ours)
with a real Redis (``MCPBG_TEST_REDIS_URL``, else a private server on a free
port, as the suite's fixtures start one), so every test runs on both the memory
backend and Redis.

The tests still failing are listed, by id, in ``docs/migrating.md`` (each with
its reason): this run fails when another one fails (a change broke a migrating
user) or when a listed one passes (the guide is out of date).

``python -m testing.reference_suite [pytest args]`` from the repository root
(``scripts/reference-suite``).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

DISTRIBUTION = "mcp-budget-governor"
VERSION = "0.1.0"
SDIST = "mcp_budget_governor-0.1.0.tar.gz"
#: sha256 of the sdist PyPI serves for 0.1.0 (checked on every run, cached or not).
SHA256 = "faec64842a5ebd4aecd0b1090dfa100cea41829ef1e7d8c011590481ead3d814"

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "migrating.md"
#: A reference test id as the guide writes it: ``tests/test_x.py::Class::test[param]``.
_TEST_ID = re.compile(r"`(tests/test_\w+\.py::[\w:\[\]\-]+)`")


def cache_dir() -> Path:
    """Where the sdist is kept between runs (so a rerun needs no network)."""
    configured = os.environ.get("MCPBG_REFERENCE_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("MCPBG_VENV", ROOT / ".venv")) / "reference-sdist"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sdist() -> Path:
    """The pinned sdist, downloaded through pip into the cache if not there yet."""
    folder = cache_dir()
    path = folder / SDIST
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--no-binary", ":all:", f"{DISTRIBUTION}=={VERSION}", "-d", str(folder),
            ],
            check=True,
        )  # fmt: skip
    found = _digest(path)
    if found != SHA256:
        path.unlink()
        raise SystemExit(
            f"reference-suite: {path.name} has sha256 {found}, expected {SHA256}: "
            "deleted it; the index served a different file than the one pinned"
        )
    return path


def unpack_tests(archive: Path, into: Path) -> Path:
    """Extract only the sdist's ``tests/`` into ``into``; return that folder."""
    prefix = f"{SDIST.removesuffix('.tar.gz')}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for member in members:
            member.name = member.name.removeprefix(f"{SDIST.removesuffix('.tar.gz')}/")
        tar.extractall(into, members=members, filter="data")
    return into / "tests"


def expected_failures(guide: Path = GUIDE) -> set[str]:
    """The reference test ids the migration guide lists as still failing."""
    return set(_TEST_ID.findall(guide.read_text(encoding="utf-8")))


def results(junit: Path) -> dict[str, str]:
    """Test id -> ``passed``, ``failed`` or ``skipped``, from pytest's JUnit XML."""
    outcome: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # classname is tests.test_x[.Class]: back to the id pytest prints.
        path = "/".join(parts[:2]) + ".py"
        test_id = "::".join([path, *parts[2:], case.get("name", "")])
        if case.find("failure") is not None or case.find("error") is not None:
            outcome[test_id] = "failed"
        elif case.find("skipped") is not None:
            outcome[test_id] = "skipped"
        else:
            outcome[test_id] = "passed"
    return outcome


def run(pytest_args: list[str], redis_url: str) -> int:
    """Run the suite against ``redis_url``; 0 when only the listed tests fail."""
    archive = sdist()
    with tempfile.TemporaryDirectory(prefix="mcpbg-reference-") as tmp:
        folder = Path(tmp)
        unpack_tests(archive, folder)
        junit = folder / "junit.xml"
        # The reference's own pytest settings (asyncio_mode=auto), none of ours:
        # the run starts from the temporary folder with an empty config.
        (folder / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
        env = {**os.environ, "MCPBG_TEST_REDIS_URL": redis_url}
        command = [
            sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
            "-p", "no:randomly", f"--junitxml={junit}", "--timeout=120", *pytest_args,
        ]  # fmt: skip
        subprocess.run(command, cwd=folder, env=env, check=False)
        if not junit.is_file():
            print("reference-suite: pytest wrote no results", file=sys.stderr)
            return 2
        outcome = results(junit)
    return judge(outcome, expected_failures(), full=not pytest_args)


def judge(outcome: dict[str, str], listed: set[str], *, full: bool) -> int:
    """Print the tally; 1 when a test fails that the guide does not list, or when
    (on a full run) a listed one no longer fails."""
    passed = sum(1 for v in outcome.values() if v == "passed")
    failed = sorted(k for k, v in outcome.items() if v == "failed")
    print(
        f"reference-suite: {passed} of {len(outcome)} reference tests pass "
        f"({len(failed)} fail, {len(outcome) - passed - len(failed)} skipped)"
    )
    status = 0
    unlisted = [t for t in failed if t not in listed]
    for test in unlisted:
        print(f"  FAILS, not in {GUIDE.name}: {test}", file=sys.stderr)
        status = 1
    if full:
        for test in sorted(listed - set(failed)):
            print(f"  listed in {GUIDE.name} as failing but {outcome.get(test, 'absent')}: "
                  f"{test} (remove it from the guide)", file=sys.stderr)  # fmt: skip
            status = 1
    return status


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from testing.services import ENV_VAR, start_redis

    # The reference's fixtures flush their database before every test: a database
    # given by MCPBG_TEST_REDIS_URL must be empty (claimed), else a private server.
    with (
        start_redis(prefer_local=not os.environ.get(ENV_VAR)) as service,
        service.claimed() as url,
    ):
        return run(argv, url)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
