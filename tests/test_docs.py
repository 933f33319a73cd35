"""The documentation: README.md fits a screen, the site builds strictly.

"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "ts" / "README.md"]

#: Every README section before the README moved to docs/, and the page that has it now.
MOVED_SECTIONS = {
    "Quick start": "install.md",
    "The integration": "integrations.md",
    "Installing": "install.md",
    "Redis or Postgres": "stores.md",
    "How it behaves": "policies.md",
    "FastMCP servers": "integrations.md",
    "Callers nobody can name": "integrations.md",
    "ASGI apps and the low-level MCP server": "integrations.md",
    "TypeScript": "typescript.md",
    "Policy files": "policies.md",
    "Reloading a policy file": "policies.md",
    "Caps per customer": "policies.md",
    "Concurrency caps": "policies.md",
    "The ledger": "ledger.md",
    "The stream worker": "ledger.md",
    "Which engine: aiokafka (default) or faust": "ledger.md",
    "The `mcpbg` command line": "operating.md",
    "What is spent: `mcpbg budgets`": "operating.md",
    "Rebuilding and reconciling the counters": "operating.md",
    "Querying the ledger": "costs.md",
    "Periods": "costs.md",
    "FOCUS export": "costs.md",
    "Money and prices": "policies.md",
    "Keys": "keys.md",
    "What Redis holds": "keys.md",
    "Migrating from mcp-budget-governor 0.1.0": "migrating.md",
    "Layout": "layout.md",
    "The operator console": "console.md",
    "Running it with Docker Compose": "operating.md",
    "Development": "install.md",
}
def test_the_readme_fits_a_screen_or_so() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400


def test_every_section_the_readme_had_is_a_heading_of_the_site() -> None:
    for title, page in MOVED_SECTIONS.items():
        headings = re.findall(r"^#+ (.+)$", (DOCS / page).read_text(), re.M)
        assert title in headings, f"{title!r} is no heading of docs/{page}"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link, a missing page or an unresolved API reference fails the build."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    nav_pages = re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk == set(nav_pages), "every page of docs/ is in the nav, and only those"
    assert (tmp_path / "reference" / "api" / "index.html").read_text().count("Governor") > 10
