"""``mcpbg schema``: the JSON Schema of every ledger event type."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    schema = sub.add_parser("schema", help="print the JSON Schema of every ledger event type")
    schema.add_argument("--type", help="only this type, e.g. mcpbg.metered.v1")
    schema.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..events import json_schemas

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
