"""``RedisBackend`` at the module path of mcp-budget-governor 0.1.0 (the one class:
``projections.counters.redis``; needs the ``redis`` extra)."""

from mcp_budget_governor.projections.counters.redis import RedisBackend

__all__ = ["RedisBackend"]
