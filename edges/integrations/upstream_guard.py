"""Starts a stdio upstream so that it ends with ``mcpbg proxy`` however the proxy ends.

``python -m mcp_budget_governor.integrations.upstream_guard <proxy pid> -- cmd...``

The MCP SDK starts a stdio server in its own session, so a proxy killed with
SIGKILL would leave it running. This guard is what the SDK starts instead: it
asks Linux to send it SIGTERM when its parent (the proxy) dies
(``PR_SET_PDEATHSIG``; elsewhere a thread watches the parent pid), runs the
command in its own process group (the session the SDK made), and on SIGTERM,
SIGINT or SIGHUP passes the signal on, waits briefly, then kills the whole
group, so an ``npx`` and the ``node`` it started go too. The command inherits
stdin, stdout and stderr: the guard relays nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

#: Seconds the upstream has to stop after SIGTERM before its group is killed.
GRACE = 2.0
_PR_SET_PDEATHSIG = 1


def _watch_parent(parent: int, stop: threading.Event) -> None:
    """SIGTERM to this process once ``parent`` is gone (not Linux: polling)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
                return
        except (OSError, AttributeError):  # pragma: no cover - no prctl: poll instead
            pass

    def poll() -> None:  # pragma: no cover - Linux uses prctl
        while not stop.wait(0.5):
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=poll, daemon=True).start()  # pragma: no cover


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: upstream_guard <proxy pid> -- command [args...]", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[2:]
    stop = threading.Event()
    _watch_parent(parent, stop)
    if os.getppid() != parent:  # the proxy died before the watch began
        return 1
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"mcpbg proxy: cannot start the upstream {command[0]!r}: {exc}", file=sys.stderr)
        return 127

    def end(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + GRACE
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        # Whatever the upstream started (npx -> node) is in this group: all of it ends.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, end)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
