"""``mcpbg demo``: a FastMCP server governed by ``BudgetMiddleware`` under a simulated burst.

:mod:`.scenario` holds what is simulated (policy, agents, tools, clock);
:mod:`.runner` runs it; :mod:`.report` prints the report. Needs the ``demo`` extra
(fastmcp, rich, duckdb, pyarrow).
"""

if __name__ != "mcp_budget_governor.demo":  # one name per module (docs/layout.md)
    raise ImportError("import mcp_budget_governor.demo, not edges.demo")
