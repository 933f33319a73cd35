"""``mcpbg serve``: the admin HTTP API and the live dashboard (``console/``).

``mcpbg serve --policy policy.toml --redis-url redis://... --ledger-dir ledger/``
with ``MCPBG_READ_TOKEN`` / ``MCPBG_WRITE_TOKEN`` (or their ``_FILE``
variables) set; the dashboard is at ``/dashboard``, the API
under ``/v1/`` (``/openapi.json``); it prints a one-time login link that sets
the read token's cookie, so the token never travels in a URL. Writes go to the ledger when
``--kafka-url`` or ``--ledger-dir`` is given (like ``mcpbg caps``), else
straight to the counters in Redis. ``GET /v1/alerts`` shows the stream worker's
latest alerts from the same Redis (``mcpbg worker --alert-keep``, docs/alerts.md).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .ledger_args import add_ledger_options, add_option, add_redis_option, required, setting


def register(sub: Any) -> None:
    from ..console.auth import variables

    p = sub.add_parser(
        "serve",
        help="the admin HTTP API and the live dashboard (bearer tokens)",
        description=f"Every route needs a bearer token: {variables()}, the read token "
        "for reads, the write token for both.",
    )
    add_option(p, "policy")
    add_redis_option(p)
    add_ledger_options(p)
    add_option(p, "kafka_url", "append writes to this broker")
    add_option(p, "topic")
    add_option(p, "serve_host", "the address to listen on")
    p.add_argument("--port", type=int, help=f"the port ({setting_help('serve_port')})")
    p.set_defaults(run=run)


def setting_help(name: str) -> str:
    from ..settings import SETTINGS

    s = SETTINGS[name]
    return f"default {s.default}; env {s.env}"


def run(args: argparse.Namespace) -> int:
    from ..console.api import Console, serve_console
    from ..console.auth import Tokens
    from ..settings import resolve
    from .caps import _governor, _policy

    tokens = Tokens.from_env()
    policy = _policy(args)
    required(args, "redis_url", "the counters' Redis")
    values = resolve(
        ["serve_host", "serve_port"], given={"serve_host": args.serve_host, "serve_port": args.port}
    )

    async def main() -> None:
        governor = await _governor(args, policy)
        ledgered = setting(args, "kafka_url") or setting(args, "ledger_dir")
        console = Console(
            policy,
            governor.backend,
            tokens,
            archive_dir=setting(args, "archive_dir"),
            ledger_dir=setting(args, "ledger_dir"),
            governor=governor,
            where="appended to the ledger" if ledgered else "written",
        )
        try:
            await serve_console(console, values["serve_host"], values["serve_port"])
        finally:
            await governor.aclose()

    asyncio.run(main())
    return 0
