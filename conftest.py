"""The package's doctests, collected under its one import name.

``--doctest-modules`` (pyproject) imports every module of the package's folders
to run its examples. pytest would import ``producers/outbox.py`` as
``producers.outbox``, which the folder's guard refuses (one name per module), so
the package's files are imported here by the names pyproject's ``package-dir``
gives them (``mcp_budget_governor.producers.outbox``). Doctests are the
package's: other files (the tests, their support) are not imported for them.

A module whose optional extra is missing is skipped with the module it needs; a
missing module of the package itself still fails.
"""

from __future__ import annotations

import importlib
import tomllib
from collections.abc import Generator
from pathlib import Path
from types import ModuleType

import pytest
from _pytest.doctest import DoctestModule  # no public name; pytest's own collector

ROOT = Path(__file__).resolve().parent
PACKAGE = "mcp_budget_governor"


def _folders() -> dict[str, str]:
    """Repository folder -> the package it installs as (``stream`` -> ``...stream``)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {PACKAGE: PACKAGE}
    folders.update({folder: name for name, folder in setuptools["package-dir"].items()})
    return folders


FOLDERS = _folders()


def module_name(path: Path) -> str | None:
    """The import name of a file of the package, None for any other file."""
    try:
        parts = path.resolve().relative_to(ROOT).with_suffix("").parts
    except ValueError:
        return None
    # The longest folder that holds the file (edges/cli before edges).
    for depth in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:depth])
        if folder in FOLDERS:
            break
    else:
        return None
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((FOLDERS[folder], *parts[depth:]))


class PackageDoctests(DoctestModule):
    """pytest's doctest collector, importing the module by its installed name."""

    def _getobj(self) -> ModuleType:
        name = module_name(self.path)
        assert name is not None
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.partition(".")[0] != PACKAGE:
                pytest.skip(f"{name} needs {exc.name.partition('.')[0]} (an optional extra)")
            raise


@pytest.hookimpl(tryfirst=True)
def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    # A plain folder, not a pytest Package: a Package imports its __init__.py under
    # the folder's bare name (producers), which the guard refuses.
    if module_name(path / "__init__.py") is None:
        return None
    return pytest.Dir.from_parent(parent, path=path)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(
    file_path: Path, parent: pytest.Collector
) -> Generator[None, list[pytest.Collector | None], list[pytest.Collector | None]]:
    collected = yield
    if not any(type(c) is DoctestModule for c in collected):
        return collected
    doctests: list[pytest.Collector | None] = (
        [PackageDoctests.from_parent(parent, path=file_path)] if module_name(file_path) else []
    )
    return [c for c in collected if type(c) is not DoctestModule] + doctests
