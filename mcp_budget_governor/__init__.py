"""mcp-budget-governor: cost-denominated budget enforcement for MCP servers.

>>> from mcp_budget_governor import Governor, Limit, Policy, Scope, Unit, Window, usd
>>> policy = Policy.of(
...     Limit("per_user_calls", cap=2_000, window=Window.DAY, scope=Scope.USER),
...     Limit("global_spend", cap=usd(25), window=Window.DAY, unit=Unit.USD_MICROS,
...           breaker=True, gated=False),
... )

The core modules import no I/O library; ``RedisBackend`` (needs the ``redis``
extra) is loaded only when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .context import ANONYMOUS_USER, Context
from .counters import Backend
from .decision import Decision
from .errors import (
    BackendUnavailableError,
    BudgetExceeded,
    CounterOverflowError,
    GovernorError,
    InvalidInputError,
    PolicyError,
    UnknownModelError,
)
from .governor import Governor, Reservation
from .ledger import Ledger, LedgerEntry
from .limits import FailMode, Limit, OnExceed
from .money import MAX_AMOUNT, Unit, format_usd, usd
from .policy import Anonymous, Policy
from .prices import ModelPrice, PriceTable
from .scopes import Scope
from .windows import Window

if TYPE_CHECKING:
    from mcp_budget_governor.projections.memory_counters import MemoryBackend
    from mcp_budget_governor.projections.redis_counters import RedisBackend

__all__ = [
    "ANONYMOUS_USER",
    "MAX_AMOUNT",
    "Anonymous",
    "Backend",
    "BackendUnavailableError",
    "BudgetExceeded",
    "Context",
    "CounterOverflowError",
    "Decision",
    "FailMode",
    "Governor",
    "GovernorError",
    "InvalidInputError",
    "Ledger",
    "LedgerEntry",
    "Limit",
    "MemoryBackend",
    "ModelPrice",
    "OnExceed",
    "Policy",
    "PolicyError",
    "PriceTable",
    "RedisBackend",
    "Reservation",
    "Scope",
    "Unit",
    "UnknownModelError",
    "Window",
    "format_usd",
    "usd",
]

_LAZY = {
    "MemoryBackend": "mcp_budget_governor.projections.memory_counters",
    "RedisBackend": "mcp_budget_governor.projections.redis_counters",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mcp_budget_governor' has no attribute {name!r}")
