"""``mcpbg``: the operator's command line.

Each command lives in its own module of this package and registers itself
through a ``register(subparsers)`` function; :data:`COMMANDS` lists them in
the order ``mcpbg --help`` shows them.

Exit codes: 0 success, 1 a check found a problem (drift, exceeded budgets),
2 bad input (the message names the field and the value) or any other
failure. Whatever fails is one line on stderr, never a traceback: :func:`main`
is the one handler.
"""

from __future__ import annotations

if __name__ != "mcp_budget_governor.cli":  # one name per module (docs/layout.md)
    raise ImportError("import mcp_budget_governor.cli, not edges.cli")

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import GovernorError

#: The command modules, ``mcp_budget_governor.cli.<name>``, each with ``register``.
COMMANDS: tuple[str, ...] = (
    # What an operator reaches for first, then the pipeline's jobs, then reference.
    "demo",
    "budgets",
    "caps",
    "costs",
    "serve",
    "proxy",
    "sql",
    "export",
    "reconcile",
    "replay",
    "worker",
    "archive",
    "migrate",
    "schema",
)


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line of stderr (exit 2), like every other error."""

    def error(self, message: str) -> NoReturn:
        from .render import one_line

        self.exit(2, f"{one_line(f'{self.prog}: {message}')} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit(0)


def version() -> str:
    """The installed distribution's version (``mcp_budget_governor.__version__``)."""
    import mcp_budget_governor

    return str(mcp_budget_governor.__version__)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mcpbg", description="mcp-budget-governor operator tools")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; whatever goes wrong is one line on stderr, never a traceback."""
    from .render import fail

    args = parser().parse_args(argv)
    command = args.command
    try:
        code: int = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler
    except BrokenPipeError:
        # The reader (``| head``) left: stop quietly on stdout, say so once.
        with contextlib.suppress(OSError, ValueError):  # stdout may have no file (tests)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return fail(command, "output closed before the end (broken pipe)")
    except KeyboardInterrupt:
        return fail(command, "interrupted", 130)
    except GovernorError as exc:
        return fail(command, str(exc))
    except RecursionError:
        return fail(command, "input nested too deeply to read")
    except ModuleNotFoundError as exc:  # an optional dependency: name the extra
        from .render import missing_dependency

        return fail(command, missing_dependency(exc))
    except Exception as exc:  # the last line of defence: one line, never a traceback
        return fail(command, f"{type(exc).__name__}: {exc}")
    return code


if __name__ == "__main__":
    sys.exit(main())
