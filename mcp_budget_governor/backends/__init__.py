"""Counter stores under the module paths of mcp-budget-governor 0.1.0.

``backends.memory.MemoryBackend`` and ``backends.redis.RedisBackend`` are this
package's backends (``projections.counters``), which also answer the
reference's calls (``backends.base``); ``backends.base`` holds its protocol and
result types and the adapter that lets a backend written to it serve our
governor.
"""

from .base import AccumulateResult, ConsumeResult, KeyValueAdapter, KeyValueBackend

__all__ = ["AccumulateResult", "ConsumeResult", "KeyValueAdapter", "KeyValueBackend"]
