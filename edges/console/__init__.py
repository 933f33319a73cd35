"""The operator console: ``mcpbg serve`` (admin API, dashboard) and the HTML reports.

- :mod:`.auth`: the bearer tokens (settings ``read_token`` / ``write_token``);
- :mod:`.api`: the Starlette app over the functions the CLI uses;
- :mod:`.dashboard`: the server-rendered live page;
- :mod:`.report`: self-contained HTML reports (``mcpbg demo``, ``mcpbg costs --html``);
- ``static/``: Chart.js (MIT, its licence beside it), served and inlined, no CDN.
"""

if __name__ != "mcp_budget_governor.console":  # one name per module (docs/layout.md)
    raise ImportError("import mcp_budget_governor.console, not edges.console")
