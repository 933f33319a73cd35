"""The Redis scripts, shipped as files and loaded from here, never inlined in Python.

Each script is ``lib.lua`` (the shared counter helpers) followed by its body,
so check, meter and apply share one implementation of the counter model.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

if __name__ != "mcp_budget_governor.lua":  # one name per module (README, Layout)
    raise ImportError("import mcp_budget_governor.lua, not lua")

SCRIPTS = ("charge", "apply", "usage", "rewrite", "change", "lease")


@cache
def source(name: str) -> str:
    """The full source of script ``name``: shared helpers, then its body."""
    if name not in SCRIPTS:
        raise KeyError(f"no Lua script named {name!r} (known: {', '.join(SCRIPTS)})")
    here = files(__name__)
    body = here.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return here.joinpath("lib.lua").read_text(encoding="utf-8") + "\n" + body
