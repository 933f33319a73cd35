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

from .backends.base import AccumulateResult, ConsumeResult
from .caps import Plan
from .context import ANONYMOUS_USER, Context
from .counters import Backend
from .decision import Decision, Lease, MeterResult
from .errors import (
    BackendBusyError,
    BackendUnavailable,
    BackendUnavailableError,
    BudgetExceeded,
    BudgetGovernorError,
    BudgetUnavailable,
    CounterOverflowError,
    GovernorError,
    InvalidInputError,
    LimitExceeded,
    NoPriceTableError,
    PolicyError,
    UnknownModel,
    UnknownModelError,
)
from .governor import Governor
from .holds import Admission, Reservation
from .ledger import Ledger, LedgerEntry
from .limits import FailMode, Limit, OnExceed
from .money import MAX_AMOUNT, Unit, format_usd, usd
from .policy import Anonymous, Policy
from .prices import ModelPrice, PriceTable
from .scopes import Scope
from .windows import Window

if TYPE_CHECKING:
    from mcp_budget_governor.memory_backend import MemoryBackend
    from mcp_budget_governor.prices import BUILTIN_AS_OF
    from mcp_budget_governor.projections.counters.postgres import PostgresBackend
    from mcp_budget_governor.projections.counters.redis import RedisBackend

    __version__: str


__all__ = [
    "ANONYMOUS_USER",
    "BUILTIN_AS_OF",
    "MAX_AMOUNT",
    "AccumulateResult",
    "Admission",
    "Anonymous",
    "Backend",
    "BackendBusyError",
    "BackendUnavailable",
    "BackendUnavailableError",
    "BudgetExceeded",
    "BudgetGovernorError",
    "BudgetUnavailable",
    "ConsumeResult",
    "Context",
    "CounterOverflowError",
    "Decision",
    "FailMode",
    "Governor",
    "GovernorError",
    "InvalidInputError",
    "Lease",
    "Ledger",
    "LedgerEntry",
    "Limit",
    "LimitExceeded",
    "MemoryBackend",
    "MeterResult",
    "ModelPrice",
    "NoPriceTableError",
    "OnExceed",
    "Plan",
    "Policy",
    "PolicyError",
    "PostgresBackend",
    "PriceTable",
    "RedisBackend",
    "Reservation",
    "Scope",
    "Unit",
    "UnknownModel",
    "UnknownModelError",
    "Window",
    "__version__",
    "format_usd",
    "usd",
]

_LAZY = {
    "MemoryBackend": "mcp_budget_governor.memory_backend",
    "RedisBackend": "mcp_budget_governor.projections.counters.redis",
    "PostgresBackend": "mcp_budget_governor.projections.counters.postgres",
    "BUILTIN_AS_OF": "mcp_budget_governor.prices",
}


#: The distribution that installs this package (pyproject's ``name``; the import
#: package stays ``mcp_budget_governor``). ``tests/test_cli.py`` holds them together.
DISTRIBUTION = "mcpbg"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # One source: the installed distribution's metadata (pyproject's version).
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(DISTRIBUTION)
        except PackageNotFoundError:  # run from a checkout that was never installed
            return "0+unknown"
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mcp_budget_governor' has no attribute {name!r}")
