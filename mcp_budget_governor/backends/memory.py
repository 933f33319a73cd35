"""``MemoryBackend`` at the module path of mcp-budget-governor 0.1.0 (the one class:
``projections.counters.memory``)."""

from mcp_budget_governor.projections.counters.memory import MemoryBackend

__all__ = ["MemoryBackend"]
