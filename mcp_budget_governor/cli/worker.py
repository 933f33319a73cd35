"""``mcpbg worker``: project the ledger topic into the Redis counters."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .render import install_hint


def register(sub: Any) -> None:
    worker = sub.add_parser(
        "worker",
        help="project the ledger topic into the Redis counters (a consumer group member)",
        description="Each option may also be given as the environment variable "
        "MCPBG_<OPTION> (e.g. MCPBG_KAFKA_URL); the option wins. SIGTERM stops "
        "gracefully: the batch in hand is applied and committed, exit code 0.",
    )
    for name, (kind, text) in OPTIONS.items():
        worker.add_argument(f"--{name.replace('_', '-')}", type=kind, help=text)
    worker.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: the worker needs the stream extra (aiokafka, redis,
    # pyarrow, prometheus-client), which ``mcpbg schema`` and the core do not.
    try:
        from ..stream.worker import WorkerConfig
        from ..stream.worker import run as run_worker
    except ImportError as exc:
        print(
            f"mcpbg worker: {exc}; install the stream extra: " + install_hint("stream"),
            file=sys.stderr,
        )
        return 2
    from ..policy_file import load_policy

    overrides = {name: getattr(args, name) for name in OPTIONS}
    config = WorkerConfig.from_env(**overrides)
    if config.policy:
        load_policy(config.policy)  # a bad policy is one line now, not a log after connecting
    return run_worker(config)


#: ``mcpbg worker`` options: name, type, help. Each also reads MCPBG_<NAME>.
OPTIONS: dict[str, tuple[type, str]] = {
    "kafka_url": (str, "Kafka bootstrap, kafka://host:port[,host:port]"),
    "redis_url": (str, "the counters' Redis, redis://host:port/db"),
    "topic": (str, "the ledger topic (default mcpbg.ledger); dead letters go to <topic>.dlq"),
    "group": (str, "consumer group shared by the workers (default mcpbg-projector)"),
    "batch_size": (int, "most records applied in one Redis call (default 500)"),
    "batch_wait": (float, "seconds to wait for records when none are fetched (default 0.2)"),
    "fetch_max_wait_ms": (
        int,
        "how long the broker may hold a fetch that has no data yet (default 50)",
    ),
    "session_timeout_ms": (int, "group session timeout (default 10000)"),
    "heartbeat_interval_ms": (int, "group heartbeat interval (default 3000)"),
    "progress_interval": (float, "seconds between progress log lines, 0 for none (default 10)"),
    "redis_timeout": (float, "seconds one Redis call may take (default 5)"),
    "topic_wait": (float, "seconds to wait at start for the topic to exist (default 60)"),
    "log_level": (str, "debug, info, warning or error (default info)"),
    "policy": (str, "the policy (a .toml file or package.module:attribute) whose levels alert"),
    "alert_webhook": (str, "http(s) URL each alert is POSTed to (CloudEvent JSON)"),
    "alert_topic": (str, "Kafka topic for alerts (default mcpbg.alerts; '' for none)"),
    "archive_dir": (str, "folder for the Parquet archive, written before each batch applies"),
    "metrics_port": (int, "serve Prometheus metrics on this port (default 0: off)"),
    "partitions": (
        int,
        "create the ledger topic with this many partitions if missing (default 0: wait)",
    ),
    "concurrency": (int, "partitions whose batches are applied at once (default 1)"),
}
