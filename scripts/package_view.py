"""The package as it installs, as a folder of links: for tools that read source files
and cannot follow the editable install's import hook (mypy, the docs' API pages).

pyproject's ``package-dir`` installs top-level folders (``producers/``, ``edges/cli/``)
as subpackages of ``mcp_budget_governor``. ``python scripts/package_view.py DIR`` makes
``DIR/mcp_budget_governor`` with a link for each entry of the package folder and each
mapped folder, and prints ``view-path repository-path`` lines, longest first, so a
caller can print a tool's findings at their real paths.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "mcp_budget_governor"


def mapped() -> dict[str, str]:
    """Subpackage path in the view (``mcp_budget_governor/cli``) -> its folder (``edges/cli``)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name.replace(".", "/"): folder for name, folder in setuptools["package-dir"].items()}


def build(view: Path) -> dict[str, str]:
    """Make ``view/mcp_budget_governor`` afresh; returns :func:`mapped`."""
    shutil.rmtree(view, ignore_errors=True)
    package = view / PACKAGE
    package.mkdir(parents=True)
    for entry in (ROOT / PACKAGE).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    folders = mapped()
    for name, folder in folders.items():
        (view / name).symlink_to(ROOT / folder)
    return folders


def main() -> None:
    for name, folder in sorted(build(Path(sys.argv[1])).items(), key=lambda kv: -len(kv[0])):
        print(name, folder)


def on_startup(command: str, dirty: bool) -> None:
    """mkdocs hook (mkdocs.yml): the API pages read the package from ``build/package-view``,
    made before any plugin looks for it."""
    build(ROOT / "build" / "package-view")


if __name__ == "__main__":
    main()
