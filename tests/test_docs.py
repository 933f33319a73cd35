"""The documentation: README.md fits a screen, the site builds strictly, every example runs.

Python blocks of README.md and docs/ are found and run by pytest-examples, each on its
own in a fresh module, as a newcomer pasting it into a file would run it (chosen over
sybil for that: sybil runs a page's blocks in one shared namespace, which hides the
block that uses a name only an earlier block defined). A block that talks to Redis or
Postgres says ``localhost`` and runs against this run's servers (the fixtures' URLs
are substituted; a compose hostname in a block fails the test). TypeScript blocks run
with node (tsx) against the package built from ts/. A block that only illustrates is
marked ``test="skip"`` in its fence and counted by :func:`test_few_blocks_are_only_illustrative`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from pytest_examples import CodeExample, EvalExample, find_examples

from testing.node import TS_DIR, npm_ci, tsx
from testing.stream_support import kafka

__all__ = ["kafka"]  # a fixture, used by name

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
#: Compose service names: a block that runs must never name them.
COMPOSE_HOSTS = re.compile(r"://(?:[^/@\s\"']*@)?(cache|db|redis|broker|kafka)[:/\"']")
LOCAL_REDIS = re.compile(r"redis://(?:localhost|127\.0\.0\.1)(?::\d+)?(?:/\d+)?")
LOCAL_POSTGRES = re.compile(r"postgresql://[^\s\"']*@?(?:localhost|127\.0\.0\.1)[^\s\"']*")
LOCAL_KAFKA = re.compile(r"kafka://(?:localhost|127\.0\.0\.1):\d+")
TS_FENCE = re.compile(r"^```(ts|typescript)([^\n]*)\n(.*?)^```", re.M | re.S)


def _python_examples() -> list[CodeExample]:
    return [ex for page in PAGES for ex in find_examples(page)]


def _ts_examples() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in TS_FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", m.group(2), m.group(3)))
    return found


def _illustrative(prefix: str) -> bool:
    return 'test="skip"' in prefix


PYTHON = _python_examples()
TYPESCRIPT = _ts_examples()


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
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    nav_pages = re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk == set(nav_pages), "every page of docs/ is in the nav, and only those"
    assert (tmp_path / "reference" / "api" / "index.html").read_text().count("Governor") > 10


def test_few_blocks_are_only_illustrative() -> None:
    """Most blocks run; the ones marked illustrative stay few (counted, not hidden)."""
    python_skipped = [str(ex) for ex in PYTHON if _illustrative(ex.prefix)]
    ts_skipped = [where for where, prefix, _ in TYPESCRIPT if _illustrative(prefix)]
    executed = len(PYTHON) + len(TYPESCRIPT) - len(python_skipped) - len(ts_skipped)
    print(f"examples: {executed} executed, {len(python_skipped) + len(ts_skipped)} illustrative")
    assert len(python_skipped) + len(ts_skipped) <= executed // 3, python_skipped + ts_skipped


def _localised(source: str, services: dict[str, str]) -> str:
    assert not COMPOSE_HOSTS.search(source), "a compose hostname in a block that runs"
    source = LOCAL_REDIS.sub(services["redis"], source)
    source = LOCAL_KAFKA.sub(services["kafka"], source)
    return LOCAL_POSTGRES.sub(services["postgres"], source)


@pytest.fixture
def services(request: pytest.FixtureRequest, redis_url: str) -> dict[str, str]:
    """This run's servers, the Postgres and Kafka ones started only for blocks naming them."""
    source = request.node.callspec.params["example"].source
    found = {"redis": redis_url, "postgres": "postgresql://unused", "kafka": "kafka://unused"}
    if "postgresql://" in source:
        found["postgres"] = str(request.getfixturevalue("postgres_url"))
    if "kafka://" in source:
        found["kafka"] = "kafka://" + request.getfixturevalue("kafka").bootstrap
    return found


@pytest.mark.parametrize("example", [ex for ex in PYTHON if not _illustrative(ex.prefix)], ids=str)
def test_every_python_block_runs(
    example: CodeExample,
    eval_example: EvalExample,
    services: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a block's files (policy.toml, ledgers) land here
    source = _localised(example.source, services)
    compile(source, str(example), "exec")  # an `await` outside a function, named plainly
    try:
        eval_example.run(dataclasses.replace(example, source=source))
    except (Exception, pytest.fail.Exception):  # its own report fails on a replaced source
        pytest.fail(f"{example} fails:\n{traceback.format_exc(limit=-6)}", pytrace=False)


@pytest.fixture(scope="module")
def built_package() -> Path:
    npm_ci()
    subprocess.run(["npm", "run", "build"], cwd=TS_DIR, check=True, capture_output=True)
    folder = TS_DIR / ".examples"  # inside ts/, so "mcp-budget-governor" resolves to it
    folder.mkdir(exist_ok=True)
    return folder


@pytest.mark.parametrize(
    ("where", "source"),
    [(w, s) for w, prefix, s in TYPESCRIPT if not _illustrative(prefix)],
    ids=[w for w, prefix, _ in TYPESCRIPT if not _illustrative(prefix)],
)
def test_every_typescript_block_runs(
    where: str,
    source: str,
    built_package: Path,
    redis_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """Each block runs to its end and exits on its own (a left-open client would hang)."""
    name = re.sub(r"\W", "_", where) + ".mts"
    script = built_package / name
    services = {"redis": redis_url, "postgres": "postgresql://unused", "kafka": "kafka://unused"}
    if "kafka://" in source:
        services["kafka"] = "kafka://" + request.getfixturevalue("kafka").bootstrap
    if "postgresql://" in source:
        services["postgres"] = str(request.getfixturevalue("postgres_url"))
    script.write_text(_localised(source, services))
    try:
        done = subprocess.run(
            [*tsx(), str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
    finally:
        script.unlink()
    assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_the_policy_reference_table_is_one_table_of_every_key_and_value() -> None:
    """One table (a blank line once split it in two), every key the loader accepts, and
    every ``on_exceed`` value (``ask`` was missing)."""
    from mcp_budget_governor.limits import OnExceed
    from mcp_budget_governor.policy_file import LIMIT_KEYS

    text = (DOCS / "policies.md").read_text()
    start = text.index("| key | where | value | default |")
    table = text[start:].split("\n\n")[0].splitlines()
    keys = {row.split("|")[1].strip().strip("`") for row in table[2:]}
    top = {"timezone", "anonymous", "[plans.<name>]", "[assign]"}
    assert keys == set(LIMIT_KEYS) | top
    on_exceed = next(row for row in table if row.startswith("| `on_exceed`"))
    assert all(f"`{v.value}`" in on_exceed for v in OnExceed), on_exceed


SHELL_FENCE = re.compile(r"^```(?:sh|bash|console)\n(.*?)^```", re.M | re.S)
IMPORTED = re.compile(r"\bfrom ([\w.]+) import ([\w, ]+)|\bimport ([\w.]+)")


def test_the_python_a_shell_snippet_imports_exists() -> None:
    """``python -c "..."`` in a shell block imports what the repository has (the FOCUS
    validator snippet imported from tests/ what lives in testing/)."""
    import importlib

    for page in PAGES:
        for block in SHELL_FENCE.findall(page.read_text()):
            for code in re.findall(r'python -c "(.*?)"', block, re.S):
                for module, names, plain in IMPORTED.findall(code):
                    found = importlib.import_module(module or plain)
                    for name in filter(None, (n.strip() for n in names.split(","))):
                        assert hasattr(found, name), f"{page.name}: {module}.{name}"


def test_the_install_page_lists_every_extra() -> None:
    """Each extra of pyproject.toml has its install line (``[fastmcp]`` was missing)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    page = (DOCS / "install.md").read_text()
    listed = {e for group in re.findall(r'"\.\[([\w,-]+)\]"', page) for e in group.split(",")}
    assert set(extras) - {"dev", "bench-clients"} - listed == set()
