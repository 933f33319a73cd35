"""The price table at the module path of mcp-budget-governor 0.1.0 (the one home:
:mod:`mcp_budget_governor.prices`)."""

from typing import TYPE_CHECKING, Any

from .errors import UnknownModel
from .prices import MicroPrice, ModelPrice, PriceTable

if TYPE_CHECKING:
    from .prices import BUILTIN_AS_OF

__all__ = ["BUILTIN_AS_OF", "MicroPrice", "ModelPrice", "PriceTable", "UnknownModel"]


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_AS_OF":  # read from the installed price data when first asked
        from . import prices

        return prices.BUILTIN_AS_OF
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
