"""``mcpbg archive compact``: merge an archive's small Parquet segments (one per batch).

A live worker compacts as it goes (``archive_segment_mb`` / ``archive_segment_age``);
this command does it for an archive written before that, or by a worker that was
stopped before its segments were due. Idempotent and resumable: run it again after
an interruption. ``--dry-run`` shows what it would do. docs/ledger-format.md
(*Compaction*) says how a reader never counts an event twice meanwhile.
"""

from __future__ import annotations

import argparse
from typing import Any

from .ledger_args import add_option, required


def register(sub: Any) -> None:
    p = sub.add_parser(
        "archive",
        help="maintain the Parquet archive (compact small segments)",
        description="Maintain the Parquet archive the worker writes.",
    )
    actions = p.add_subparsers(dest="action", required=True)
    c = actions.add_parser(
        "compact",
        help="merge each day's small segments of a partition into few large ones",
        description=(
            "Merge each date folder's small segments of one partition into one file per "
            "--archive-segment-mb of them; finish what an interrupted run left."
        ),
    )
    add_option(c, "archive_dir", "the Parquet archive the worker writes")
    add_option(c, "archive_segment_mb")
    c.add_argument("--topic", help="compact only this topic's segments (default: every topic)")
    c.add_argument("--dry-run", action="store_true", help="show what would change; change nothing")
    c.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from ..errors import InvalidInputError
    from ..settings import resolve
    from ..stream.compaction import compact_archive
    from .render import console

    folder = Path(required(args, "archive_dir", "the Parquet archive"))
    if not folder.is_dir():
        raise InvalidInputError("--archive-dir", str(folder), "an existing folder")
    given = args.archive_segment_mb
    if given is not None:
        try:
            given = int(given)
        except ValueError:
            raise InvalidInputError("--archive-segment-mb", given, "an integer") from None
    mb = resolve(["archive_segment_mb"], None, {"archive_segment_mb": given})["archive_segment_mb"]
    err = Console(stderr=True)
    bar = Progress(
        "{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,  # piped stderr stays the one-line error channel
    )
    with bar:
        task = bar.add_task("planning" if args.dry_run else "compacting segments", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        summary = compact_archive(
            folder, max_bytes=mb * 1_000_000, topic=args.topic, dry_run=args.dry_run,
            progress=progress,
        )  # fmt: skip
    out = console()
    if summary.runs == 0 and not summary.finished:
        out.print(
            f"nothing to compact: {summary.files_before} segment(s) in {summary.groups} "
            "partition-day(s)"
        )
        return 0
    if args.dry_run:
        out.print(
            f"would compact {summary.files_before} segment(s) ({summary.bytes_before:,} bytes) "
            f"into {summary.files_after} in {summary.groups} partition-day(s); "
            f"{summary.runs} file(s) to write"
        )
        return 0
    out.print(
        f"compacted {summary.files_before} segment(s) ({summary.bytes_before:,} bytes) into "
        f"{summary.files_after} ({summary.bytes_after:,} bytes) in {summary.groups} "
        f"partition-day(s)"
        + (f"; finished {summary.finished} left by an interrupted run" if summary.finished else "")
        + (
            f"; removed {summary.temp_removed} stale temporary file(s)"
            if summary.temp_removed
            else ""
        )
    )
    return 0
