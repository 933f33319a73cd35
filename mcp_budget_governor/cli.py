"""``mcpbg``: the operator's command line.

Exit codes: 0 success, 1 a check found a problem, 2 bad input (the message
names the field and the value).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .errors import GovernorError


def _schema(args: argparse.Namespace) -> int:
    from .events import json_schemas

    schemas = json_schemas()
    if args.type:
        if args.type not in schemas:
            print(
                f"mcpbg schema: --type: unknown event type {args.type!r} "
                f"(one of {', '.join(schemas)})",
                file=sys.stderr,
            )
            return 2
        schemas = {args.type: schemas[args.type]}
    json.dump(schemas, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcpbg", description="mcp-budget-governor operator tools")
    sub = p.add_subparsers(dest="command", required=True)
    schema = sub.add_parser("schema", help="print the JSON Schema of every ledger event type")
    schema.add_argument("--type", help="only this type, e.g. mcpbg.metered.v1")
    schema.set_defaults(run=_schema)
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
