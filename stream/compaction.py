"""Compaction: a partition's small archive segments merged into one, never losing or doubling a row.

The worker writes one small segment per batch (durable before the batch is
applied, so a crash never loses an event); this module merges a date folder's
small segments of one partition into one ``.compact.parquet`` file whose
Parquet metadata names its sources (a manifest). The steps, each safe to
stop after (``docs/ledger-format.md``, *Compaction*):

1. read the sources, sort by offset, drop rows repeated at the same offset;
2. write the merged rows to a hidden temporary file and fsync it;
3. rename it into place and fsync the folder (the merged file is now visible);
4. delete the sources it names, then fsync the folder.

Between 3 and 4 the merged file and its sources are both on disk: readers
count each ``(id, charge_index)`` once (the ledger view's rule), and the next
compaction (:func:`finish`) deletes the sources the manifest names first.

>>> parse_segment("date=2025-11-29/mcpbg.ledger-p3-" + "0" * 19 + "5-" + "0" * 18 + "10.parquet")
Segment(topic='mcpbg.ledger', partition=3, first=5, last=10, compacted=False)
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from mcp_budget_governor.producers.record_log import fsync_dir

from .archiver import COMPRESSION, SCHEMA, TEMP_SUFFIX, segment_name, write_atomically

__all__ = [
    "COMPACT_SUFFIX",
    "KILL_ENV",
    "SOURCES_KEY",
    "Compactor",
    "Group",
    "Segment",
    "Summary",
    "compact",
    "compact_archive",
    "finish",
    "parse_segment",
    "plan",
    "scan",
]

#: What a compacted segment's name ends in (it still matches ``*.parquet``).
COMPACT_SUFFIX = ".compact.parquet"
#: The Parquet key-value metadata of a compacted segment: a JSON list of its sources' names.
SOURCES_KEY = b"mcpbg.archive.sources"
#: Test hook: a process given this variable SIGKILLs itself right after the step it names
#: (``read``, ``written``, ``renamed``, ``deleted-one``, ``deleted``).
KILL_ENV = "ARCHIVE_TEST_KILL_AT"

_NAME = re.compile(
    r"^(?P<topic>[A-Za-z0-9._-]+)-p(?P<partition>\d+)-(?P<first>\d{20})-(?P<last>\d{20})"
    r"(?P<compact>\.compact)?\.parquet$"
)


@dataclass(frozen=True, slots=True)
class Segment:
    """What a segment's name says: topic, partition, offset range, compacted or not."""

    topic: str
    partition: int
    first: int
    last: int
    compacted: bool


def parse_segment(path: str | os.PathLike[str]) -> Segment | None:
    """The segment a file name describes, None for any other file."""
    match = _NAME.match(Path(path).name)
    if match is None:
        return None
    return Segment(
        match["topic"],
        int(match["partition"]),
        int(match["first"]),
        int(match["last"]),
        match["compact"] is not None,
    )


def compacted_name(topic: str, partition: int, first: int, last: int) -> str:
    """``<topic>-p<partition>-<first>-<last>.compact.parquet``."""
    return segment_name(topic, partition, first, last).removesuffix(".parquet") + COMPACT_SUFFIX


@dataclass(slots=True)
class Group:
    """One date folder's segments of one topic partition: the small ones and the compacted."""

    folder: Path
    topic: str
    partition: int
    small: list[Path] = field(default_factory=list)
    compacted: list[Path] = field(default_factory=list)

    def small_bytes(self) -> int:
        return sum(_size(p) for p in self.small)

    def oldest(self) -> float:
        """The oldest small segment's modification time (now when there is none)."""
        return min((_mtime(p) for p in self.small), default=time.time())


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()


def scan(
    directory: str | os.PathLike[str],
    topic: str | None = None,
    *,
    folders: Iterable[str] | None = None,
) -> list[Group]:
    """Every (date folder, topic, partition) of an archive with its segments, sorted.

    ``folders``: only the folders of these names.
    """
    groups: dict[tuple[Path, str, int], Group] = {}
    root = Path(directory)
    if not root.is_dir():
        return []
    if folders is None:
        listed = sorted(p for p in root.iterdir() if p.is_dir())
    else:
        listed = [root / name for name in sorted(folders) if (root / name).is_dir()]
    for folder in listed:
        for path in sorted(folder.iterdir()):
            seg = parse_segment(path)
            if seg is None or (topic is not None and seg.topic != topic):
                continue
            key = (folder, seg.topic, seg.partition)
            group = groups.get(key)
            if group is None:
                group = groups[key] = Group(folder, seg.topic, seg.partition)
            (group.compacted if seg.compacted else group.small).append(path)
    return [groups[k] for k in sorted(groups, key=lambda k: (str(k[0]), k[1], k[2]))]


def encode_sources(names: list[str]) -> bytes:
    """A manifest as stored: the JSON list of names, zlib-compressed, base64.

    Compressed because an hour of one-per-batch segments is a thousand names
    or more, and every reader reads the footer: names that differ only in
    their offsets compress about twenty-fold.
    """
    return base64.b64encode(zlib.compress(json.dumps(names).encode(), 9))


def sources_of(path: Path) -> list[str]:
    """The names a compacted segment's manifest lists ([] for a segment without one)."""
    meta = pq.read_metadata(path).metadata or {}
    raw = meta.get(SOURCES_KEY)
    if raw is None:
        return []
    text = raw if raw.startswith(b"[") else zlib.decompress(base64.b64decode(raw))
    return [str(n) for n in json.loads(text)]


def finish(group: Group, *, step: Callable[[str], None] | None = None) -> int:
    """Delete the segments a compacted one of ``group`` already holds; returns how many.

    What a compaction stopped between its rename and its last delete left
    behind: small segments, or compacted ones a day's merge holds. Only what
    a *root* holds (a compacted segment no other one names) is deleted,
    through the manifests, so a file is never deleted on the word of a file
    that is deleted too. Updates ``group.small`` and ``group.compacted``.
    """
    if not group.compacted:
        return 0
    manifests: dict[str, list[str]] = {}
    for path in group.compacted:
        with contextlib.suppress(FileNotFoundError):
            manifests[path.name] = [n for n in sources_of(path) if n != path.name]
    named = {n for names in manifests.values() for n in names}
    todo = [name for name in manifests if name not in named]
    held: set[str] = set()
    while todo:
        for name in manifests.get(todo.pop(), ()):
            if name not in held:
                held.add(name)
                todo.append(name)
    gone = [p for p in group.small + group.compacted if p.name in held]
    _delete(gone, group.folder, step)
    group.small = [p for p in group.small if p.name not in held]
    group.compacted = [p for p in group.compacted if p.name not in held]
    return len(gone)


def closed(folder: Path, now: float, after: float) -> bool:
    """Whether ``folder`` (``date=YYYY-MM-DD``) is a day that ended ``after`` seconds ago."""
    try:
        day = datetime.strptime(folder.name, "date=%Y-%m-%d").replace(tzinfo=UTC)
    except ValueError:
        return False
    return day.timestamp() + 86_400 + after <= now


def plan_day(group: Group, max_bytes: int) -> list[list[Path]]:
    """A closed day's compacted segments of ``group`` in runs of ``max_bytes`` (offset order);
    only runs of two or more (one file per partition per day, or per ``max_bytes``)."""
    return [r for r in _runs(group.compacted, max_bytes) if len(r) > 1]


def plan(group: Group, max_bytes: int) -> list[list[Path]]:
    """``group``'s small segments in runs of about ``max_bytes`` each (offset order).

    A lone small segment is a run too: rewritten, it gains the compacted name,
    so a folder shows at a glance what is done.
    """
    return _runs(group.small, max_bytes)


def _runs(paths: list[Path], max_bytes: int) -> list[list[Path]]:
    """``paths`` in offset order, cut into runs that each reach ``max_bytes`` (the last may not)."""
    runs: list[list[Path]] = []
    run: list[Path] = []
    size = 0
    for path in sorted(paths, key=_first_offset):
        run.append(path)
        size += _size(path)
        if size >= max_bytes:
            runs.append(run)
            run, size = [], 0
    if run:
        runs.append(run)
    return runs


def _first_offset(path: Path) -> tuple[int, int]:
    seg = parse_segment(path)
    assert seg is not None
    return seg.first, seg.last


def compact(
    group: Group,
    sources: list[Path],
    *,
    compression: str = COMPRESSION,
    step: Callable[[str], None] | None = None,
    delete: bool = True,
) -> Path:
    """Merge ``sources`` (small segments of ``group``) into one compacted segment.

    Returns its path. ``delete=False`` leaves the sources for the caller to
    delete later (the worker waits a grace period, so a query that listed
    them a moment ago can still open them). Raises ``FileNotFoundError``
    when a source vanished meanwhile (another process compacted it):
    nothing was changed, try again.
    """
    step = step or kill_hook()
    segs = [parse_segment(p) for p in sources]
    first = min(s.first for s in segs if s is not None)
    last = max(s.last for s in segs if s is not None)
    final = group.folder / compacted_name(group.topic, group.partition, first, last)
    names = sorted({p.name for p in sources})
    reads = list(sources)
    if final.exists() and final not in sources:  # compacted before: keep its rows
        names = sorted(set(names) | set(sources_of(final)))
        reads.append(final)
    names = [n for n in names if n != final.name]
    table = _merged(reads)
    step("read")
    write_atomically(
        group.folder,
        final.name,
        table,
        compression,
        step=step,
        key_value={SOURCES_KEY: encode_sources(names)},
    )
    step("renamed")
    if delete:
        _delete([p for p in sources if p != final], group.folder, step)
    merged = set(sources)
    group.small = [p for p in group.small if p not in merged]
    group.compacted = [p for p in group.compacted if p not in merged or p == final]
    if final not in group.compacted:
        group.compacted.append(final)
    return final


def _delete(paths: Iterable[Path], folder: Path, step: Callable[[str], None] | None = None) -> None:
    deleted = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        deleted += 1
        if deleted == 1 and step is not None:
            step("deleted-one")
    if deleted:
        fsync_dir(folder)
        if step is not None:
            step("deleted")


def _read(path: Path) -> pa.Table:
    """One segment as a table of :data:`SCHEMA` (older segments lack appended columns)."""
    # ParquetFile, not read_table: the latter would add the hive folder's ``date`` column.
    table = pq.ParquetFile(path).read()
    columns = [
        table.column(f.name).cast(f.type)
        if f.name in table.column_names
        else pa.nulls(len(table), f.type)
        for f in SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def _merged(paths: Iterable[Path]) -> pa.Table:
    """The rows of ``paths`` in (offset, charge_index) order, each (offset, charge) once.

    A Kafka offset holds one event forever, so two rows at the same offset and
    charge index are copies (a redelivery batched differently): one is kept.
    Copies of one event at two offsets (a producer retry) are both kept;
    readers count them once by event id, as before.
    """
    table = pa.concat_tables([_read(p) for p in paths]).combine_chunks()
    table = table.sort_by([("offset", "ascending"), ("charge_index", "ascending")])
    n = len(table)
    if n < 2:
        return table
    offsets = table.column("offset")
    charges = pc.fill_null(table.column("charge_index"), -1)
    repeat = pc.and_(
        pc.equal(offsets.slice(1), offsets.slice(0, n - 1)),
        pc.equal(charges.slice(1), charges.slice(0, n - 1)),
    )
    keep = pa.concat_arrays([pa.array([True]), pc.invert(repeat).combine_chunks()])
    return table.filter(keep)


def kill_hook() -> Callable[[str], None]:
    """The step hook of this process: SIGKILL at the step :data:`KILL_ENV` names (tests)."""
    at = os.environ.get(KILL_ENV, "")

    def step(name: str) -> None:
        if name == at:
            os.kill(os.getpid(), signal.SIGKILL)

    return step


def stale_temp_files(directory: Path) -> Iterator[Path]:
    """The archiver's hidden temporary files under ``directory``'s date folders."""
    return directory.glob(f"*/.*{TEMP_SUFFIX}")


#: The date folders (the newest) a worker's start looks at for what a killed one left.
START_DAYS = 2

#: Seconds after a failed compaction (a full disk...) before the worker tries again.
RETRY_AFTER = 60.0

#: Seconds the worker keeps a compacted segment's sources before deleting them: a query
#: that listed them just before the rename can still read them (readers count rows once).
DELETE_GRACE = 60.0


@dataclass(slots=True)
class _Pending:
    bytes: int
    oldest: float


class Compactor:
    """The worker's background compaction of the segments it (or a killed worker) wrote.

    :meth:`noted` is told each segment written; :meth:`run_due` (from a
    thread, every second or so) compacts a date folder's small segments of
    one partition once they hold ``max_bytes`` or the oldest is ``max_age``
    seconds old, and deletes sources whose grace has passed. :meth:`start`
    removes what a killed process left (temporary files, sources already
    compacted) and notes the small segments already there.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        topic: str,
        *,
        max_bytes: int,
        max_age: float,
        compression: str = COMPRESSION,
        grace: float = DELETE_GRACE,
    ) -> None:
        self.directory = Path(directory)
        self.topic = topic
        self.max_bytes = max_bytes
        self.max_age = max_age
        self.compression = compression
        # Never longer than the age: a worker told to roll every second keeps no minute of files.
        self.grace = min(grace, max_age)
        # noted() runs in the event loop, run_due() in a thread.
        self._lock = threading.Lock()
        self._pending: dict[tuple[Path, int], _Pending] = {}
        self._doomed: list[tuple[float, Path, list[Path]]] = []
        self._step = kill_hook()
        # Date folders written to: each gets its day's merge once the day is over.
        self._folders: set[Path] = set()
        self.compacted = 0

    def start(self, *, days: int = START_DAYS) -> None:
        """Finish what a killed process left undone in the last ``days`` date folders and
        note their small segments (older ones are ``mcpbg archive compact``'s)."""
        recent = sorted(p.name for p in self.directory.glob("date=*") if p.is_dir())[-days:]
        for group in scan(self.directory, self.topic, folders=recent):
            self._folders.add(group.folder)
            finish(group)
            for path in group.small:
                self._note(group.folder, group.partition, _size(path), _mtime(path))

    def noted(self, paths: Iterable[Path]) -> None:
        """Segments just written (by :meth:`Archiver.write_batch`)."""
        now = time.time()
        for path in paths:
            seg = parse_segment(path)
            if seg is not None:
                self._note(path.parent, seg.partition, _size(path), now)

    def _note(self, folder: Path, partition: int, size: int, at: float) -> None:
        with self._lock:
            pending = self._pending.get((folder, partition))
            if pending is None:
                self._pending[(folder, partition)] = _Pending(size, at)
            else:
                pending.bytes += size
                pending.oldest = min(pending.oldest, at)

    def _is_due(self, pending: _Pending, now: float) -> bool:
        return pending.bytes >= self.max_bytes or now - pending.oldest >= self.max_age

    def due(self, now: float | None = None) -> bool:
        """Whether :meth:`run_due` has anything to do (cheap: no file is looked at)."""
        now = time.time() if now is None else now
        with self._lock:
            pending = list(self._pending.values())
        return any(self._is_due(p, now) for p in pending) or any(
            due <= now for due, _, _ in self._doomed
        )

    def run_due(self, *, now: float | None = None, everything: bool = False) -> int:
        """Compact every group due (every group: ``everything``); returns files written."""
        now = time.time() if now is None else now
        with self._lock:
            due = [k for k, p in self._pending.items() if everything or self._is_due(p, now)]
            for key in due:
                del self._pending[key]
        written = 0
        for n, (folder, partition) in enumerate(due):
            self._folders.add(folder)
            try:
                written += self._compact_folder(folder, partition, now)
            except BaseException:  # a full disk, say: those not done are tried in a minute
                retry = now - self.max_age + min(RETRY_AFTER, self.max_age)
                for key in due[n:]:
                    self._note(*key, 0, retry)
                raise
        written += self._merge_days(now)
        self.delete_expired(now=now, everything=everything)
        self.compacted += written
        return written

    def _compact_folder(self, folder: Path, partition: int, now: float) -> int:
        group = Group(folder, self.topic, partition)
        with contextlib.suppress(FileNotFoundError):
            for path in sorted(folder.iterdir()):
                seg = parse_segment(path)
                if seg is not None and seg.topic == self.topic and seg.partition == partition:
                    (group.compacted if seg.compacted else group.small).append(path)
        finish(group)
        written = 0
        for run in plan(group, self.max_bytes):
            written += self._merge(group, run, now)
        return written

    def _merge(self, group: Group, run: list[Path], now: float) -> int:
        """Compact ``run``; its sources are deleted after the grace. 1 if written, else 0."""
        try:
            final = compact(group, run, compression=self.compression, step=self._step, delete=False)
        except FileNotFoundError:  # another worker compacted these meanwhile
            return 0
        self._doomed.append((now + self.grace, group.folder, [p for p in run if p != final]))
        return 1

    def _merge_days(self, now: float) -> int:
        """One file per partition for each date folder whose day ended ``max_age`` ago."""
        written = 0
        for folder in sorted(self._folders):
            if not closed(folder, now, self.max_age) or any(
                f == folder for _, f, _ in self._doomed
            ):  # open, or sources in their grace still there: later
                continue
            self._folders.discard(folder)
            for group in scan(self.directory, self.topic, folders=[folder.name]):
                finish(group)
                for run in plan_day(group, self.max_bytes):
                    written += self._merge(group, run, now)
        return written

    def delete_expired(self, *, now: float | None = None, everything: bool = False) -> None:
        """Delete the sources whose grace has passed (all of them: ``everything``)."""
        now = time.time() if now is None else now
        keep = []
        for due, folder, paths in self._doomed:
            if everything or due <= now:
                _delete(paths, folder, self._step)
            else:
                keep.append((due, folder, paths))
        self._doomed = keep


@dataclass(slots=True)
class Summary:
    """What :func:`compact_archive` found and did (or, in a dry run, would do)."""

    groups: int = 0
    files_before: int = 0
    files_after: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    finished: int = 0
    temp_removed: int = 0
    runs: int = 0


def compact_archive(
    directory: str | os.PathLike[str],
    *,
    max_bytes: int,
    topic: str | None = None,
    dry_run: bool = False,
    older_than: float = 3600.0,
    day_after: float = 3600.0,
    now: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    compression: str = COMPRESSION,
) -> Summary:
    """Compact every small segment of an archive (``mcpbg archive compact``).

    Idempotent and resumable: each step is safe to stop after, and a second
    run first finishes what a stopped one left (sources still on disk next
    to the compacted file that holds them, temporary files). ``progress`` is
    called with (source files done, source files to do). Then each day that
    ended ``day_after`` seconds ago gets its compacted segments merged: one
    file per partition per day (or per ``max_bytes``).
    """
    from .archiver import remove_stale_temp_files

    root = Path(directory)
    summary = Summary()
    if not dry_run:
        summary.temp_removed = remove_stale_temp_files(root, older_than)
    groups = scan(root, topic)
    work: list[tuple[Group, list[Path]]] = []
    for group in groups:
        summary.groups += 1
        files = group.small + group.compacted
        summary.files_before += len(files)
        summary.bytes_before += sum(_size(p) for p in files)
        if dry_run:
            held = {n for p in group.compacted for n in sources_of(p)}
            group.small = [p for p in group.small if p.name not in held]
        else:
            summary.finished += finish(group)
        work += [(group, run) for run in plan(group, max_bytes)]
    now = time.time() if now is None else now
    days = [g for g in groups if closed(g.folder, now, day_after)]
    summary.runs = len(work) + sum(len(plan_day(g, max_bytes)) for g in days if not g.small)
    total = sum(len(run) for _, run in work)
    done = 0
    if progress is not None:
        progress(done, total)
    for group, run in work:
        if not dry_run:
            compact(group, run, compression=compression)
        done += len(run)
        if progress is not None:
            progress(done, total)
    if not dry_run:
        day_work = [(g, run) for g in days for run in plan_day(g, max_bytes)]
        summary.runs = len(work) + len(day_work)
        total += sum(len(run) for _, run in day_work)
        for group, run in day_work:
            compact(group, run, compression=compression)
            done += len(run)
            if progress is not None:
                progress(done, total)
    for group in groups:
        if dry_run:
            after = len(group.compacted) + len(plan(group, max_bytes))
            if group in days:  # about: one per partition-day, unless past max_bytes
                after = min(after, 1)
            summary.files_after += after
        else:
            summary.files_after += len(group.small) + len(group.compacted)
            summary.bytes_after += sum(_size(p) for p in group.small + group.compacted)
    return summary
