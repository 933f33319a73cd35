"""The repository layout: top-level architecture folders, one import name per module.

``producers/``, ``stream/``, ``projections/``, ``lua/``, ``sql/`` and the user-facing
``edges/`` (``cli``, ``console``, ``demo``, ``integrations``) sit at the top of the
repository and install as ``mcp_budget_governor.<name>`` (pyproject's ``package-dir``).
These tests hold that: no symlinks, no second identity, and the
wheel, the sdist and the Dockerfile's build context all carry the same package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Subpackage (``cli``) -> the repository folder it installs from (``edges/cli``).
_SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
MAPPED = {
    name.removeprefix("mcp_budget_governor."): folder
    for name, folder in _SETUPTOOLS["package-dir"].items()
}
FOLDERS = tuple(MAPPED.values())
SKIP = {
    ".git",
    ".venv",
    "node_modules",
    "build",
    "dist",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
}


def test_the_repository_holds_no_symlink() -> None:
    links = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP and not d.endswith(".egg-info")]
        links += [
            Path(dirpath, name).relative_to(ROOT)
            for name in dirnames + filenames
            if Path(dirpath, name).is_symlink()
        ]
    assert links == []


@pytest.mark.parametrize(("name", "folder"), MAPPED.items())
def test_a_folder_under_its_bare_name_cannot_be_imported(name: str, folder: str) -> None:
    # From the repository root, the folder is on sys.path as a plain package: the
    # guard in its __init__ refuses, so no class ever gets a second identity.
    run = subprocess.run(
        [sys.executable, "-c", f"import {folder.replace('/', '.')}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1
    bare = folder.replace("/", ".")
    assert f"ImportError: import mcp_budget_governor.{name}, not {bare}" in run.stderr


def test_each_module_has_one_identity() -> None:
    from mcp_budget_governor.producers import memory_ledger

    assert Path(memory_ledger.__file__).resolve() == ROOT / "producers" / "memory_ledger.py"
    assert memory_ledger.__name__ == "mcp_budget_governor.producers.memory_ledger"
    assert "producers" not in sys.modules
    assert "producers.memory_ledger" not in sys.modules


def test_the_package_ships_only_the_scripts_its_code_loads() -> None:
    # A benchmark-only script (testing/noop.lua) lives with the benchmark harness: listed in
    # SCRIPTS it would be shipped in the wheel and registered by production code.
    from mcp_budget_governor.lua import SCRIPTS

    # charge_many.lua is no script of its own: charge.lua's source goes into it (many_source).
    assert {p.stem for p in (ROOT / "lua").glob("*.lua")} == {*SCRIPTS, "lib", "charge_many"}
    code = "\n".join(
        p.read_text(encoding="utf-8")
        for folder in ("mcp_budget_governor", *FOLDERS)
        for p in (ROOT / folder).rglob("*.py")
    )
    assert [name for name in SCRIPTS if f'source("{name}")' not in code] == []
    assert "many_source()" in code


def test_the_package_ships_its_migrations_numbered_without_gaps() -> None:
    from mcp_budget_governor.sql import latest, migrations

    shipped = sorted(p.name for p in (ROOT / "sql").glob("*.sql"))
    assert shipped == [f"{m.version:04d}_{m.name}.sql" for m in migrations()]
    assert latest() == len(shipped)
    # Each function the backend calls is defined by a migration.
    code = (ROOT / "projections" / "counters" / "postgres.py").read_text(encoding="utf-8")
    text = "\n".join(m.text for m in migrations())
    import re

    called = set(re.findall(r"\b(mcpbg_[a-z_]+)\(", code)) - {"mcpbg_migrations"}
    assert called and [f for f in sorted(called) if f"FUNCTION {f}(" not in text] == []


def _build(context: Path, out: Path) -> tuple[Path, Path]:
    """An sdist of ``context``, then the wheel built from that sdist (python -m build)."""
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(context)],
        check=True,
        capture_output=True,
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def _check_wheel(wheel: Path, target: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {
        name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")
    }
    assert tops == {"mcp_budget_governor"}
    for name in MAPPED:
        assert f"mcp_budget_governor/{name}/__init__.py" in names
    assert "mcp_budget_governor/lua/apply.lua" in names
    assert "mcp_budget_governor/sql/0001_tables.sql" in names
    assert "mcp_budget_governor/sql/0002_functions.sql" in names
    assert "mcp_budget_governor/producers/outbox.py" in names
    assert "mcp_budget_governor/stream/alerts/evaluator.py" in names  # a subpackage of a folder
    # The installed copy works on its own, away from the repository.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    probe = (
        "import mcp_budget_governor.lua as lua, mcp_budget_governor.producers.outbox as o;"
        "import mcp_budget_governor.stream.worker, mcp_budget_governor.projections.counters.redis;"
        "assert 'redis.call' in lua.source('apply');"
        "import mcp_budget_governor.sql as sql; assert sql.latest() == len(sql.migrations());"
        "print(o.__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=target,
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == str(target / "mcp_budget_governor" / "producers" / "outbox.py")


@pytest.mark.slow
def test_the_sdist_and_its_wheel_carry_the_one_package(tmp_path: Path) -> None:
    sdist, wheel = _build(ROOT, tmp_path / "dist")
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    for folder in FOLDERS:
        assert f"{folder}/__init__.py" in members
    _check_wheel(wheel, tmp_path / "site")


def _dockerfile_copies() -> list[str]:
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            *srcs, _dest = line.split()[1:]
            sources += srcs
    return sources


@pytest.mark.slow
def test_the_dockerfile_copies_enough_to_build_the_image(tmp_path: Path) -> None:
    # No Docker engine here: replay the Dockerfile's COPY lines into a bare build
    # context and build the package from exactly that, as `pip install .` does there.
    context = tmp_path / "context"
    context.mkdir()
    for source in _dockerfile_copies():
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, context / source)
    assert {folder.split("/")[0] for folder in FOLDERS} <= set(_dockerfile_copies())
    _, wheel = _build(context, tmp_path / "dist")
    _check_wheel(wheel, tmp_path / "site")
