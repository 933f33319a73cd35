"""``mcpbg demo``: a FastMCP server governed by ``BudgetMiddleware`` under a simulated burst.

:mod:`.scenario` holds what is simulated (policy, agents, tools, clock);
:mod:`.runner` runs it; :mod:`.report` prints the report. Needs the ``demo`` extra
(fastmcp, rich, duckdb, pyarrow).
"""
