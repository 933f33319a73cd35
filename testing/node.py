"""Node.js for the TypeScript package's tests: found, version-checked, dependencies installed.

The TypeScript sibling (``ts/``) needs Node 20 or newer. :func:`require_node`
says clearly what is missing instead of failing somewhere inside npm:

>>> import shutil
>>> require_node() if shutil.which("node") else None  # doctest: +SKIP
'/usr/bin/node'
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

#: The package's folder.
TS_DIR = Path(__file__).resolve().parent.parent / "ts"
#: The oldest Node.js major version the package supports (ts/package.json "engines").
MIN_NODE = 20


class NodeMissingError(RuntimeError):
    """Node.js or npm is not installed, or too old for the TypeScript package."""


def require_node() -> str:
    """The ``node`` executable, Node 20 or newer; :class:`NodeMissingError` otherwise."""
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        raise NodeMissingError(
            f"the TypeScript package (ts/) needs Node.js {MIN_NODE}+ with npm on the PATH: "
            "none found (install Node.js, e.g. apt-get install nodejs npm, or nodesource)"
        )
    version = subprocess.run(
        [node, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    major = int(version.lstrip("v").split(".")[0])
    if major < MIN_NODE:
        raise NodeMissingError(
            f"the TypeScript package (ts/) needs Node.js {MIN_NODE}+: {node} is {version}"
        )
    return node


def npm_ci(*, force: bool = False) -> None:
    """Install ts/'s dependencies from the committed lockfile (``npm ci``).

    Skipped when ``node_modules`` was installed from the current lockfile (its
    hidden lockfile is newer), unless ``force`` or ``MCPBG_FRESH_VENV=1`` (CI,
    which always installs from scratch).
    """
    require_node()
    installed = TS_DIR / "node_modules" / ".package-lock.json"
    fresh = force or os.environ.get("MCPBG_FRESH_VENV") == "1"
    if (
        not fresh
        and installed.exists()
        and installed.stat().st_mtime >= (TS_DIR / "package-lock.json").stat().st_mtime
    ):
        return
    subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund"], cwd=TS_DIR, check=True, env=os.environ.copy()
    )


def tsx() -> list[str]:
    """The command that runs a TypeScript file of ts/ (after :func:`npm_ci`)."""
    return [str(TS_DIR / "node_modules" / ".bin" / "tsx")]


def typescript_postgres_bench(
    url: str,
    *,
    calls: int = 2000,
    rounds: int = 5,
    durable: bool = True,
    callers: int = 0,
    seconds: float = 3.0,
) -> dict[str, Any]:
    """Serial ``check()`` of the TypeScript governor on Postgres (``ts/bench/postgres.ts``,
    3 limits, defaults but ``durable``), for ``benchmarks/bench_postgres.py``: its JSON
    line, medians in microseconds (``check_us``, ``select1_us``) and their ``ratio``;
    with ``callers``, also checks/s and ``SELECT 1``/s at that many concurrent callers
    (``concurrent_ratio``, ``degraded``)."""
    prepare_driver()
    done = subprocess.run(
        [*tsx(), "bench/postgres.ts", "--postgres", url, "--calls", str(calls),
         "--rounds", str(rounds), "--durable", "true" if durable else "false",
         "--callers", str(callers), "--seconds", str(seconds)],
        cwd=TS_DIR, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"ts/bench/postgres.ts: exit {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def prepare_driver() -> None:
    """What :class:`Driver` needs: Node, ts/'s dependencies, the copied scripts and SQL."""
    require_node()
    npm_ci()
    subprocess.run(["node", "scripts/copy-lua.mjs"], cwd=TS_DIR, check=True)


class Driver:
    """A TypeScript governor in its Node process (``ts/test/cross/driver.ts``), driven one
    JSON line at a time by the cross-language tests; ``url``: Redis or Postgres."""

    def __init__(self, policy: Path, url: str) -> None:
        self.proc = subprocess.Popen(
            [*tsx(), "test/cross/driver.ts", str(policy), url],
            cwd=TS_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        assert self.read() == {"ready": True}

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the TypeScript driver exited"
        answer: dict[str, Any] = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer

    def send(self, op: str, **fields: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def __call__(self, op: str, **fields: Any) -> dict[str, Any]:
        self.send(op, **fields)
        return self.read()

    def close(self) -> None:
        try:
            self("close")
        finally:
            self.proc.wait(timeout=30)
