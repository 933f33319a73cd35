"""``mcpbg proxy``: govern an MCP server you do not own (docs/gateway.md).

stdio, as a client's ``command`` line: ``mcpbg proxy --policy p.toml -- npx -y
@modelcontextprotocol/server-everything``; HTTP, in front of a streamable HTTP
server: ``mcpbg proxy --policy p.toml --upstream http://host/mcp --listen
127.0.0.1:8080``. Counters: in this process unless ``--redis-url`` or
``--postgres`` names shared ones (replicas behind one address need them); the
ledger: ``--kafka-url``, else the file ledger in ``--ledger-dir`` (default
``~/.mcpbg/ledger``). Nothing but the MCP protocol goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from .counters_args import add_counters_options
from .ledger_args import DEFAULT_TOPIC, add_option, policy_spec, setting

#: The file ledger of a proxy given neither --kafka-url nor --ledger-dir.
DEFAULT_LEDGER_DIR = "~/.mcpbg/ledger"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "proxy",
        help="govern an MCP server you do not own (stdio command or HTTP upstream)",
        description="Prices and identity come from the policy file's [gateway] table.",
    )
    add_option(p, "policy")
    add_counters_options(p)
    add_option(p, "ledger_dir", f"the file ledger (default {DEFAULT_LEDGER_DIR})")
    add_option(p, "kafka_url", "append the ledger to this broker instead")
    add_option(p, "topic")
    p.add_argument("--upstream", metavar="URL", help="a streamable HTTP upstream")
    p.add_argument("--listen", metavar="HOST:PORT", help="serve HTTP here (with --upstream)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the upstream's command (stdio)")
    p.set_defaults(run=run)


def _listen(value: str | None) -> tuple[str, int]:
    from ..errors import InvalidInputError

    host, sep, port = (value or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInputError("--listen", value, "expected host:port, e.g. 127.0.0.1:8080")
    return host, int(port)


def run(args: argparse.Namespace) -> int:
    from ..errors import InvalidInputError
    from ..gateway import GatewayConfig
    from ..policy_file import load_policy
    from ..urls import check_http_url

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if bool(command) == bool(args.upstream):
        raise InvalidInputError(
            "--upstream", args.upstream, "give either --upstream URL or -- the upstream command"
        )
    if args.upstream and args.listen is None:
        raise InvalidInputError("--listen", None, "required with --upstream: host:port")
    listen = _listen(args.listen) if args.upstream else None
    upstream = check_http_url(args.upstream, "--upstream") if args.upstream else None
    spec = policy_spec(args)
    policy = load_policy(spec)
    config = GatewayConfig.from_file(policy, spec)

    async def main() -> None:
        from ..integrations.proxy import governed_proxy, stdio_upstream

        governor = _governor(args, policy)
        try:
            if listen is None:
                proxy = governed_proxy(governor, config, stdio_upstream(command), stdio=True)
                await proxy.run_async(transport="stdio", show_banner=False)
            else:
                proxy = governed_proxy(governor, config, upstream, stdio=False)
                await proxy.run_async(
                    transport="http", host=listen[0], port=listen[1], show_banner=False
                )
        finally:
            await governor.aclose()

    asyncio.run(main())
    return 0


def _governor(args: argparse.Namespace, policy: Any) -> Any:
    from ..counters import Backend
    from ..governor import Governor
    from ..ledger import Ledger
    from ..settings import env_value
    from .counters_args import open_counters

    shared = any(
        (getattr(args, "redis_url", None), getattr(args, "postgres_url", None),
         env_value("redis_url"), env_value("postgres_url"))
    )  # fmt: skip
    backend: Backend | None = open_counters(args, max_connections=16) if shared else None
    ledger: Ledger
    kafka_url = setting(args, "kafka_url")
    if kafka_url is not None:
        from ..producers.kafka_ledger import KafkaLedger

        ledger = KafkaLedger.from_url(
            kafka_url, topic=setting(args, "topic") or DEFAULT_TOPIC, source="/mcpbg/proxy"
        )
    else:
        from ..producers.file_ledger import FileLedger

        folder = Path(os.path.expanduser(setting(args, "ledger_dir") or DEFAULT_LEDGER_DIR))
        ledger = FileLedger(folder, source="/mcpbg/proxy")
    return Governor(policy, backend, ledger=ledger)
