"""The edges between the Governor and the servers it guards.

``@governed`` (``decorator``), the FastMCP middleware (``fastmcp``), the ASGI
middleware (``asgi``) and the low-level MCP server hook (``lowlevel``) all run
one governed call (``flow``): check, run the work, meter what it cost.
"""
