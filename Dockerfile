# The project image: `mcpbg worker` (the stream worker) and examples/server.py
# (an MCP server governed by BudgetMiddleware) both run from it; see docker-compose.yml.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The architecture folders sit at the top level and install as subpackages
# (mcp_budget_governor.producers from producers/, see pyproject's package-dir).
COPY pyproject.toml README.md ./
COPY mcp_budget_governor ./mcp_budget_governor
COPY producers ./producers
COPY stream ./stream
COPY projections ./projections
COPY lua ./lua
COPY sql ./sql
COPY edges ./edges
RUN pip install ".[stream,kafka,redis,fastmcp,otel]"

# The example server and its policy file.
COPY examples ./examples

# Not root: the archive and outbox volumes are owned by this user.
RUN useradd --create-home --uid 10001 mcpbg \
    && mkdir -p /var/lib/mcpbg/archive /var/lib/mcpbg/outbox \
    && chown -R mcpbg /var/lib/mcpbg
USER mcpbg

CMD ["mcpbg", "--help"]
