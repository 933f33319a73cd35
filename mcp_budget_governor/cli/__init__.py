"""``mcpbg``: the operator's command line.

Each command lives in its own module of this package and registers itself
through a ``register(subparsers)`` function; :data:`COMMANDS` lists them in
the order ``mcpbg --help`` shows them.

Exit codes: 0 success, 1 a check found a problem (drift, exceeded budgets),
2 bad input (the message names the field and the value).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ..errors import GovernorError

#: The command modules, ``mcp_budget_governor.cli.<name>``, each with ``register``.
COMMANDS: tuple[str, ...] = (
    # What an operator reaches for first, then the pipeline's jobs, then reference.
    "demo",
    "budgets",
    "costs",
    "sql",
    "export",
    "reconcile",
    "replay",
    "worker",
    "schema",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcpbg", description="mcp-budget-governor operator tools")
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except GovernorError as exc:
        print(f"mcpbg {args.command}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
