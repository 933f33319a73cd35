"""A hook for the low-level MCP SDK server (``mcp.server.lowlevel.Server``, mcp 2.x).

The low-level server takes its request handlers as constructor arguments, so
the hook wraps the ``on_call_tool`` handler itself; its signature is the SDK's
stable public API (``Server.middleware`` is marked provisional in mcp 2.3):

>>> from mcp.server.lowlevel import Server
>>> from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Scope, Window
>>> governor = Governor(Policy.of(
...     Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER)), MemoryBackend())
>>> async def call_tool(ctx, params): ...
>>> server = Server("my-server", on_call_tool=governed_call_tool(
...     governor, call_tool, identify=lambda ctx, params: Context(user="u_42")))

The same rules as the FastMCP middleware: ``identify(ctx, params)`` (sync or
async) names the caller (default: the authenticated access token's subject,
else its client id), the tool's name becomes ``Context.tool``, the policy's
``anonymous`` rule applies to a caller without a user id, a refusal comes back
as an error result (``is_error=True``) whose text is
:func:`~mcp_budget_governor.integrations.flow.refusal_text`, with the same as
data in ``_meta["dev.mcpbg/refusal"]``
(:func:`~mcp_budget_governor.integrations.flow.refusal_meta`; or, with
``rate_limit_error=True``, a 429 is the JSON-RPC error -32023 of MCP's
rate-limit proposal, SEP-3304), and
``cost(params, result) -> {limit: amount} | None`` is metered after the
handler returns; ``fixed`` (``{limit: amount}``) is charged when ``cost`` gives
nothing or fails, and when the handler raises or is cancelled (a client's
``notifications/cancelled``): the rules of
:func:`~mcp_budget_governor.integrations.flow.governed_call`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from mcp_budget_governor.integrations import extra_missing

try:
    import mcp_types as mt
    from mcp.server.auth.middleware.auth_context import get_access_token
    from mcp.shared.exceptions import MCPError
except ModuleNotFoundError as exc:  # installed without the [fastmcp] extra (the MCP SDK)
    raise extra_missing("lowlevel", exc) from exc

from mcp_budget_governor.context import EMPTY, Context
from mcp_budget_governor.errors import LimitExceeded
from mcp_budget_governor.governor import Governor
from mcp_budget_governor.integrations.flow import (
    REFUSAL_META_KEY,
    Charges,
    fixed_charges,
    governed_call,
    identify_with,
    rate_limited_error,
    refusal_body,
    refusal_meta,
    refusal_text,
    user_of_token,
)

__all__ = ["governed_call_tool"]

Result: TypeAlias = "mt.CallToolResult | mt.InputRequiredResult"
Handler: TypeAlias = Callable[[Any, mt.CallToolRequestParams], Awaitable[Result]]
Identify: TypeAlias = Callable[
    [Any, mt.CallToolRequestParams], Context | Awaitable[Context | None] | None
]
Cost: TypeAlias = Callable[
    [mt.CallToolRequestParams, Result], Charges | Awaitable[Charges | None] | None
]


def governed_call_tool(
    governor: Governor,
    handler: Handler,
    *,
    identify: Identify | None = None,
    cost: Cost | None = None,
    fixed: Charges | None = None,
    rate_limit_error: bool = False,
) -> Handler:
    """Wrap a low-level ``on_call_tool`` handler: check, run it, meter ``cost`` (else ``fixed``)."""
    if not isinstance(governor, Governor):
        raise TypeError(f"governed_call_tool needs a Governor, not {type(governor).__name__}")
    price = fixed_charges(governor, fixed)

    async def on_call_tool(ctx: Any, params: mt.CallToolRequestParams) -> Result:
        priced = None
        if cost is not None:
            charge = cost

            def priced(result: Result) -> Any:
                return charge(params, result)

        try:
            who = (await _caller(identify, ctx, params)).with_tool(params.name)
            who = await governor.identified(who)
            return await governed_call(
                governor, who, lambda: handler(ctx, params), fixed=price, priced=priced
            )
        except LimitExceeded as exc:
            error = rate_limited_error(exc.decision) if rate_limit_error else None
            if error is not None:
                raise MCPError(error["code"], error["message"], error["data"]) from None
            return mt.CallToolResult(
                content=[mt.TextContent(type="text", text=refusal_text(exc.decision))],
                structured_content={"mcpbg": refusal_body(exc.decision)},
                is_error=True,
                _meta={REFUSAL_META_KEY: refusal_meta(exc.decision)},
            )

    return on_call_tool


async def _caller(identify: Identify | None, ctx: Any, params: mt.CallToolRequestParams) -> Context:
    if identify is not None:
        return await identify_with(identify, ctx, params)
    user = user_of_token(get_access_token())
    return EMPTY if user is None else Context(user=user)
