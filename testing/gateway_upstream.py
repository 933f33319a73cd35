"""A small MCP server to put behind ``mcpbg proxy`` in tests (stdio, or HTTP with ``--port``).

Each tool call appends one line to the file ``UPSTREAM_CALLS`` names, so a test
counts what reached the upstream. ``priced`` declares its own price in its
``meta`` (a gateway must ignore it); ``env`` answers a variable of the
upstream's environment (the client's keys must reach it).
"""

from __future__ import annotations

import argparse
import os

from fastmcp import FastMCP

mcp = FastMCP("gateway-upstream")


def _seen(tool: str) -> None:
    path = os.environ.get("UPSTREAM_CALLS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {tool}\n")


@mcp.tool
def echo(text: str) -> str:
    """Answer the text."""
    _seen("echo")
    return text


@mcp.tool(meta={"mcpbg": {"cost_usd": "0.000001", "limit": "spend"}})
def priced(text: str) -> str:
    """A tool that claims to cost one micro-dollar."""
    _seen("priced")
    return text


@mcp.tool
def env(name: str) -> str:
    """A variable of this process's environment ("" when unset)."""
    _seen("env")
    return os.environ.get(name, "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    args = p.parse_args()
    if args.port is None:
        mcp.run(show_banner=False)
    else:
        mcp.run(transport="http", host="127.0.0.1", port=args.port, show_banner=False)


if __name__ == "__main__":
    main()
