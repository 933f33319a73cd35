"""``mcpbg proxy``: an MCP server you do not own, governed (docs/gateway.md).

Real processes: the official MCP Python client drives ``mcpbg proxy`` over
stdio in front of ``testing/gateway_upstream.py``; four HTTP proxies share one
Redis in front of one HTTP upstream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mcp_budget_governor import Limit, Policy, Unit, Window, usd
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.gateway import GatewayConfig
from testing.services import free_port

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = [sys.executable, str(ROOT / "testing" / "gateway_upstream.py")]
MCPBG = [sys.executable, "-m", "mcp_budget_governor.cli"]

# A cap of 3 calls per user and tool; the prices of [gateway], not the upstream's.
POLICY = """
[[limits]]
name = "per_tool"
cap = 3
window = "day"
scope = ["user", "tool"]

[[limits]]
name = "spend"
cap_usd = "10"
window = "day"
scope = "user"
gated = false

[gateway]
default_cost_usd = "0.01"
[gateway.tools]
"pri*" = "0.50"
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
    env.update(HOME=str(tmp_path / "home"), UPSTREAM_CALLS=str(tmp_path / "calls"), **extra)
    return env


def _seen(tmp_path: Path) -> list[str]:
    calls = tmp_path / "calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_stdio_proxy_with_the_official_client(tmp_path: Path) -> None:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    (tmp_path / "p.toml").write_text(POLICY)
    env = _env(tmp_path, MCPBG_USER="alice", UPSTREAM_SECRET="sk-from-the-client")
    params = StdioServerParameters(
        command=MCPBG[0],
        args=[*MCPBG[1:], "proxy", "--policy", str(tmp_path / "p.toml"), "--", *UPSTREAM],
        env=env,
    )

    async def drive() -> list[Any]:
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            listed = [t.name for t in (await s.list_tools()).tools]
            assert listed == ["echo", "priced", "env"]
            results = [await s.call_tool("echo", {"text": f"hi{i}"}) for i in range(5)]
            results.append(await s.call_tool("priced", {"text": "x"}))
            results.append(await s.call_tool("env", {"name": "UPSTREAM_SECRET"}))
            return results

    results = asyncio.run(drive())
    texts = [r.content[0].text for r in results]
    assert [r.is_error for r in results[:5]] == [False, False, False, True, True]
    assert texts[:3] == ["hi0", "hi1", "hi2"]
    for text in texts[3:5]:
        assert text.startswith("budget_exceeded:user+tool/day limit=per_tool status=429")
        assert "Rate limited by limit 'per_tool'" in text
    assert texts[6] == "sk-from-the-client"  # the client's environment reached the upstream
    assert [line.split()[1] for line in _seen(tmp_path)] == ["echo"] * 3 + ["priced", "env"]

    ledger = tmp_path / "home" / ".mcpbg" / "ledger"  # the default file ledger
    out = subprocess.run(
        [*MCPBG, "costs", "--ledger-dir", str(ledger), "--by", "tool", "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    rows = {row["tool"]: row for row in json.loads(out.stdout)["spend by tool"]}
    # The policy's prices: 3 x $0.01 for echo; $0.50 for priced, not its own $0.000001.
    assert (rows["echo"]["calls"], rows["echo"]["rejected"]) == (3, 2)
    assert rows["echo"]["usd"] == "0.030000"
    assert rows["priced"]["usd"] == "0.500000"


def _rpc(proc: subprocess.Popen[bytes], message: dict[str, Any]) -> dict[str, Any] | None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(message) + "\n").encode())
    proc.stdin.flush()
    if "id" not in message:
        return None
    while True:
        reply = json.loads(proc.stdout.readline())
        if reply.get("id") == message["id"]:
            return dict(reply)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_upstream_ends_with_the_proxy(tmp_path: Path, sig: signal.Signals) -> None:
    (tmp_path / "p.toml").write_text(POLICY)
    proc = subprocess.Popen(
        [*MCPBG, "proxy", "--policy", str(tmp_path / "p.toml"), "--", *UPSTREAM],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=_env(tmp_path, MCPBG_USER="alice"),
    )  # fmt: skip
    try:
        _rpc(proc, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"}}})  # fmt: skip
        _rpc(proc, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        reply = _rpc(proc, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                            "params": {"name": "echo", "arguments": {"text": "up"}}})  # fmt: skip
        assert reply is not None and "result" in reply, reply
        upstream = int(_seen(tmp_path)[0].split()[0])
        assert _alive(upstream)
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(upstream) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(upstream), f"upstream {upstream} outlived the proxy ({sig.name})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_http(url: str, proc: subprocess.Popen[bytes], within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url}: the process exited {proc.returncode}"
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer")


def test_four_http_proxies_share_a_cap_of_100(tmp_path: Path, redis_url: str) -> None:
    from fastmcp import Client
    from fastmcp.client.transports import StreamableHttpTransport

    (tmp_path / "p.toml").write_text(
        """
[[limits]]
name = "shared"
cap = 100
window = "day"
scope = "user"

[gateway]
[gateway.bearer]
"tok-alice" = "alice"
"""
    )
    env = _env(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_port = free_port()
        procs.append(subprocess.Popen([*UPSTREAM, "--port", str(up_port)], env=env,
                                      stderr=subprocess.DEVNULL))  # fmt: skip
        _wait_http(f"http://127.0.0.1:{up_port}/mcp", procs[0])
        ports = [free_port() for _ in range(4)]
        for port in ports:
            procs.append(subprocess.Popen(
                [*MCPBG, "proxy", "--policy", str(tmp_path / "p.toml"), "--redis-url", redis_url,
                 "--ledger-dir", str(tmp_path / f"ledger-{port}"),
                 "--upstream", f"http://127.0.0.1:{up_port}/mcp", "--listen", f"127.0.0.1:{port}"],
                env=env, stderr=subprocess.DEVNULL))  # fmt: skip
        for port, proc in zip(ports, procs[1:], strict=True):
            _wait_http(f"http://127.0.0.1:{port}/mcp", proc)

        async def calls(port: int, n: int, token: str | None) -> list[bool]:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            transport = StreamableHttpTransport(f"http://127.0.0.1:{port}/mcp", headers=headers)
            async with Client(transport) as c:
                out = []
                for i in range(n):
                    r = await c.call_tool("echo", {"text": str(i)}, raise_on_error=False)
                    out.append(not r.is_error)
                return out

        async def drive() -> list[bool]:
            runs = await asyncio.gather(*(calls(p, 30, "tok-alice") for p in ports))
            return [ok for run in runs for ok in run]

        admitted = asyncio.run(drive())
        assert sum(admitted) == 100 and len(admitted) == 120
        assert len(_seen(tmp_path)) == 100  # exactly 100 forwarded

        async def unnamed() -> str:
            async with Client(f"http://127.0.0.1:{ports[0]}/mcp") as c:
                r = await c.call_tool("echo", {"text": "?"}, raise_on_error=False)
                return str(r.content[0].text)  # type: ignore[union-attr]

        assert asyncio.run(unnamed()).startswith("caller_unidentified limit=shared status=403")
        assert len(_seen(tmp_path)) == 100
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the [gateway] table (no processes) ----------------------------------------

_SPEND = Policy.of(
    Limit("calls", cap=3, window=Window.DAY),
    Limit("spend", cap=usd(5), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
)


def test_prices_by_exact_name_before_globs_then_the_default() -> None:
    g = GatewayConfig.from_table(
        _SPEND,
        {"default_cost_usd": "0.001", "tools": {"b*": "0.02", "brave_search": "0.01"}},
    )
    assert g.price("brave_search") == {"spend": 10_000}
    assert g.price("brave_news") == {"spend": 20_000}
    assert g.price("echo") == {"spend": 1_000}
    assert GatewayConfig.from_table(_SPEND, None).price("echo") is None


def test_http_identity_from_bearer_or_header() -> None:
    g = GatewayConfig.from_table(_SPEND, {"user_header": "X-User", "bearer": {"t1": "alice"}})
    assert g.http_user({"authorization": "Bearer t1"}) == "alice"
    assert g.http_user({"authorization": "Bearer nope", "x-user": "bob"}) == "bob"
    assert g.http_user({}) is None
    assert GatewayConfig.from_table(_SPEND, {}).http_user({"x-user": "bob"}) is None
    assert GatewayConfig.from_table(_SPEND, {"user": "carol"}).local_user({}) == "carol"
    assert GatewayConfig.from_table(_SPEND, {}).local_user({"MCPBG_USER": "dan"}) == "dan"


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"price": "1"}, "gateway.price"),
        ({"charge": "calls"}, "gateway.charge"),
        ({"charge": 3}, "gateway.charge"),
        ({"tools": {"x": 0.5}}, "gateway.tools.x"),
        ({"tools": {"x": "-1"}}, "gateway.tools.x"),
        ({"tools": "x"}, "gateway.tools"),
        ({"default_cost_usd": "abc"}, "gateway.default_cost_usd"),
        ({"bearer": {"t": 1}}, "gateway.bearer"),
        ({"user_header": ""}, "gateway.user_header"),
    ],
)
def test_a_bad_gateway_table_names_its_field(table: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        GatewayConfig.from_table(_SPEND, table)
    assert err.value.field == field


def test_a_price_needs_a_money_limit() -> None:
    calls_only = Policy.of(Limit("calls", cap=3, window=Window.DAY))
    with pytest.raises(InvalidInputError, match="needs a money limit"):
        GatewayConfig.from_table(calls_only, {"default_cost_usd": "0.01"})
    assert GatewayConfig.from_table(calls_only, {"default_cost_usd": "0"}).price("x") == {}


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(POLICY)
    for extra, field in [
        ([], "--upstream"),
        (["--upstream", "http://127.0.0.1:1/mcp"], "--listen"),
        (["--upstream", "http://127.0.0.1:1/mcp", "--listen", "nowhere"], "--listen"),
        (["--upstream", "ftp://x", "--listen", "127.0.0.1:1"], "--upstream"),
    ]:
        out = subprocess.run(
            [*MCPBG, "proxy", "--policy", str(tmp_path / "p.toml"), *extra],
            capture_output=True, text=True, env=_env(tmp_path),
        )  # fmt: skip
        assert out.returncode == 2 and field in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_the_mcp_conformance_suite_passes_governed_as_bare() -> None:
    """The official MCP conformance suite, bare, behind BudgetMiddleware and through
    ``mcpbg proxy`` over HTTP: each run fails exactly the bare upstream's baseline,
    and every check that passes bare passes governed."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(root / "scripts" / "mcp-conformance")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    totals = [line for line in done.stdout.splitlines() if line.startswith("Total:")]
    assert len(totals) == 3 and len(set(totals)) == 1, done.stdout  # the same checks pass
    for mode in ("governed", "proxy"):  # check by check, not only scenario by scenario
        assert f"{mode}: all {totals[0].split()[1]} checks that pass bare pass" in done.stdout
    assert "match the baseline" in done.stdout


EVERYTHING = ROOT / "testing" / "mcp-everything"  # server-everything, pinned in its lockfile


def _install_everything() -> None:
    bin_ = EVERYTHING / "node_modules" / ".bin" / "mcp-server-everything"
    lock = EVERYTHING / "package-lock.json"
    if not bin_.exists() or lock.stat().st_mtime > (EVERYTHING / "node_modules").stat().st_mtime:
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=EVERYTHING, check=True, capture_output=True, timeout=300,
        )  # fmt: skip


@pytest.mark.slow
def test_claude_desktop_shape_in_front_of_server_everything(tmp_path: Path) -> None:
    """The literal client configuration ``command: mcpbg``, ``args: [proxy, --policy,
    p.toml, --, npx, -y, @modelcontextprotocol/server-everything]``: the official
    reference server from npm, resolved offline from testing/mcp-everything/."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    _install_everything()
    (tmp_path / "p.toml").write_text(POLICY)
    env = _env(
        tmp_path,
        MCPBG_USER="alice",
        # npm fails rather than fetch anything: the pinned install is all the upstream uses.
        npm_config_offline="true",
        NODE_OPTIONS=f"--require {EVERYTHING / 'count-calls.cjs'}",
    )
    params = StdioServerParameters(
        command=str(Path(sys.executable).parent / "mcpbg"),  # the console script, as installed
        args=["proxy", "--policy", str(tmp_path / "p.toml"), "--",
              "npx", "-y", "@modelcontextprotocol/server-everything"],
        env=env,
        cwd=EVERYTHING,  # the upstream starts here, where npx finds the pinned bin
    )  # fmt: skip

    async def drive() -> tuple[list[str], list[Any]]:
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            listed = [t.name for t in (await s.list_tools()).tools]
            results = [await s.call_tool("echo", {"message": f"hi{i}"}) for i in range(5)]
            results.append(await s.call_tool("get-sum", {"a": 2, "b": 3}))
            return listed, results

    listed, results = asyncio.run(drive())
    assert {"echo", "get-sum"} <= set(listed), listed  # the upstream's own tools
    texts = [r.content[0].text for r in results]
    assert [r.is_error for r in results] == [False] * 3 + [True] * 2 + [False]
    assert texts[:3] == ["Echo: hi0", "Echo: hi1", "Echo: hi2"]
    for text in texts[3:5]:
        assert text.startswith("budget_exceeded:user+tool/day limit=per_tool status=429")
        assert "Rate limited by limit 'per_tool'" in text
    assert "5" in texts[5]  # another tool, its own cap: forwarded
    # What server-everything itself read (testing/mcp-everything/count-calls.cjs).
    assert _seen(tmp_path) == ["call echo"] * 3 + ["call get-sum"]

    ledger = tmp_path / "home" / ".mcpbg" / "ledger"  # the default file ledger
    out = subprocess.run(
        [*MCPBG, "costs", "--ledger-dir", str(ledger), "--by", "tool", "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    rows = {row["tool"]: row for row in json.loads(out.stdout)["spend by tool"]}
    assert (rows["echo"]["calls"], rows["echo"]["rejected"]) == (3, 2)
    assert rows["echo"]["usd"] == "0.030000"  # the [gateway] default price, 3 x $0.01
    assert (rows["get-sum"]["calls"], rows["get-sum"]["usd"]) == (1, "0.010000")
