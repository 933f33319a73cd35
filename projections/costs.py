"""Cost questions over the ledger view (``mcpbg costs``): spend by user, tenant, tool,
model and day, top spenders, breaker trips.

Every figure comes from the ``costs`` view of ``projections/ledger_view.py``
(one row per event; an event's USD is its first USD charge, so dollars
charged to two USD limits count once; reservations net out with their
settlements). ``limit=`` reads one limit's USD charges instead. Money is summed
in DuckDB as integers (``sum`` of BIGINT is an exact HUGEINT) and comes back
as Python ints of USD micros; nothing here goes through a float.

>>> report = spend(con, ["tenant"], Filter())  # doctest: +SKIP
>>> report.headers, report.rows[0]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import duckdb

from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.limits import NAME_PATTERN
from mcp_budget_governor.money import Unit, format_usd
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.scopes import Scope

from .ledger_view import query_error
from .sql_quote import quote_ident

__all__ = [
    "DIMENSIONS",
    "Filter",
    "Report",
    "breaker_trips",
    "costs_json",
    "costs_reports",
    "session_budget",
    "session_split",
    "spend",
    "summary",
]

#: What spend can be grouped by, and the SQL expression of each.
DIMENSIONS: dict[str, str] = {
    "user": '"user"',
    "tenant": "tenant",
    "tool": "tool",
    "model": "model",
    "agent": "agent",
    "day": "strftime(\"time\", '%Y-%m-%d')",
    "hour": "strftime(\"time\", '%Y-%m-%dT%H:00Z')",
    "week": "strftime(\"time\", '%G-W%V')",  # ISO week, UTC like the others
    "month": "strftime(\"time\", '%Y-%m')",
    "type": "type",
}
#: Sum columns of a spend report, after the dimensions.
METRICS = (
    "events",
    "calls",
    "rejected",
    "model_calls",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "usd_micros",
)


@dataclass(frozen=True, slots=True)
class Filter:
    """Which events count: a time range ``[start, end)`` and exact context values.

    ``limit``: read USD from this limit's charges instead of the one-per-event rule.
    ``session``: a session and its forks (events whose ``session_root``, else
    ``session``, is this one).
    """

    start: datetime | None = None
    end: datetime | None = None
    user: str | None = None
    tenant: str | None = None
    tool: str | None = None
    model: str | None = None
    limit: str | None = None
    session: str | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and not NAME_PATTERN.fullmatch(self.limit):
            raise InvalidInputError("limit", self.limit, "a limit name")
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise InvalidInputError("to", self.end.date().isoformat(), "must be after --from")

    def where(self) -> tuple[str, list[Any]]:
        """The SQL condition over ``costs`` rows and its parameters."""
        parts: list[str] = []
        params: list[Any] = []
        if self.start is not None:
            parts.append('"time" >= ?')
            params.append(self.start)
        if self.end is not None:
            parts.append('"time" < ?')
            params.append(self.end)
        for name, column in (
            ("user", '"user"'),
            ("tenant", "tenant"),
            ("tool", "tool"),
            ("model", "model"),
        ):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{column} = ?")
                params.append(value)
        if self.session is not None:
            parts.append('coalesce(session_root, "session") = ?')
            params.append(self.session)
        return (" AND ".join(parts) or "TRUE"), params

    def relation(self) -> tuple[str, list[Any]]:
        """The event rows to sum: ``costs``, or with ``limit`` its USD re-read from that limit."""
        if self.limit is None:
            return "costs", []
        return (
            """(SELECT c.* REPLACE (coalesce(l.usd, 0) AS usd_micros,
                                    CASE WHEN l.usd IS NULL THEN NULL ELSE ? END AS usd_limit)
                FROM costs c LEFT JOIN (
                    SELECT id, sum(amount) AS usd FROM ledger
                    WHERE "limit" = ? AND unit = 'usd_micros' GROUP BY id) l USING (id))""",
            [self.limit, self.limit],
        )


@dataclass(slots=True)
class Report:
    """A table: headers and rows; ``money`` names the columns holding USD micros."""

    title: str
    headers: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    money: tuple[str, ...] = ("usd_micros",)


#: The temporary table :func:`read_once` fills.
SNAPSHOT_TABLE = "_mcpbg_costs_snapshot"


def read_once(con: duckdb.DuckDBPyConnection, flt: Filter) -> None:
    """Read the ``costs`` rows of ``flt``'s time range once, and point ``costs`` at them.

    ``mcpbg costs`` runs several reports; without this each one scans (and
    deduplicates) the archive again, paying DuckDB's cost per file each
    time. Afterwards they scan the temporary table, and agree with each other
    even while a worker writes. Only the time range is applied here; each
    report applies the rest of the filter. The first call on a connection
    holds for it (its callers, ``mcpbg costs`` and ``GET /v1/costs``, open
    one connection per filter).
    """
    where, params = Filter(flt.start, flt.end).where()
    try:
        done = con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [SNAPSHOT_TABLE]
        ).fetchall()
        if done[0][0]:
            return
        con.execute(
            f"CREATE TEMP TABLE {SNAPSHOT_TABLE} AS SELECT * FROM costs WHERE {where}", params
        )
        con.execute(f"CREATE OR REPLACE TEMP VIEW costs AS SELECT * FROM {SNAPSHOT_TABLE}")
    except duckdb.Error as exc:
        raise query_error(exc) from None


def _run(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any]) -> list[list[Any]]:
    try:
        return [list(r) for r in con.execute(sql, list(params)).fetchall()]
    except duckdb.Error as exc:
        raise query_error(exc) from None


_SUMS = """
    count(*) AS events,
    count(*) FILTER (WHERE type = 'mcpbg.admitted.v1') AS calls,
    count(*) FILTER (WHERE type = 'mcpbg.rejected.v1') AS rejected,
    count(model) AS model_calls,
    coalesce(sum(input_tokens), 0) AS input_tokens,
    coalesce(sum(output_tokens), 0) AS output_tokens,
    coalesce(sum(cache_read_tokens), 0) AS cache_read_tokens,
    coalesce(sum(cache_write_tokens), 0) AS cache_write_tokens,
    coalesce(sum(usd_micros), 0) AS usd_micros"""


def spend(
    con: duckdb.DuckDBPyConnection,
    by: Sequence[str],
    flt: Filter,
    *,
    top: int | None = None,
) -> Report:
    """Spend and usage grouped by ``by`` (names in :data:`DIMENSIONS`), most spent first
    (in time order when grouped by time only); ``top`` keeps the first N rows."""
    for name in by:
        if name not in DIMENSIONS:
            raise InvalidInputError("by", name, f"one of {', '.join(DIMENSIONS)}")
    if top is not None and top < 1:
        raise InvalidInputError("top", top, "at least 1")
    relation, rel_params = flt.relation()
    where, params = flt.where()
    dims = ", ".join(f"{DIMENSIONS[n]} AS {quote_ident(n)}" for n in by)
    timely = bool(by) and all(n in ("day", "hour", "week", "month") for n in by)
    order = ", ".join(quote_ident(n) for n in by) if timely else "usd_micros DESC, events DESC"
    group = f"GROUP BY {', '.join(str(i + 1) for i in range(len(by)))}" if by else ""
    sql = f"""
        SELECT {dims + "," if dims else ""} {_SUMS}
        FROM {relation} AS e WHERE {where} {group}
        ORDER BY {order}{", " + ", ".join(quote_ident(n) for n in by) if by and not timely else ""}
        {"LIMIT ?" if top else ""}
    """
    title = f"spend by {', '.join(by)}" if by else "total"
    limit = [top] if top else []
    return Report(title, [*by, *METRICS], _run(con, sql, [*rel_params, *params, *limit]))


def summary(con: duckdb.DuckDBPyConnection, flt: Filter) -> Report:
    """One row: the period, event counts, tokens and spend over everything the filter keeps."""
    relation, rel_params = flt.relation()
    where, params = flt.where()
    sql = f"""
        SELECT strftime(min("time"), '%Y-%m-%dT%H:%M:%SZ') AS first,
               strftime(max("time"), '%Y-%m-%dT%H:%M:%SZ') AS last, {_SUMS}
        FROM {relation} AS e WHERE {where}
    """
    return Report("summary", ["first", "last", *METRICS], _run(con, sql, [*rel_params, *params]))


def session_split(con: duckdb.DuckDBPyConnection, flt: Filter) -> Report:
    """Spend of the filtered events split into ``tools`` (tool calls, priced per call)
    and ``models`` (metered model tokens): an event with a model is a model's."""
    relation, rel_params = flt.relation()
    where, params = flt.where()
    sql = f"""
        SELECT kind, {_SUMS} FROM (
            SELECT *, CASE WHEN model IS NULL THEN 'tools' ELSE 'models' END AS kind
            FROM {relation} AS e WHERE {where})
        GROUP BY kind ORDER BY kind DESC
    """
    return Report("spend split", ["kind", *METRICS], _run(con, sql, [*rel_params, *params]))


def session_budget(con: duckdb.DuckDBPyConnection, flt: Filter, policy: Policy) -> Report:
    """The budget line of ``flt.session``: per USD limit of ``policy`` counting per
    session, what the session and its forks were charged on it, its cap and what is left."""
    rows = []
    for lim in policy.limits:
        if Scope.SESSION not in lim.dimensions or lim.unit is not Unit.USD_MICROS:
            continue
        one = dataclasses.replace(flt, limit=lim.name)
        relation, rel_params = one.relation()
        where, params = one.where()
        sql = f"SELECT coalesce(sum(usd_micros), 0) FROM {relation} AS e WHERE {where}"
        ((spent,),) = _run(con, sql, [*rel_params, *params])
        rows.append([lim.name, int(spent), lim.cap, max(lim.cap - int(spent), 0)])
    return Report(
        "session budget",
        ["limit", "usd_micros", "cap_usd_micros", "remaining_usd_micros"],
        rows,
        money=("usd_micros", "cap_usd_micros", "remaining_usd_micros"),
    )


def breaker_trips(con: duckdb.DuckDBPyConnection, flt: Filter, *, top: int | None = None) -> Report:
    """Calls shed by a tripped breaker: rejections with status 503 that no fail mode
    decided (``degraded`` marks those), per breaker limit, tenant and user."""
    where, params = flt.where()
    sql = f"""
        SELECT decision_limit AS breaker, tenant, "user", count(*) AS trips,
               strftime(min("time"), '%Y-%m-%dT%H:%M:%SZ') AS first,
               strftime(max("time"), '%Y-%m-%dT%H:%M:%SZ') AS last
        FROM costs
        WHERE type = 'mcpbg.rejected.v1' AND status = 503 AND NOT degraded AND {where}
        GROUP BY ALL ORDER BY trips DESC, breaker, tenant, "user"
        {"LIMIT ?" if top else ""}
    """
    return Report(
        "breaker trips",
        ["breaker", "tenant", "user", "trips", "first", "last"],
        _run(con, sql, [*params, top] if top else params),
        money=(),
    )


#: The views of ``mcpbg costs`` with no ``--by``, after the summary.
_DEFAULT_VIEWS = ("tenant", "user", "tool", "model", "day")


def costs_reports(
    con: duckdb.DuckDBPyConnection,
    flt: Filter,
    *,
    by: list[str] | None = None,
    top: int | None = None,
    policy: Policy | None = None,
) -> list[Report]:
    """The tables ``mcpbg costs`` shows (and ``GET /v1/costs`` returns): ``by`` one
    grouping; else a session's split (``flt.session``); else the summary views."""
    if not by:  # several reports: the archive is read once for all of them
        read_once(con, flt)

    if flt.session is not None and not by:
        reports = [
            summary(con, flt),
            session_split(con, flt),
            spend(con, ["tool"], flt, top=top),
            spend(con, ["model"], flt, top=top),
        ]
        if policy is not None:
            reports.append(session_budget(con, flt, policy))
        return reports
    if by:
        return [spend(con, by, flt, top=top)]
    top = top or 10
    reports = [summary(con, flt)]
    for name in _DEFAULT_VIEWS:
        report = spend(con, [name], flt, top=top)
        if name == "user":
            report.title = f"top {top} spenders"
        reports.append(report)
    reports.append(breaker_trips(con, flt, top=top))
    return reports


def costs_json(reports: list[Report]) -> dict[str, list[dict[str, Any]]]:
    """``--json``'s document: per table title, its rows (usd as exact decimals)."""
    return {r.title: _json_rows(r) for r in reports}


def _json_rows(report: Report) -> list[dict[str, Any]]:
    out = []
    for row in report.rows:
        item = dict(zip(report.headers, row, strict=True))
        for h in report.money:
            if h in item:
                item[h.removesuffix("_micros")] = format_usd(int(item[h]))
        out.append(item)
    return out
