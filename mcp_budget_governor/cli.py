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


def _worker(args: argparse.Namespace) -> int:
    # Imported here: the worker needs the stream extra (faust-streaming, aiokafka,
    # redis), which ``mcpbg schema`` and the core do not.
    try:
        from .stream.worker import WorkerConfig, run
    except ImportError as exc:
        print(
            f"mcpbg worker: {exc}; install the stream extra: "
            "pip install 'mcp-budget-governor[stream]'",
            file=sys.stderr,
        )
        return 2
    overrides = {name: getattr(args, name) for name in _WORKER_OPTIONS}
    return run(WorkerConfig.from_env(**overrides))


#: ``mcpbg worker`` options: name, type, help. Each also reads MCPBG_<NAME>.
_WORKER_OPTIONS: dict[str, tuple[type, str]] = {
    "kafka_url": (str, "Kafka bootstrap, kafka://host:port[,host:port]"),
    "redis_url": (str, "the counters' Redis, redis://host:port/db"),
    "topic": (str, "the ledger topic (default mcpbg.ledger); dead letters go to <topic>.dlq"),
    "group": (str, "consumer group shared by the workers (default mcpbg-projector)"),
    "batch_size": (int, "most records applied in one Redis call (default 500)"),
    "batch_wait": (float, "seconds a batch may wait to fill (default 0.2)"),
    "session_timeout_ms": (int, "group session timeout (default 10000)"),
    "heartbeat_interval_ms": (int, "group heartbeat interval (default 3000)"),
    "progress_interval": (float, "seconds between progress log lines, 0 for none (default 10)"),
    "redis_timeout": (float, "seconds one Redis call may take (default 5)"),
    "topic_wait": (float, "seconds to wait at start for the topic to exist (default 60)"),
    "log_level": (str, "debug, info, warning or error (default info)"),
    "policy": (str, "package.module:attribute of the Policy whose levels raise alerts"),
    "alert_webhook": (str, "http(s) URL each alert is POSTed to (CloudEvent JSON)"),
    "alert_topic": (str, "Kafka topic for alerts (default mcpbg.alerts; '' for none)"),
    "archive_dir": (str, "folder for the Parquet archive, written before each batch applies"),
    "metrics_port": (int, "serve Prometheus metrics on this port (default 0: off)"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcpbg", description="mcp-budget-governor operator tools")
    sub = p.add_subparsers(dest="command", required=True)
    schema = sub.add_parser("schema", help="print the JSON Schema of every ledger event type")
    schema.add_argument("--type", help="only this type, e.g. mcpbg.metered.v1")
    schema.set_defaults(run=_schema)
    worker = sub.add_parser(
        "worker",
        help="project the ledger topic into the Redis counters (a consumer group member)",
        description="Each option may also be given as the environment variable "
        "MCPBG_<OPTION> (e.g. MCPBG_KAFKA_URL); the option wins. SIGTERM stops "
        "gracefully: the batch in hand is applied and committed, exit code 0.",
    )
    for name, (kind, text) in _WORKER_OPTIONS.items():
        worker.add_argument(f"--{name.replace('_', '-')}", type=kind, help=text)
    worker.set_defaults(run=_worker)
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
