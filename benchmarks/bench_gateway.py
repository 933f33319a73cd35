"""``mcpbg proxy`` over streamable HTTP against FastMCP's ungoverned ``create_proxy``.

Target (DESIGN.md's spirit, issue 37): a call through the governed proxy at most
1.05x the same call through the bare proxy, same upstream, same run. Both are
separate processes on loopback in front of ``testing/gateway_upstream.py``; the
governed one uses its defaults (in-process counters, the file ledger) and a
policy of two limits and a default price. Rounds alternate between the two, and
the ratio is of the median per-call times.

    .venv/bin/python -m benchmarks.bench_gateway [--calls 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from testing.services import free_port

ROOT = Path(__file__).resolve().parent.parent
POLICY = """
[[limits]]
name = "calls"
cap = 1_000_000_000
window = "day"
scope = "user"

[[limits]]
name = "spend"
cap_usd = "1000000"
window = "day"
scope = "user"
gated = false

[gateway]
default_cost_usd = "0.001"
[gateway.bearer]
"bench-token" = "bench"
"""
QUIET = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
BARE = (
    "import sys; from fastmcp.server import create_proxy; "
    "create_proxy(sys.argv[1]).run(transport='http', host='127.0.0.1', "
    "port=int(sys.argv[2]), show_banner=False)"
)


def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: exited {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer")


async def _time_calls(url: str, calls: int) -> float:
    from fastmcp import Client
    from fastmcp.client.transports import StreamableHttpTransport

    transport = StreamableHttpTransport(url, headers={"Authorization": "Bearer bench-token"})
    async with Client(transport) as c:
        await c.call_tool("echo", {"text": "warm"})
        start = time.perf_counter()
        for i in range(calls):
            r = await c.call_tool("echo", {"text": str(i)}, raise_on_error=False)
            assert not r.is_error, r
        return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mcpbg-bench-gateway-"))
    (tmp / "p.toml").write_text(POLICY)
    up, bare, governed = free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{up}/mcp"
    procs = [
        subprocess.Popen([sys.executable, str(ROOT / "testing" / "gateway_upstream.py"),
                          "--port", str(up)], **QUIET),
    ]  # fmt: skip
    try:
        _wait(upstream, procs[0])
        procs.append(subprocess.Popen([sys.executable, "-c", BARE, upstream, str(bare)],
                                      **QUIET))  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mcp_budget_governor.cli", "proxy", "--policy",
             str(tmp / "p.toml"), "--ledger-dir", str(tmp / "ledger"), "--upstream", upstream,
             "--listen", f"127.0.0.1:{governed}"], **QUIET))  # fmt: skip
        bare_url, governed_url = f"http://127.0.0.1:{bare}/mcp", f"http://127.0.0.1:{governed}/mcp"
        _wait(bare_url, procs[1])
        _wait(governed_url, procs[2])
        times: dict[str, list[float]] = {"create_proxy": [], "mcpbg proxy": []}
        for _ in range(args.rounds):
            times["create_proxy"].append(asyncio.run(_time_calls(bare_url, args.calls)))
            times["mcpbg proxy"].append(asyncio.run(_time_calls(governed_url, args.calls)))
        medians = {k: statistics.median(v) for k, v in times.items()}
        for name, value in medians.items():
            print(f"{name:14} {value * 1e3:8.3f} ms per call (median of {args.rounds} rounds)")
        ratio = medians["mcpbg proxy"] / medians["create_proxy"]
        print(f"ratio          {ratio:8.3f}x  (target <= 1.05x)")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=15)


if __name__ == "__main__":
    main()
