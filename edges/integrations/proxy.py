"""``mcpbg proxy``: a budget in front of an MCP server you do not own.

Built on FastMCP's own proxy (:func:`fastmcp.server.create_proxy`), which
passes listings, resources, prompts, notifications, progress, cancellation,
elicitation and sampling through; this module adds the governor to its
``tools/call`` (:class:`GatewayMiddleware`, the :class:`BudgetMiddleware`
flow) and the two ways to reach the upstream:

- stdio: the upstream command runs under
  :mod:`~mcp_budget_governor.integrations.upstream_guard`, with the proxy's
  whole environment (where a client puts the upstream's API keys; the SDK would
  pass only a safe minimum), and ends with the proxy: exit, SIGTERM or SIGKILL;
- HTTP: a streamable HTTP upstream URL.

Prices and the caller's identity come from the policy file's ``[gateway]``
table (:mod:`mcp_budget_governor.gateway`); a price an upstream declares in its
tools' ``meta`` is ignored.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from mcp_budget_governor.integrations import extra_missing

try:
    from fastmcp.client.transports import StdioTransport, StreamableHttpTransport
    from fastmcp.server import create_proxy
    from fastmcp.server.dependencies import get_http_headers
    from fastmcp.server.middleware import MiddlewareContext
    from fastmcp.server.providers.proxy import FastMCPProxy
except ModuleNotFoundError as exc:  # installed without the [fastmcp] extra
    raise extra_missing("proxy", exc) from exc

from mcp_budget_governor.context import Context
from mcp_budget_governor.gateway import GatewayConfig
from mcp_budget_governor.governor import Governor
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware
from mcp_budget_governor.integrations.flow import Charges

__all__ = ["GatewayMiddleware", "governed_proxy", "stdio_upstream"]


class GatewayMiddleware(BudgetMiddleware):
    """:class:`BudgetMiddleware` whose prices come from the gateway's table, never
    from the tool's ``meta`` (the upstream does not price itself), and whose
    caller is named by the gateway: over HTTP by the configured bearer mapping or
    header, over stdio the local user and this proxy's session."""

    def __init__(self, governor: Governor, config: GatewayConfig, *, stdio: bool) -> None:
        self.config = config
        self.stdio = stdio
        # One stdio proxy serves one client connection for its whole life.
        self.session = uuid.uuid4().hex
        self.local_user = config.local_user(os.environ) if stdio else None
        super().__init__(governor, identify=self._who)

    def _who(self, context: MiddlewareContext[Any]) -> Context:
        if self.stdio:
            return Context(user=self.local_user, session=self.session)
        headers = get_http_headers(include={"authorization"})
        session = headers.get("mcp-session-id") or None
        return Context(user=self.config.http_user(headers), session=session)

    async def _meta_price(
        self, context: MiddlewareContext[Any], name: str
    ) -> tuple[Charges | None, Charges | None]:
        return self.config.price(name), None


def stdio_upstream(command: Sequence[str], environ: Mapping[str, str] | None = None) -> Any:
    """The transport that starts ``command`` under the guard with ``environ`` (default:
    this process's environment)."""
    if not command:
        from mcp_budget_governor.errors import InvalidInputError

        raise InvalidInputError("command", "", "expected the upstream command after --")
    guard = ["-m", "mcp_budget_governor.integrations.upstream_guard", str(os.getpid()), "--"]
    return StdioTransport(
        command=sys.executable,
        args=[*guard, *command],
        env=dict(os.environ if environ is None else environ),
        keep_alive=True,
    )


def governed_proxy(
    governor: Governor, config: GatewayConfig, upstream: Any, *, stdio: bool
) -> FastMCPProxy:
    """A FastMCP proxy of ``upstream`` (a transport or a URL) governed by ``governor``."""
    target = StreamableHttpTransport(upstream) if isinstance(upstream, str) else upstream
    proxy = create_proxy(target, name="mcpbg-proxy")
    proxy.add_middleware(GatewayMiddleware(governor, config, stdio=stdio))
    return proxy
