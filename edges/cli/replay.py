"""``mcpbg replay``: rebuild the counters (Redis or Postgres) from the ledger after an outage.

``--source archive`` (the default; DuckDB over the Parquet archive, the fast
path), ``--source file`` (the embedded file ledger, same path) or
``--source kafka`` (every retained event through the projection's apply).
Stop the workers first: a write finding that a projector moved meanwhile is
refused. Exit code 0, or 2 for bad input, an unreachable service, an empty or
corrupt ledger. On Postgres (``--postgres URL``) the whole rebuild is one
transaction: nobody sees half-rebuilt counters. On Redis Cluster
(``redis+cluster://``) every slot is rebuilt on its master, or with ``--lost``
only the slots whose epoch marker is missing (a shard that restarted empty).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, ClassVar

from ..numbers import whole_argument
from .counters_args import add_counters_options, counters_store
from .ledger_args import (
    DEFAULT_TOPIC,
    add_ledger_options,
    add_option,
    required,
    setting,
)

SOURCES = ("archive", "file", "kafka")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="rebuild the counters (Redis or Postgres) from the ledger (archive, file ledger "
        "or Kafka)",
        description="Sets each counter's committed amount from the ledger, the applied-offset "
        "watermarks, the seen-id sets and the epoch marker, so the live worker resumes "
        "right after what was replayed and counts nothing twice. Stop the workers first.",
    )
    p.add_argument(
        "--source",
        default="archive",
        help="archive (default: DuckDB over --archive-dir), file (--ledger-dir) or kafka",
    )
    p.add_argument(
        "--all",
        action="store_true",
        dest="all_buckets",
        help="every bucket still alive (default: the current buckets only)",
    )
    p.add_argument(
        "--lost",
        action="store_true",
        help="Redis Cluster: rebuild only the slots whose epoch marker is missing (the shards "
        "that restarted empty), leaving the others untouched",
    )
    p.add_argument("--dry-run", action="store_true", help="show what would change; write nothing")
    p.add_argument(
        "--show",
        type=whole_argument(),
        default=50,
        help="changed counters listed by --dry-run (default 50)",
    )
    add_counters_options(p)
    add_ledger_options(p)
    add_option(p, "kafka_url", "Kafka bootstrap, kafka://host:port")
    add_option(p, "topic", "the ledger topic")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import InvalidInputError
    from ..projections.counters.rebuild import (
        RebuildReport,
        open_store,
        rebuild_from_kafka,
        rebuild_from_ledger,
    )

    source = args.source
    if source not in SOURCES:
        raise InvalidInputError("--source", source, f"one of {', '.join(SOURCES)}")
    if args.show < 0:
        raise InvalidInputError("--show", args.show, "0 or more")
    _, url = counters_store(args)
    with _Bar(args.dry_run) as bar:
        if source == "kafka":
            from ..producers.kafka_ledger import parse_bootstrap

            bootstrap = parse_bootstrap(required(args, "kafka_url", "kafka://host:port"))
            topic = setting(args, "topic") or DEFAULT_TOPIC
            result: RebuildReport = asyncio.run(
                rebuild_from_kafka(
                    url,
                    bootstrap,
                    topic,
                    all_buckets=args.all_buckets,
                    dry_run=args.dry_run,
                    progress=bar.update,
                    lost_only=args.lost,
                )
            )
        else:
            from ..projections.ledger_view import open_ledger

            client = open_store(url, cluster=True)  # first: a bad URL is the error to see
            try:
                if source == "archive":
                    folder = required(args, "archive_dir", "the Parquet archive")
                    con = open_ledger(archive_dir=folder)
                else:
                    con = open_ledger(ledger_dir=required(args, "ledger_dir", "the file ledger"))
            except BaseException:
                client.close()
                raise
            try:
                result = rebuild_from_ledger(
                    con,
                    client,
                    source=source,
                    all_buckets=args.all_buckets,
                    dry_run=args.dry_run,
                    progress=bar.update,
                    lost_only=args.lost,
                )
            finally:
                client.close()
                con.close()
    _report(result, args.show)
    return 0


def _report(result: Any, show: int) -> None:
    from .render import console, print_table

    verb = "would write" if result.dry_run else "wrote"
    print_table(
        f"replay from {result.source}" + (" (dry run: nothing written)" if result.dry_run else ""),
        ["events read", f"counters {verb}", "changed", "seen ids", "seconds", "epoch"],
        [
            [
                f"{result.events:,}",
                f"{result.counters:,}",
                f"{result.changed:,}",
                f"{result.seen_ids:,}",
                f"{result.seconds:.2f}",
                result.epoch or "-",
            ]
        ],
        numeric=["events read", f"counters {verb}", "changed", "seen ids", "seconds"],
    )
    if result.watermarks:
        print_table(
            "applied-offset watermarks (the live worker resumes after them)",
            ["partition", "before", "after"],
            [
                [name, "-" if before < 0 else before, after]
                for name, (before, after) in sorted(result.watermarks.items())
            ],
            numeric=["before", "after"],
        )
    refused = getattr(result, "refused", [])
    if refused:
        print_table(
            f"{len(refused):,} records refused (dead letters: not replayed, not billed)",
            ["partition", "offset", "event id", "reason"],
            [[p, o, i or "-", r] for p, o, i, r in refused[: max(show, 1)]],
            numeric=["offset"],
        )
    if getattr(result, "replayed_changes", 0):
        console().print(
            f"{result.replayed_changes:,} run-time changes (caps, plans, grants, resets) "
            f"{'would be ' if result.dry_run else ''}restored in ledger order"
        )
    if getattr(result, "unreplayed_changes", 0):
        console().print(
            f"warning: {result.unreplayed_changes:,} run-time changes (caps, plans, grants, "
            f"resets) are in archive segments older than the change column and were not "
            "replayed: replay with --source kafka to restore them"
        )
    if result.dry_run and result.changes and show:
        rows = [
            [c.key, c.committed_before, c.committed_after, c.in_flight_before, c.in_flight_after]
            for c in result.changes[:show]
        ]
        print_table(
            "counters that would change",
            ["key", "committed now", "committed after", "in-flight now", "in-flight after"],
            rows,
            numeric=["committed now", "committed after", "in-flight now", "in-flight after"],
        )
        if len(result.changes) > show:
            console().print(f"... and {len(result.changes) - show:,} more (--show N)")


class _Bar:
    """A rich progress bar on stderr for the replay phases (hidden when not a terminal)."""

    _LABELS: ClassVar[dict[str, str]] = {
        "read": "reading the ledger",
        "counters": "writing counters",
        "seen": "writing seen ids",
        "commit": "committing (one transaction)",
        "events": "applying events",
    }

    def __init__(self, dry_run: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        console = Console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            # Only on a terminal: piped stderr stays the one-line error channel.
            disable=not console.is_terminal,
        )
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> _Bar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, phase: str, done: int, total: int | None) -> None:
        task = self.tasks.get(phase)
        if task is None:
            task = self.tasks[phase] = self.progress.add_task(
                self._LABELS.get(phase, phase), total=total
            )
        self.progress.update(task, completed=done, total=total)
