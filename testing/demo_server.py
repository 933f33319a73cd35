"""``mcpbg demo --serve`` as a person runs it: a subprocess, its printed login link, and
the console it keeps serving (tests/test_demo_serve.py, tests/test_browser.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LINK = re.compile(r"open (http://\S+/login\?code=\S+)")


@dataclass
class DemoServing:
    link: str  # the one-time login link the demo printed
    base: str  # http://127.0.0.1:<port>
    out: Path
    printed: str  # everything the demo printed up to the link


@contextmanager
def demo_serving(out: Path, timeout: float = 600) -> Iterator[DemoServing]:
    """Run the quick start's second command on a free port; stopped (SIGTERM) at exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
    env["COLUMNS"] = "200"
    argv = [sys.executable, "-m", "mcp_budget_governor.cli", "demo", "--serve", "--port", "0"]
    proc = subprocess.Popen(
        [*argv, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:  # the demo's output, until the link (a thread: readline blocks)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if LINK.search(line):
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(timeout):
            raise AssertionError("mcpbg demo --serve printed no login link:\n" + "".join(lines))
        link = LINK.search(lines[-1])
        assert link is not None
        url = link.group(1)
        yield DemoServing(url, url.split("/login")[0], out, "".join(lines))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
