"""An MCP server governed by BudgetMiddleware: Redis counters, the Kafka ledger.

FastMCP over streamable HTTP (``/mcp``) with a health endpoint (``/health``),
configured like ``mcpbg`` by the environment variables of :data:`SETTINGS`
(names, defaults and help in ``mcp_budget_governor.settings``); with the
``[otel]`` extra it serves the governor's metrics at ``/metrics`` for Prometheus: the counters'
Redis and the ledger's Kafka (both required), the ledger topic, the policy
file (default ``policy.toml`` next to this file) and the ledger's outbox, and how often
to look at the policy file for a change (a changed file is reloaded, an
invalid one is logged with its line and the previous policy stays).
Every bad or missing one is reported at once.

Run ``mcpbg worker`` with the same variables to project the ledger into Redis:
the counters are created with ``require_epoch=True``, so until the worker has
marked them ready, every check follows its limit's fail mode.

Callers name themselves with ``X-User-Id`` and ``X-Tenant-Id`` headers (a
stand-in for the subject of an OAuth token, see ``flow.user_of_token``); a
caller without one is handled as the policy's ``anonymous`` setting says.

    MCPBG_REDIS_URL=redis://localhost:6379/0 MCPBG_KAFKA_URL=kafka://localhost:9092 \\
        python examples/server.py --port 8000
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastmcp import FastMCP
from fastmcp.server.dependencies import get_http_headers
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mcp_budget_governor import Context, Governor, Policy, PriceTable, RedisBackend, usd
from mcp_budget_governor.errors import SettingsError
from mcp_budget_governor.integrations.fastmcp import META_KEY, BudgetMiddleware
from mcp_budget_governor.integrations.flow import governed_context
from mcp_budget_governor.policy_reload import PolicyWatcher
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.settings import SETTINGS as TABLE
from mcp_budget_governor.settings import resolve

#: The settings this server reads, from the table ``mcpbg`` reads.
SETTINGS = (
    "redis_url",
    "kafka_url",
    "topic",
    "policy",
    "outbox_dir",
    "policy_poll",
    "check_timeout",
    "caps_refresh",
)
#: Their environment variables.
ENV = tuple(TABLE[name].env for name in SETTINGS)

MODEL = "claude-sonnet-4-5"
SEARCH_PRICE = usd(0.004)  # what one search costs us, declared in the tool's meta


def identify(context: Any) -> Context:
    """The caller from the HTTP request's headers (an OAuth subject in production)."""
    headers = get_http_headers(include={"x-user-id", "x-tenant-id"})
    return Context(user=headers.get("x-user-id"), tenant=headers.get("x-tenant-id"))


def spend_limits(policy: Policy) -> list[str]:
    """The USD limits a tool's cost is metered to."""
    return [limit.name for limit in policy if limit.unit.value == "usd_micros"]


def build(environ: Mapping[str, str]) -> FastMCP:
    """The governed server, configured from ``environ``."""
    try:
        settings = resolve(SETTINGS, environ, required=("redis_url", "kafka_url"), options=False)
    except SettingsError as exc:  # one line naming every bad setting, no traceback
        raise SystemExit(f"examples/server.py: {exc}") from None
    policy_path = settings["policy"] or str(Path(__file__).with_name("policy.toml"))
    policy = Policy.from_file(policy_path)
    prices = PriceTable.builtin()
    ledger = KafkaLedger.from_url(
        settings["kafka_url"], topic=settings["topic"], outbox_dir=settings["outbox_dir"]
    )
    backend = RedisBackend.from_url(
        settings["redis_url"],
        require_epoch=True,
        timeout=settings["check_timeout"],
        caps_refresh=settings["caps_refresh"],  # on Redis Cluster: its copy of run-time caps
    )
    telemetry = _telemetry()
    governor = Governor(policy, backend, ledger=ledger, prices=prices, observer=telemetry)
    watcher = PolicyWatcher(
        policy_path, governor.replace_policy, current=policy, interval=settings["policy_poll"]
    )

    async def cost(context: Any, result: Any) -> dict[str, int] | None:
        # A tool that called a model reports its usage: meter its tokens on every
        # spend limit, as one event (the ledger keeps model, tokens and price version, so the
        # cost can be audited), and return no further charges. For the other
        # tools, None keeps the fixed price their meta declares.
        usage = (getattr(result, "structured_content", None) or {}).get("usage")
        if not usage:
            return None
        await governor.meter_tokens(
            spend_limits(governor.policy),  # the policy in force: it may have been reloaded
            usage["model"],
            input_tokens=usage["input_tokens"],
            output_tokens=usage["output_tokens"],
            ctx=governed_context(),
        )
        return {}

    @asynccontextmanager
    async def lifespan(_: FastMCP) -> AsyncIterator[None]:
        try:
            async with watcher:  # SIGHUP or a changed file: governor.replace_policy
                yield
        finally:
            await governor.aclose()  # ships what the ledger holds, closes Redis

    server = FastMCP("mcpbg-example", lifespan=lifespan)
    server.add_middleware(BudgetMiddleware(governor, identify=identify, cost=cost))

    @server.tool(meta={META_KEY: {"cost": SEARCH_PRICE, "limit": spend_limits(policy)}})
    def search(query: str) -> str:
        """Search the web (an example: returns a canned answer)."""
        return f"3 results for {query!r}"

    @server.tool
    def summarise(text: str) -> dict[str, Any]:
        """Summarise a text with a model (an example: the model call is simulated)."""
        input_tokens = 400 + len(text) // 4
        output_tokens = 120
        return {
            "summary": text[:80],
            "usage": {"model": MODEL, "input_tokens": input_tokens, "output_tokens": output_tokens},
        }

    @server.custom_route("/health", methods=["GET"])
    async def health(_: Request) -> JSONResponse:
        """200 when Redis answers, 503 otherwise (the ledger spills to its outbox)."""
        try:
            await backend.client.ping()
        except Exception as exc:  # report any failure as unhealthy, never crash the probe
            return JSONResponse({"status": "unhealthy", "redis": str(exc)}, status_code=503)
        limits = len(governor.policy)
        return JSONResponse({"status": "ok", "policy": policy_path, "limits": limits})

    @server.custom_route("/metrics", methods=["GET"])
    async def metrics(_: Request) -> Response:
        """The governor's metrics for Prometheus (decisions by limit and reason, check
        latency, degraded state, outbox depth and age); 404 without the [otel] extra."""
        if telemetry is None:
            return PlainTextResponse("install the otel extra for metrics\n", status_code=404)
        return PlainTextResponse(telemetry.scrape(), media_type="text/plain; version=0.0.4")

    return server


def _telemetry() -> Any:
    """OpenTelemetry metrics with a Prometheus reader when the [otel] extra is installed."""
    try:
        from mcp_budget_governor.integrations.otel import Telemetry
    except ImportError:
        return None
    return Telemetry.prometheus()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``--host`` and ``--port`` of the HTTP listener."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until interrupted."""
    args = parse_args(argv)
    server = build(os.environ)
    server.run(transport="http", host=args.host, port=args.port, show_banner=False)


if __name__ == "__main__":
    main(sys.argv[1:])
