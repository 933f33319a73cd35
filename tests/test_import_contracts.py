"""The import contracts of pyproject.toml (checked by scripts/lint-imports) cover every
module of the core: a new module at the top of the package is on the core's floor and
among the modules that may import no adapter and no I/O library, or it would escape
both unseen."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mcp_budget_governor"


def _contracts() -> dict[str, dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _core_modules() -> set[str]:
    return {p.stem for p in (ROOT / PACKAGE).glob("*.py") if p.stem != "__init__"}


def test_every_core_module_stands_on_the_core_floor() -> None:
    layers = _contracts()["layers"]["layers"]
    assert isinstance(layers, list)
    floor = {name.strip() for name in layers[-1].split(":")}
    assert floor == _core_modules()


def test_every_core_module_is_forbidden_the_adapters_and_io() -> None:
    sources = _contracts()["core-pure"]["source_modules"]
    assert isinstance(sources, list)
    assert {s.removeprefix(f"{PACKAGE}.") for s in sources} == _core_modules()
