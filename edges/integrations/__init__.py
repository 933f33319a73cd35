"""The edges between the Governor and the servers it guards.

``@governed`` (``decorator``), the FastMCP middleware (``fastmcp``), the ASGI
middleware (``asgi``) and the low-level MCP server hook (``lowlevel``) all run
one governed call (``flow``): check, run the work, meter what it cost.
"""

if __name__ != "mcp_budget_governor.integrations":  # one name per module (docs/layout.md)
    raise ImportError("import mcp_budget_governor.integrations, not edges.integrations")


def extra_missing(module: str, exc: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error an integration raises when its extra is not installed: which module
    needs what, and the line that installs it (not a bare ``No module named 'mcp_types'``).

    >>> print(extra_missing("fastmcp", ModuleNotFoundError(name="mcp_types")))
    ... # doctest: +NORMALIZE_WHITESPACE
    mcp_budget_governor.integrations.fastmcp needs the fastmcp extra
    (mcp_types is not installed): pip install 'mcpbg[fastmcp]'
    """
    return ModuleNotFoundError(
        f"mcp_budget_governor.integrations.{module} needs the fastmcp extra ({exc.name} is "
        "not installed): pip install 'mcpbg[fastmcp]'",
        name=exc.name,
    )
