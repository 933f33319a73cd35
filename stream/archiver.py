"""The archiver: ledger events to Parquet segments that DuckDB reads as one table.

One batch of parsed events of one partition becomes one file per UTC date,
``<dir>/date=YYYY-MM-DD/<topic>-p<partition>-<first offset>-<last offset>.parquet``,
written whole (temporary file, fsync, rename), one flat row per charge.
Readers count each ``(id, charge_index)`` once. ``docs/ledger-format.md``
describes the files, the columns and why.

>>> import tempfile
>>> from mcp_budget_governor.context import Context
>>> from mcp_budget_governor.events import encode, parse
>>> from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id
>>> entry = LedgerEntry(new_id(), EntryType.ADMITTED, 1764442477.0, Context(user="u_42"))
>>> event = parse(encode(entry, "/mcpbg/doc"))
>>> with tempfile.TemporaryDirectory() as folder:
...     [path] = Archiver(folder, topic="mcpbg.ledger").write_batch(3, [(1200, event)])
...     print(path.parent.name, path.name)
date=2025-11-29 mcpbg.ledger-p3-00000000000000001200-00000000000000001200.parquet
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.events import LedgerEvent, Spent
from mcp_budget_governor.producers.record_log import fsync_dir

__all__ = [
    "CHARGE_COLUMNS",
    "COMPRESSION",
    "SCHEMA",
    "SCHEMA_VERSION",
    "TEMP_SUFFIX",
    "Archiver",
    "ledger_table",
    "remove_stale_temp_files",
    "segment_name",
    "write_atomically",
]

#: Bumped when a column changes meaning or type; stored in each file's metadata.
SCHEMA_VERSION = "1"
#: Parquet codec: zstd writes ~10% slower than snappy here, and files are a third smaller.
COMPRESSION = "zstd"
#: Suffix of a file being written; ``*.parquet`` globs never match it.
TEMP_SUFFIX = ".tmp"

_OFFSET_DIGITS = 20
# Who writes a temporary file (its name says): dead writers' files are removed at start.
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "host"
_TEMP_TAG = re.compile(r"\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)\.[0-9a-f]{8}\.tmp$")
_STARTED = time.time()
_MAX_OFFSET = 2**63 - 1
# Kafka's rule for topic names; it also keeps them safe as part of a file name.
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICRO = timedelta(microseconds=1)
_DAY_MICROS = 86_400_000_000

_STR = pa.string()
_INT = pa.int64()

SCHEMA = pa.schema(
    [
        pa.field("topic", _STR, nullable=False),
        pa.field("partition", _INT, nullable=False),
        pa.field("offset", _INT, nullable=False),
        pa.field("id", _STR, nullable=False),
        pa.field("type", _STR, nullable=False),
        pa.field("time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("source", _STR, nullable=False),
        pa.field("subject", _STR),
        pa.field("user", _STR),
        pa.field("tenant", _STR),
        pa.field("tool", _STR),
        pa.field("session", _STR),
        pa.field("agent", _STR),
        pa.field("charge_index", _INT),
        pa.field("limit", _STR),
        pa.field("unit", _STR),
        pa.field("amount", _INT),
        pa.field("window", _STR),
        pa.field("bucket", _STR),
        pa.field("key", _STR),
        pa.field("expire_at", _INT),
        pa.field("decision_limit", _STR),
        pa.field("status", _INT, nullable=False),
        pa.field("over", pa.list_(_STR), nullable=False),
        pa.field("degraded", pa.bool_(), nullable=False),
        pa.field("model", _STR),
        pa.field("input_tokens", _INT),
        pa.field("output_tokens", _INT),
        pa.field("cache_read_tokens", _INT),
        pa.field("cache_write_tokens", _INT),
        pa.field("price_version", _STR),
        pa.field("reservation", _STR),
        # Appended (older segments lack it; readers null-fill): a fork's root session.
        pa.field("session_root", _STR),
        # Appended: a run-time change's data.change as JSON (mcpbg replay restores it).
        pa.field("change", _STR),
        # Appended: the approvals an admission spent, data.decision.spent as JSON
        # (mcpbg replay marks them spent).
        pa.field("spent", _STR),
    ],
    metadata={"mcpbg.archive.schema": SCHEMA_VERSION},
)

# Columns taken once per event, then repeated for each of its charges.
_EVENT_COLUMNS = (
    "offset",
    "id",
    "type",
    "time",
    "source",
    "subject",
    "user",
    "tenant",
    "tool",
    "session",
    "agent",
    "decision_limit",
    "status",
    "over",
    "degraded",
    "model",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "price_version",
    "reservation",
    "session_root",
    "change",
    "spent",
)
#: Columns taken once per charge (None on the row of an event without charges).
CHARGE_COLUMNS = (
    "charge_index",
    "limit",
    "unit",
    "amount",
    "window",
    "bucket",
    "key",
    "expire_at",
)
_TYPES = {field.name: field.type for field in SCHEMA}
_NO_USAGE: tuple[None, ...] = (None,) * 6
_NO_CHARGE: tuple[None, ...] = (None,) * len(CHARGE_COLUMNS)


def segment_name(topic: str, partition: int, first: int, last: int) -> str:
    """``<topic>-p<partition>-<first>-<last>.parquet``, offsets as 20 zero-padded digits."""
    return f"{topic}-p{partition}-{first:0{_OFFSET_DIGITS}d}-{last:0{_OFFSET_DIGITS}d}.parquet"


@lru_cache(maxsize=512)
def _date_folder(day: int) -> str:
    return f"date={(date(1970, 1, 1) + timedelta(days=day)).isoformat()}"


def _micros(t: datetime) -> int:
    """Exact microseconds since the epoch (a time without offset is taken as UTC)."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return (t - _EPOCH) // _MICRO


def _write_all(fd: int, data: memoryview) -> None:
    """Write every byte of ``data`` (``os.write`` may write less than asked)."""
    while data:
        written = os.write(fd, data)
        data = data[written:]


class Archiver:
    """Writes batches of one topic's events to Parquet segments under ``directory``.

    ``directory`` is a local folder, created when missing. ``compression`` is
    a Parquet codec pyarrow knows (``zstd``, ``snappy``, ``none``...).
    Instances keep no per-batch state: one archiver may serve every
    partition, from several threads at once.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        topic: str,
        compression: str = COMPRESSION,
    ) -> None:
        if not isinstance(topic, str) or not _TOPIC.match(topic) or topic in (".", ".."):
            raise InvalidInputError(
                "topic", topic, "a Kafka topic name: 1-249 of A-Z a-z 0-9 . _ -"
            )
        self.directory = Path(directory)
        self.topic = topic
        self.compression = compression
        self.directory.mkdir(parents=True, exist_ok=True)
        self._folders: set[str] = set()

    @property
    def glob(self) -> str:
        """What DuckDB reads: ``read_parquet(<glob>, hive_partitioning = true)``."""
        return str(self.directory / "**" / "*.parquet")

    def write_batch(self, partition: int, records: Sequence[tuple[int, LedgerEvent]]) -> list[Path]:
        """Archive ``records`` (``(offset, event)``, offsets strictly ascending) of ``partition``.

        Returns the files written, one per UTC date the events fall on, in
        date order (none for an empty batch). Raises ``ValueError`` for a bad
        partition or offsets that do not strictly ascend, and whatever the
        file system raises (disk full...): nothing half-written is left, and
        the caller retries the batch, which rewrites the same files.
        """
        if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
            raise InvalidInputError("partition", partition, "a partition number >= 0")
        if not records:
            return []
        table, days = self._table(partition, records)
        written: list[Path] = []
        for day, (first, last, mask) in sorted(days.items()):
            part = table if mask is None else table.filter(mask)
            folder = self._folder(day)
            written.append(
                self._write(folder, segment_name(self.topic, partition, first, last), part)
            )
        return written

    def remove_stale_temp_files(self, older_than: float = 3600.0) -> int:
        """:func:`remove_stale_temp_files` of this archive's folder."""
        return remove_stale_temp_files(self.directory, older_than)

    # -- internals -------------------------------------------------------------

    def _table(
        self, partition: int, records: Sequence[tuple[int, LedgerEvent]]
    ) -> tuple[pa.Table, dict[int, tuple[int, int, pa.Array | None]]]:
        return ledger_table(self.topic, partition, records)

    def _folder(self, day: int) -> Path:
        return self._folder_for(self.directory / _date_folder(day))

    def _folder_for(self, folder: Path) -> Path:
        """``folder``, created (and its creation made durable) the first time it is used."""
        if folder.name not in self._folders:
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                fsync_dir(self.directory)
            self._folders.add(folder.name)
        return folder

    def _write(self, folder: Path, name: str, table: pa.Table) -> Path:
        """Encode ``table`` and put it at ``folder/name`` atomically (temp, fsync, rename)."""
        try:
            return write_atomically(folder, name, table, self.compression)
        except FileNotFoundError:  # the folder was removed since (a retention job, say)
            self._folders.discard(folder.name)
            self._folder_for(folder)
            return write_atomically(folder, name, table, self.compression)


def _temp_tag() -> str:
    """``<pid>@<host>.<random>``: whose temporary file it is, so a restart can tell."""
    return f"{os.getpid()}@{_HOST}.{secrets.token_hex(4)}"


def write_atomically(
    folder: Path,
    name: str,
    table: pa.Table,
    compression: str = COMPRESSION,
    *,
    step: Callable[[str], None] | None = None,
    key_value: dict[bytes, bytes] | None = None,
) -> Path:
    """Write ``table`` to ``folder/name``: a hidden temporary file, fsync, rename, fsync folder.

    A reader sees the old file or the new one, never half of one; on an
    exception the temporary file is removed. ``step("written")`` is called
    between the fsync and the rename (compaction's crash tests stop there).
    ``key_value``: file metadata to add (not to the schema, which pyarrow
    would store a second time in its serialized Arrow schema).
    """
    sink = pa.BufferOutputStream()
    if key_value:
        with pq.ParquetWriter(sink, table.schema, compression=compression) as writer:
            writer.write_table(table)
            writer.add_key_value_metadata(key_value)
    else:
        pq.write_table(table, sink, compression=compression)
    data = memoryview(sink.getvalue())
    final = folder / name
    temp = folder / f".{name}.{_temp_tag()}{TEMP_SUFFIX}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if step is not None:
            step("written")
        os.replace(temp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise
    fsync_dir(folder)
    return final


def remove_stale_temp_files(directory: Path, older_than: float = 3600.0) -> int:
    """Delete temporary files a killed process left behind; returns how many.

    A file is left behind when its writer (named in its name: pid and host)
    is no longer running on this host, or when it is older than
    ``older_than`` seconds (a writer on another host sharing the folder).
    Any other is kept: another worker may be writing it right now.
    """
    limit = time.time() - older_than
    removed = 0
    for path in Path(directory).glob(f"date=*/.*{TEMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            if _stale(path, limit):
                path.unlink()
                removed += 1
    return removed


def _stale(path: Path, limit: float) -> bool:
    """Whether a temporary file is left over: old, or its writer (on this host) is gone."""
    if path.stat().st_mtime < limit:
        return True
    match = _TEMP_TAG.search(path.name)
    if match is None or match["host"] != _HOST:
        return False  # another host's worker may be writing it: only age tells
    pid = int(match["pid"])
    if pid == os.getpid():  # ours: written before this process started (a reused pid)?
        return path.stat().st_mtime < _STARTED
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _spent_json(spent: Sequence[Spent]) -> str | None:
    """An admission's spent approvals as the archive's ``spent`` column holds them."""
    if not spent:
        return None
    return "[" + ",".join(s.model_dump_json() for s in spent) + "]"


def ledger_table(
    topic: str, partition: int, records: Sequence[tuple[int, LedgerEvent]]
) -> tuple[pa.Table, dict[int, tuple[int, int, pa.Array | None]]]:
    """One partition's events as archive rows, and per UTC day: (first, last offset, row mask).

    The one definition of a ledger row: the archiver writes it, and the DuckDB
    ledger view builds the file ledger's rows with it.
    """
    # One tuple per event and one per charge, in the column order of
    # _EVENT_COLUMNS and CHARGE_COLUMNS, transposed at the end by zip():
    # far cheaper in Python than one append per column.
    event_rows: list[tuple[object, ...]] = []
    charge_rows: list[tuple[object, ...]] = []
    row_event: list[int] = []
    days: list[int] = []
    previous = -1
    for n, (offset, event) in enumerate(records):
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise InvalidInputError("offset", offset, "an integer offset")
        if offset <= previous or offset > _MAX_OFFSET:
            raise ValueError(
                f"{topic}:{partition}: offsets must ascend within 0..2**63-1 "
                f"({offset} after {previous})"
            )
        previous = offset
        data = event.data
        ctx = data.context
        decision = data.decision
        usage = data.usage
        micros = _micros(event.time)
        days.append(micros // _DAY_MICROS)
        if usage is None:
            tokens: tuple[object, ...] = _NO_USAGE
        else:
            tokens = (
                usage.model,
                usage.input_tokens,
                usage.output_tokens,
                usage.cache_read_tokens,
                usage.cache_write_tokens,
                usage.price_version,
            )
        event_rows.append(
            (
                offset,
                event.id,
                event.type,
                micros,
                event.source,
                event.subject,
                ctx.user,
                ctx.tenant,
                ctx.tool,
                ctx.session,
                ctx.agent,
                decision.limit,
                decision.status,
                decision.over,
                decision.degraded,
                *tokens,
                data.reservation,
                ctx.session_root,
                None if data.change is None else data.change.model_dump_json(),
                _spent_json(decision.spent),
            )
        )
        charges = data.charges
        if charges:
            for i, c in enumerate(charges):
                row_event.append(n)
                # Unit and Window are str enums: pyarrow stores their value.
                charge_rows.append(
                    (i, c.limit, c.unit, c.amount, c.window, c.bucket, c.key, c.expire_at)
                )
        else:
            row_event.append(n)
            charge_rows.append(_NO_CHARGE)

    take = pa.array(row_event, type=_INT)
    events = pa.Table.from_arrays(
        [
            pa.array(values, type=_TYPES[name])
            for name, values in zip(_EVENT_COLUMNS, zip(*event_rows, strict=True), strict=True)
        ],
        names=list(_EVENT_COLUMNS),
    ).take(take)
    count = len(row_event)
    columns: dict[str, object] = {
        "topic": pa.repeat(pa.scalar(topic, _STR), count),
        "partition": pa.repeat(pa.scalar(partition, _INT), count),
    }
    for name, values in zip(CHARGE_COLUMNS, zip(*charge_rows, strict=True), strict=True):
        columns[name] = pa.array(values, type=_TYPES[name])
    for name in _EVENT_COLUMNS:
        columns[name] = events.column(name)
    table = pa.Table.from_arrays([columns[name] for name in SCHEMA.names], schema=SCHEMA)

    # Per UTC day: first and last offset (offsets ascend), and a row mask
    # when the batch spans more than one day.
    spans: dict[int, list[int]] = {}
    for (offset, _), day in zip(records, days, strict=True):
        span = spans.get(day)
        if span is None:
            spans[day] = [offset, offset]
        else:
            span[1] = offset
    if len(spans) == 1:
        ((day, (first, last)),) = spans.items()
        return table, {day: (first, last, None)}
    row_days = pa.array(days, type=_INT).take(take)
    return table, {
        day: (first, last, pc.equal(row_days, day)) for day, (first, last) in spans.items()
    }
