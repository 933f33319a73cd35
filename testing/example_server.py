"""examples/server.py as a test subprocess: its environment, start, health wait and stop.

The one setup ``tests/test_example_server.py`` and ``tests/test_policy_reload.py``
share: a policy file in the test's folder, a fresh ledger topic, the ``MCPBG_``
variables (nothing inherited), a free port, the log in ``server.log``.

>>> with example_server(tmp_path, POLICY, redis_url, bootstrap) as srv:  # doctest: +SKIP
...     srv.wait_health('"status":"ok"')
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from testing.services import free_port

ROOT = Path(__file__).resolve().parent.parent


class ExampleServer:
    """A running examples/server.py: its base URL, ledger topic, policy file and log."""

    def __init__(
        self, base: str, topic: str, policy: Path, log: Path, proc: subprocess.Popen[bytes]
    ) -> None:
        self.base, self.topic, self.policy, self.log, self.proc = base, topic, policy, log, proc

    def fail(self, problem: str) -> None:
        pytest.fail(f"{problem}:\n{self.log.read_text(errors='replace')[-3000:]}")

    def wait_health(self, want: str, within: float = 60.0) -> str:
        """Poll ``/health`` until its body holds ``want``; returns that body."""
        deadline = time.monotonic() + within
        body = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.fail(f"server exited {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as reply:
                    body = reply.read().decode()
                if want in body:
                    return body
            except OSError:
                pass
            time.sleep(0.1)
        self.fail(f"/health never said {want} (last: {body})")
        raise AssertionError  # pragma: no cover - pytest.fail raised

    def wait_log(self, text: str, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while text not in self.log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                self.fail(f"no {text!r} in the server's log")
            time.sleep(0.1)


@contextmanager
def example_server(
    tmp_path: Path, policy_text: str, redis_url: str, bootstrap: str, **env: str
) -> Iterator[ExampleServer]:
    """examples/server.py on a free port with ``policy_text`` as its policy file and
    ``env`` (``MCPBG_...``) added; terminated (killed after 15 s) on exit."""
    policy = tmp_path / "policy.toml"
    policy.write_text(policy_text)
    topic = f"ledger-{uuid.uuid4().hex[:10]}"
    variables = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
    variables.update(
        MCPBG_REDIS_URL=redis_url,
        MCPBG_KAFKA_URL=f"kafka://{bootstrap}",
        MCPBG_TOPIC=topic,
        MCPBG_POLICY=str(policy),
        MCPBG_OUTBOX_DIR=str(tmp_path / "outbox"),
        **env,
    )
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples/server.py"), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=variables,
        )
    try:
        yield ExampleServer(f"http://127.0.0.1:{port}", topic, policy, log, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
