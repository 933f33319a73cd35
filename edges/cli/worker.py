"""``mcpbg worker``: project the ledger topic into the counters (Redis, or Postgres)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..settings import SETTINGS
from ..stream.config import NAMES as OPTIONS  # core only: --help needs no stream extra
from .render import install_hint

__all__ = ["OPTIONS", "register", "run"]


def register(sub: Any) -> None:
    worker = sub.add_parser(
        "worker",
        help="project the ledger topic into the counters, in Redis or Postgres (a consumer "
        "group member)",
        description="Each option may also be given as the environment variable its help "
        "names; the option wins. Every bad setting is reported at once. SIGTERM stops "
        "gracefully: the batch in hand is applied and committed, exit code 0.",
    )
    for name in OPTIONS:
        setting = SETTINGS[name]
        flags = [setting.option]
        if name == "postgres_url":
            flags.append("--postgres")  # the short form the demo takes too
        worker.add_argument(*flags, dest=name, type=setting.kind, help=setting.describe())
    worker.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..stream.config import WorkerConfig  # core only

    overrides = {name: getattr(args, name) for name in OPTIONS}
    config = WorkerConfig.from_env(**overrides)
    # Imported here: the worker needs the stream extra (aiokafka, redis, pyarrow,
    # prometheus-client), the faust engine the faust extra; ``mcpbg schema`` neither.
    extra = "faust" if config.engine == "faust" else "stream"
    try:
        if config.engine == "faust":
            from ..stream.faust_app import run as run_worker
        else:
            from ..stream.worker import run as run_worker
    except ImportError as exc:
        print(
            f"mcpbg worker: {exc}; install the {extra} extra: " + install_hint(extra),
            file=sys.stderr,
        )
        return 2
    from ..policy_file import load_policy

    if config.policy:
        load_policy(config.policy)  # a bad policy is one line now, not a log after connecting
    return run_worker(config)
