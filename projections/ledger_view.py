"""The ledger as one typed DuckDB view: the Parquet archive and the embedded file ledger.

:func:`open_ledger` returns a DuckDB connection with the views ``ledger`` (one
row per charge, deduplicated), ``ledger_raw``, ``ledger_dates`` and ``costs``
(one row per event, the one rule for money). ``docs/ledger-format.md`` lists
their columns and rules.

>>> import asyncio, tempfile
>>> from mcp_budget_governor import Context, Governor, Limit, MemoryBackend, Policy, Scope
>>> from mcp_budget_governor import Unit, Window, usd
>>> from mcp_budget_governor.producers.file_ledger import FileLedger
>>> policy = Policy.of(Limit("spend", cap=usd(10), window=Window.DAY, scope=Scope.USER,
...                          unit=Unit.USD_MICROS, gated=False))
>>> async def two_calls(folder):
...     gov = Governor(policy, MemoryBackend(), ledger=FileLedger(folder, fsync="never"))
...     await gov.meter("spend", usd("0.25"), Context(user="alice"))
...     await gov.meter("spend", usd(1), Context(user="bob"))
...     await gov.ledger.aclose()
>>> with tempfile.TemporaryDirectory() as folder:
...     asyncio.run(two_calls(folder))
...     con = open_ledger(ledger_dir=folder)
...     con.sql('SELECT "user", sum(usd_micros) FROM costs GROUP BY 1 ORDER BY 1').fetchall()
...     con.close()
[('alice', 250000), ('bob', 1000000)]
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from mcp_budget_governor.caps import ChangeKind
from mcp_budget_governor.counters import SumCheck
from mcp_budget_governor.errors import GovernorError, InvalidInputError
from mcp_budget_governor.events import LedgerEvent, MalformedEventError, parse
from mcp_budget_governor.producers.file_ledger import DEFAULT_PREFIX
from mcp_budget_governor.producers.record_log import RecordLog
from mcp_budget_governor.projections.sql_quote import quote_ident, quote_string
from mcp_budget_governor.settings import SETTINGS
from mcp_budget_governor.stream import dead_log
from mcp_budget_governor.stream.archiver import CHARGE_COLUMNS, SCHEMA, ledger_table
from mcp_budget_governor.stream.projector import to_applied

__all__ = [
    "COLUMNS",
    "FILE_TOPIC",
    "LedgerError",
    "archive_glob",
    "open_ledger",
    "query_error",
    "range_days",
]

log = logging.getLogger(__name__)

#: The ``topic`` of file-ledger rows; their watermark fields are ``file:<segment name>``.
FILE_TOPIC = "file"
_FILE_TABLE = "_mcpbg_file_ledger"
_EMPTY_TABLE = "_mcpbg_no_archive_rows"
_DEAD_TABLE = "_mcpbg_dead_letters"
_DATES_TABLE = "_mcpbg_archive_dates"
#: The archiver's hive folders (``stream/archiver.py``: ``date=<event time's UTC date>``).
_DATE_FOLDER = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")

#: The columns of the ``ledger`` view, in order (the contract with its readers).
COLUMNS: tuple[str, ...] = (
    "time",
    "date",
    "type",
    "id",
    "user",
    "tenant",
    "tool",
    "session",
    "agent",
    "model",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "price_version",
    "charge_index",
    "limit",
    "unit",
    "amount",
    "window",
    "bucket",
    "key",
    "expire_at",
    "status",
    "decision_limit",
    "degraded",
    "reservation",
    "partition",
    "offset",
    "source",
    "topic",
    "partition_name",
    "event_source",
    "subject",
    "over",
    "session_root",
    "change",
    "spent",
)
# Event-level columns: the same on every charge row of an event.
_EVENT_COLUMNS = tuple(c for c in COLUMNS if c not in CHARGE_COLUMNS)


class LedgerError(GovernorError):
    """The ledger cannot be read: no source, a missing folder, no data, a corrupt file."""


def require_events(
    con: duckdb.DuckDBPyConnection, lo: datetime, hi: datetime, label: str | None = None
) -> None:
    """Raise :class:`LedgerError` unless the ledger has some event (costed or not) in
    ``[lo, hi)``: a period the ledger does not cover is a mistake (a typo'd month), not
    an empty report. ``mcpbg costs`` and ``mcpbg export focus`` share this rule (exit 2)."""
    (found,) = con.execute(
        'SELECT count(*) FROM (SELECT 1 FROM ledger WHERE "time" >= ? AND "time" < ? LIMIT 1)',
        [lo, hi],
    ).fetchone() or (0,)
    if found:
        return
    # From the dates the ledger holds (folder names), not its rows: a ledger
    # opened for this period only (open_ledger's since/until) names the same span.
    span = con.execute('SELECT min("date"), max("date") FROM ledger_dates').fetchone()
    held = f"{span[0]:%Y-%m-%d} to {span[1]:%Y-%m-%d}" if span and span[0] else "nothing"
    where = label or f"{lo:%Y-%m-%dT%H:%MZ} .. {hi:%Y-%m-%dT%H:%MZ}"
    raise LedgerError(f"{where}: the ledger has no event in this period (it holds {held})")


def archive_glob(archive_dir: str | os.PathLike[str]) -> str:
    """What DuckDB reads of an archive folder: ``<dir>/**/*.parquet``."""
    return str(Path(archive_dir) / "**" / "*.parquet")


def _folder(path: str | os.PathLike[str], what: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "no such folder"
        raise LedgerError(f"{what} {folder}: {problem}")
    return folder


def _parquet_files(folder: Path) -> Iterator[Path]:
    # The archiver's temporary files are hidden and end in .tmp: never matched.
    return (p for p in sorted(folder.glob("**/*.parquet")) if not p.name.startswith("."))


def range_days(since: datetime | None, until: datetime | None) -> tuple[date | None, date | None]:
    """The first and last UTC day that ``[since, until)`` touches (None: unbounded).

    ``until`` is exclusive: a range ending at midnight ends the day before.
    An empty range (``until <= since``) gives a last day before the first.
    """
    for name, value in (("since", since), ("until", until)):
        if value is not None and value.utcoffset() is None:
            raise InvalidInputError(name, value.isoformat(), "a time zone-aware datetime")
    first = None if since is None else since.astimezone(UTC).date()
    last = None if until is None else (until.astimezone(UTC) - timedelta(microseconds=1)).date()
    if first is not None and last is not None and last < first:
        last = first - timedelta(days=1)
    return first, last


def _folder_date(path: Path, folder: Path) -> date | None:
    """The hive date of an archive file: its top folder ``date=YYYY-MM-DD`` under ``folder``."""
    top = path.relative_to(folder).parts[0]
    match = _DATE_FOLDER.match(top)
    if match is None:
        return None
    try:
        return date.fromisoformat(match.group(1))
    except ValueError:
        return None


#: Columns appended to the archive later: segments written before lack them.
_OPTIONAL = frozenset({"session_root", "change", "spent"})
_REQUIRED = frozenset(SCHEMA.names) - _OPTIONAL


def _check_archive(paths: Iterable[Path]) -> int:
    """Count Parquet files, opening each footer: a corrupt one is named now.

    A file whose footer is sound but whose pages are damaged is only found
    when a query reads it; :func:`query_error` names it then.
    """
    count = 0
    for path in paths:
        try:
            names = set(pq.read_schema(path).names)
        except (OSError, pa.ArrowException) as exc:
            raise LedgerError(f"corrupt Parquet file {path}: {_first_line(exc)}") from None
        missing = _REQUIRED - names
        if missing:
            raise LedgerError(
                f"{path}: not a ledger archive segment (missing columns: "
                f"{', '.join(sorted(missing))})"
            )
        count += 1
    return count


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_reservations(
    con: duckdb.DuckDBPyConnection, now: int
) -> dict[str, dict[str, tuple[int, int]]]:
    """The reservations the ledger holds open at ``now`` (counters.Holds): reserved event
    id -> counter key -> (estimate, expire_at), for the charges whose counter lives and
    whose reservation no settled, released or recovered event of the ledger closed."""
    sql = """
        SELECT id, "key", amount, expire_at FROM ledger
        WHERE "type" = 'mcpbg.reserved.v1' AND "key" IS NOT NULL AND expire_at > ?
          AND id NOT IN (SELECT reservation FROM ledger WHERE reservation IS NOT NULL
                         AND "type" IN ('mcpbg.settled.v1', 'mcpbg.released.v1',
                                        'mcpbg.recovered.v1'))
    """
    try:
        rows = con.execute(sql, [int(now)]).fetchall()
    except duckdb.Error as exc:
        raise query_error(exc) from None
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for reservation, key, amount, expire_at in rows:
        out.setdefault(str(reservation), {})[str(key)] = (int(amount), int(expire_at))
    return out


def spent_approvals(con: duckdb.DuckDBPyConnection, now: int) -> dict[str, int]:
    """The one-time approvals the ledger's admissions spent that lapse after ``now``:
    one-time id -> when it lapses (the ``spent`` column, ``events.Spent``)."""
    try:
        rows = con.execute("SELECT DISTINCT spent FROM ledger WHERE spent IS NOT NULL").fetchall()
    except duckdb.Error as exc:
        raise query_error(exc) from None
    out: dict[str, int] = {}
    for (text,) in rows:
        for item in json.loads(text):
            if int(item["until"]) + 1 > now:
                out[str(item["once"])] = int(item["until"])
    return out


def query_error(exc: duckdb.Error) -> LedgerError:
    """A DuckDB error met while reading the ledger, as one line (it names the file)."""
    return LedgerError(f"reading the ledger failed: {_first_line(exc)}")


def _file_rows(
    folder: Path,
    *,
    prefix: str = DEFAULT_PREFIX,
    partition_prefix: str = FILE_TOPIC,
    dead: list[tuple[str, int, str | None, str]] | None = None,
) -> pa.Table | None:
    """The file ledger's records as archive rows (plus ``partition_name``), or None if empty.

    Read as :class:`~mcp_budget_governor.producers.file_ledger.FileProjector`
    reads it: a segment is a partition (its first sequence number), a
    record's index in it is its offset; a malformed record is skipped with a
    warning (the projector skips it too, so counters never held it), and so is
    an event a store would refuse (:class:`~mcp_budget_governor.counters.SumCheck`:
    a sum past the exact range, a refund below zero). Each skipped record is
    added to ``dead`` as ``(partition name, offset, event id, reason)``.
    """
    records = RecordLog(folder, prefix=prefix, writable=False)
    by_segment: dict[int, list[tuple[int, LedgerEvent]]] = {}
    sums = SumCheck()
    for record in records.read():
        pos = record.position
        if record.error is not None:
            continue
        name = f"{partition_prefix}:{records.path(pos.segment).name}"
        try:
            event = parse(record.data)
        except (MalformedEventError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, MalformedEventError) else str(exc)
            log.warning(
                "%s: malformed record %d skipped: %s", records.path(pos.segment), pos.index, reason
            )
            if dead is not None:
                dead.append((name, pos.index, None, reason))
            continue
        refused = sums.refusal(to_applied(event, pos.index))
        if refused is not None:
            log.warning(
                "%s: record %d refused, skipped: %s", records.path(pos.segment), pos.index, refused
            )
            if dead is not None:
                dead.append((name, pos.index, event.id, refused))
            continue
        by_segment.setdefault(pos.segment, []).append((pos.index, event))
    if not by_segment:
        return None
    # The archiver's row builder is the one definition of a ledger row.
    tables = []
    for segment, events in sorted(by_segment.items()):
        table, _ = ledger_table(partition_prefix, segment, events)
        name = f"{partition_prefix}:{records.path(segment).name}"
        tables.append(table.append_column("partition_name", pa.repeat(pa.scalar(name), len(table))))
    return pa.concat_tables(tables)


def _select(
    relation: str,
    source: str,
    *,
    hive_date: bool,
    partition_name: str,
    where: str = "",
    session_root: bool = True,
    change: bool = True,
    spent: bool = True,
) -> str:
    day = '"date"' if hive_date else 'CAST("time" AS DATE)'
    # Segments written before the column existed have none (``session_root=False``).
    root = "session_root" if session_root else "CAST(NULL AS VARCHAR) AS session_root"
    root += ', "change"' if change else ', CAST(NULL AS VARCHAR) AS "change"'
    root += ", spent" if spent else ", CAST(NULL AS VARCHAR) AS spent"
    return f"""
        SELECT "time", {day} AS "date", "type", id, "user", tenant, tool, "session", agent,
               model, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
               price_version, charge_index, "limit", unit, amount, "window", bucket, "key",
               expire_at, CAST(status AS INTEGER) AS status, decision_limit, degraded,
               reservation, "partition", "offset", {quote_string(source)} AS source, topic,
               {partition_name} AS partition_name, "source" AS event_source, subject, "over",
               {root}
        FROM {relation} {where}"""


def _has_column(db: duckdb.DuckDBPyConnection, relation: str, column: str) -> bool:
    """Whether any file of an archive relation has ``column`` (reads footers only)."""
    try:
        names = [d[0] for d in db.execute(f"SELECT * FROM {relation} LIMIT 0").description]
    except duckdb.Error as exc:
        raise query_error(exc) from None
    return column in names


def _archive_relation(
    folder: Path, first: date | None, last: date | None, ranged: bool
) -> tuple[str | None, list[date], int]:
    """What to read of the archive: (a ``read_parquet`` relation or None, its dates, files).

    Without a range: the whole archive by one glob, read live. With one: a
    glob per ``date=`` folder of the range, listed now (files added later to
    those folders are seen, a date folder created later is not), plus any
    Parquet file outside a date folder (undated: never pruned). Only the
    files read have their footers checked; the others are never opened.
    ``union_by_name`` opens every file the glob matches when the query is
    bound, so a filter on the hive ``date`` column would not keep DuckDB away
    from the other folders' files: listing the folders is what prunes.
    """
    dates: set[date] = set()
    chosen: set[date] = set()
    undated: list[Path] = []
    files: list[Path] = []
    total = 0
    for path in _parquet_files(folder):
        total += 1
        day = _folder_date(path, folder)
        if day is not None:
            dates.add(day)
        if day is None:
            undated.append(path)
        elif (first is None or day >= first) and (last is None or day <= last):
            chosen.add(day)
        else:
            continue
        files.append(path)
    if not ranged:
        return (
            (
                f"read_parquet({quote_string(archive_glob(folder))}, {_READ_OPTIONS})"
                if total
                else None
            ),
            sorted(dates),
            _check_archive(files),
        )
    _check_archive(files)
    globs = [str(folder / f"date={day.isoformat()}" / "**" / "*.parquet") for day in sorted(chosen)]
    globs += [str(path) for path in undated]
    relation = None
    if globs:
        relation = f"read_parquet([{', '.join(map(quote_string, globs))}], {_READ_OPTIONS})"
    return relation, sorted(dates), total


_READ_OPTIONS = "hive_partitioning = true, union_by_name = true"


#: The event types of run-time changes, which ``costs`` leaves out (a grant is not spend).
_CHANGE_TYPES = ", ".join(f"'mcpbg.{kind.value}.v1'" for kind in ChangeKind)


def open_ledger(
    archive_dir: str | os.PathLike[str] | None = None,
    ledger_dir: str | os.PathLike[str] | None = None,
    *,
    con: duckdb.DuckDBPyConnection | None = None,
    file_prefix: str = DEFAULT_PREFIX,
    since: datetime | None = None,
    until: datetime | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the ``ledger``, ``ledger_raw`` and ``costs`` views.

    ``archive_dir`` is a Parquet archive (``stream/archiver.py``), read live:
    segments written after this call are seen by later queries.
    ``ledger_dir`` is a file-ledger folder (``producers/file_ledger.py``),
    read once, now (its records are parsed and held by the connection).
    Either or both. ``con``: add the views to this connection instead of a
    new in-memory one (its time zone is set to UTC).

    ``since`` / ``until`` (aware datetimes, either or both): the views hold
    only the events of the UTC days ``[since, until)`` touches. The archive
    is read from those days' ``date=`` folders only: the other files are
    neither read nor checked. Deduplication stays exact: the archiver files
    every copy of an event (a redelivery, an overlapping segment, a producer
    retry) under the UTC date of the event's own time, so all copies sit in
    the same date folder and a range of whole days keeps all or none of them.
    The file ledger is parsed whole (it has no folders to prune) and its rows
    are filtered to the same days, so both sources answer alike.

    Raises :class:`LedgerError` naming the path when no source is given, a
    folder is missing, neither holds a ledger event ("empty ledger") or a
    Parquet file is corrupt or not an archive segment.
    """
    if archive_dir is None and ledger_dir is None:
        raise LedgerError(
            f"no ledger given: an archive folder (--archive-dir, {SETTINGS['archive_dir'].env}) "
            f"or a file-ledger folder (--ledger-dir, {SETTINGS['ledger_dir'].env})"
        )
    ranged = since is not None or until is not None
    first, last = range_days(since, until)
    parts: list[str] = []
    # (partition name, offset, event id, reason) of every record the projection refused
    dead: list[tuple[str, int, str | None, str]] = []
    dates: list[str] = []
    db = duckdb.connect() if con is None else con
    db.execute("SET TimeZone = 'UTC'")
    where: list[str] = []
    if archive_dir is not None:
        folder = _folder(archive_dir, "archive folder")
        where.append(str(folder))
        dead += dead_log.read(folder)
        relation, days, files = _archive_relation(folder, first, last, ranged)
        db.execute(f"CREATE OR REPLACE TEMP TABLE {_DATES_TABLE} (date DATE)")
        if days:
            db.executemany(f"INSERT INTO {_DATES_TABLE} VALUES (?)", [(d,) for d in days])
        dates.append(f"SELECT date FROM {_DATES_TABLE}")
        partition_name = "topic || ':' || \"partition\""
        if relation is not None:
            parts.append(
                _select(
                    relation,
                    "archive",
                    hive_date=True,
                    partition_name=partition_name,
                    session_root=_has_column(db, relation, "session_root"),
                    change=_has_column(db, relation, "change"),
                    spent=_has_column(db, relation, "spent"),
                )
            )
        elif files:  # the archive holds events, none on the range's days
            db.register(_EMPTY_TABLE, SCHEMA.empty_table())
            parts.append(
                _select(_EMPTY_TABLE, "archive", hive_date=False, partition_name=partition_name)
            )
    if ledger_dir is not None:
        folder = _folder(ledger_dir, "file-ledger folder")
        where.append(str(folder))
        table = _file_rows(folder, prefix=file_prefix, dead=dead)
        if table is not None:
            db.register(_FILE_TABLE, table)
            dates.append(f'SELECT DISTINCT CAST("time" AS DATE) AS date FROM {_FILE_TABLE}')
            days_sql = [
                f'CAST("time" AS DATE) {op} DATE {quote_string(day.isoformat())}'
                for op, day in ((">=", first), ("<=", last))
                if day is not None
            ]
            parts.append(
                _select(
                    _FILE_TABLE,
                    "file",
                    hive_date=False,
                    partition_name="partition_name",
                    where=f"WHERE {' AND '.join(days_sql)}" if days_sql else "",
                )
            )
    if not parts:
        raise LedgerError(f"empty ledger: no ledger events in {' or '.join(where)}")
    db.execute(
        "CREATE OR REPLACE TEMP VIEW ledger_dates AS SELECT DISTINCT date FROM ("
        + " UNION ALL ".join(dates)
        + ")"
    )
    union = "\nUNION ALL BY NAME\n".join(parts) if len(parts) > 1 else parts[0]
    db.register(
        _DEAD_TABLE,
        pa.table(
            {
                "partition_name": pa.array([d[0] for d in dead], pa.string()),
                "offset": pa.array([d[1] for d in dead], pa.int64()),
                "id": pa.array([d[2] for d in dead], pa.string()),
                "reason": pa.array([d[3] for d in dead], pa.string()),
            }
        ),
    )
    db.execute(f"CREATE OR REPLACE TEMP VIEW dead_letters AS SELECT * FROM {_DEAD_TABLE}")
    if dead:  # records the projection refused were archived before it saw them: left out
        union = (
            f"SELECT * FROM ({union}) AS l ANTI JOIN {_DEAD_TABLE} AS d "
            'ON l.partition_name = d.partition_name AND l."offset" = d."offset"'
        )
    db.execute(f"CREATE OR REPLACE TEMP VIEW ledger_raw AS {union}")
    db.execute(
        """
        CREATE OR REPLACE TEMP VIEW ledger AS
        SELECT * FROM ledger_raw
        QUALIFY row_number() OVER (
            PARTITION BY id, charge_index
            ORDER BY ("type" = 'mcpbg.recovered.v1'), source, "partition", "offset") = 1
        """
    )
    event_columns = ", ".join(
        f"any_value({quote_ident(c)}) AS {quote_ident(c)}" for c in _EVENT_COLUMNS if c != "id"
    )
    db.execute(
        f"""
        CREATE OR REPLACE TEMP VIEW costs AS
        SELECT id, {event_columns},
               coalesce(arg_min(amount, charge_index) FILTER (WHERE unit = 'usd_micros'), 0)
                   AS usd_micros,
               arg_min("limit", charge_index) FILTER (WHERE unit = 'usd_micros') AS usd_limit,
               count(charge_index) AS charges
        FROM ledger
        -- Run-time changes (caps, plans, grants, resets) are no usage: not a cost row.
        WHERE "type" NOT IN ({_CHANGE_TYPES})
        GROUP BY id
        """
    )
    return db
