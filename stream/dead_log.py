"""The dead letters of a worker, kept beside its Parquet archive.

The dead-letter topic is where a poison record goes; the archive is what
``mcpbg costs``, FOCUS, ``mcpbg replay`` and ``mcpbg reconcile`` read. A record
the store refused was archived before the store saw it (the archive is
written before each apply), so the archive must say that it was refused: each
dead letter is appended here, one JSON line per record, ``<archive>/_dead/
<topic>-p<partition>.jsonl`` (not Parquet: the archive's readers never read
it as a segment). The ledger view leaves those records out and lists them in
its ``dead_letters`` view.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as folder:
...     append(folder, "t", 0, 7, "01938f5e-0000-7000-8000-000000000000", "amount: too big")
...     [(row[0], row[1], row[3]) for row in read(folder)]
[('t:0', 7, 'amount: too big')]
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

__all__ = ["FOLDER", "append", "read"]

#: The folder of the dead-letter log inside an archive folder.
FOLDER = "_dead"


def append(
    archive_dir: str | os.PathLike[str],
    topic: str,
    partition: int,
    offset: int,
    event_id: str | None,
    reason: str,
) -> None:
    """Append one dead letter to the archive's log, fsync'd before returning."""
    folder = Path(archive_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    line = orjson.dumps(
        {"topic": topic, "partition": partition, "offset": offset, "id": event_id, "reason": reason}
    )
    fd = os.open(folder / f"{topic}-p{partition}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def read(archive_dir: str | os.PathLike[str]) -> list[tuple[str, int, str | None, str]]:
    """Every dead letter of the archive: ``(topic:partition, offset, event id, reason)``,
    each once (a worker that restarted may have written one twice)."""
    folder = Path(archive_dir) / FOLDER
    seen: dict[tuple[str, int], tuple[str, int, str | None, str]] = {}
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else ():
        for line in path.read_bytes().splitlines():
            try:
                doc = orjson.loads(line)
                name, offset = f"{doc['topic']}:{int(doc['partition'])}", int(doc["offset"])
                seen.setdefault((name, offset), (name, offset, doc.get("id"), str(doc["reason"])))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut short by a crash: its record is dead-lettered again
    return list(seen.values())
