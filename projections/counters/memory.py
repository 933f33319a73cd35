"""Process-local counters, ``MemoryBackend``: pure (no I/O), so it lives in the core
(:mod:`mcp_budget_governor.memory_backend`), where ``Governor(policy)`` takes it as
its default; this path names it beside the other stores."""

from mcp_budget_governor.memory_backend import MemoryBackend

__all__ = ["MemoryBackend"]
