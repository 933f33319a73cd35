"""What the dashboard and the HTML reports draw, read from the ledger view (DuckDB).

Spend over time per tenant (cumulative, USD micros), refusals by reason, the
latest refusals and the first breaker trip; the ``costs`` view of
``projections/ledger_view.py`` (each event's USD once) is the one money rule.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ..projections.costs import Filter

REJECTED = "mcpbg.rejected.v1"

#: What a refusal's status says, in words (``decision.Decision.status``).
STATUS_WORDS = {
    402: "spend cap",
    403: "caller unidentified",
    429: "quota",
    503: "breaker / unavailable",
}


def reason(status: int | None, limit: str | None, degraded: bool = False) -> str:
    """A refusal's reason as the ledger records it: ``per_user_spend: spend cap (402)``."""
    words = STATUS_WORDS.get(int(status or 0), "refused")
    if status == 503 and not degraded and limit:
        words = "breaker tripped"
    elif status == 503:
        words = "counters unavailable"
    return f"{limit or 'ledger'}: {words} ({status})"


def _rows(con: Any, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    from ..projections.ledger_view import query_error

    try:
        return list(con.execute(sql, params).fetchall())
    except Exception as exc:  # duckdb.Error: one line naming the query's problem
        import duckdb

        if isinstance(exc, duckdb.Error):
            raise query_error(exc) from None
        raise


def _epoch(value: Any) -> float:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return float(value.timestamp())
    return float(value)


def counter_totals(con: Any, keys: list[str]) -> dict[str, int]:
    """What the ledger says each counter holds (the sum of its charges, as a rebuild
    computes it), for the given counter keys; keys it never charged are left out."""
    if not keys:
        return {}
    marks = ", ".join("?" for _ in keys)
    rows = _rows(
        con, f'SELECT "key", sum(amount) FROM ledger WHERE "key" IN ({marks}) GROUP BY 1', keys
    )
    return {str(key): int(total) for key, total in rows}


def spend_series(con: Any, flt: Filter, points: int = 120) -> dict[str, Any]:
    """Cumulative spend per tenant over the filter's span, in at most ``points`` steps:
    ``{"t": [epoch s...], "tenants": {tenant: [micros...]}}``."""
    where, params = flt.where()
    # The span of every event (refusals too), so the breaker's moment is on the axis.
    span = _rows(con, f'SELECT min("time"), max("time") FROM costs WHERE {where}', params)
    if not span or span[0][0] is None:
        return {"t": [], "tenants": {}}
    first, last = _epoch(span[0][0]), _epoch(span[0][1])
    step = max((last - first) / max(points - 1, 1), 1.0)
    rows = _rows(
        con,
        f"""SELECT coalesce(tenant, '(none)'),
                   CAST(floor((epoch("time") - ?) / ?) AS BIGINT) AS b, sum(usd_micros)
            FROM costs WHERE usd_micros > 0 AND {where} GROUP BY ALL ORDER BY 2""",
        [first, step, *params],
    )
    steps = int((last - first) // step) + 1
    t = [round(first + i * step, 3) for i in range(steps)]
    per: dict[str, list[int]] = {}
    for tenant, b, micros in rows:
        per.setdefault(str(tenant), [0] * steps)[min(int(b), steps - 1)] += int(micros)
    for values in per.values():
        total = 0
        for i, v in enumerate(values):
            total += v
            values[i] = total
    return {"t": t, "tenants": dict(sorted(per.items()))}


def refusals_by_reason(con: Any, flt: Filter) -> list[dict[str, Any]]:
    """How many calls each reason refused, most first."""
    where, params = flt.where()
    rows = _rows(
        con,
        f"""SELECT decision_limit, status, degraded, count(*) FROM costs
            WHERE type = '{REJECTED}' AND {where} GROUP BY ALL ORDER BY 4 DESC, 1""",
        params,
    )
    return [
        {
            "reason": reason(status, limit, bool(degraded)),
            "limit": limit,
            "status": status,
            "refusals": int(n),
        }
        for limit, status, degraded, n in rows
    ]


def latest_refusals(con: Any, flt: Filter, n: int = 20) -> list[dict[str, Any]]:
    """The ``n`` latest refusals, newest first, with their reasons."""
    where, params = flt.where()
    rows = _rows(
        con,
        f"""SELECT id, strftime("time", '%Y-%m-%dT%H:%M:%SZ'), tenant, "user", tool,
                   decision_limit, status, degraded
            FROM costs WHERE type = '{REJECTED}' AND {where}
            ORDER BY "time" DESC, id DESC LIMIT ?""",
        [*params, n],
    )
    return [
        {
            "id": i,
            "time": at,
            "tenant": tenant,
            "user": user,
            "tool": tool,
            "limit": limit,
            "status": status,
            "reason": reason(status, limit, bool(degraded)),
        }
        for i, at, tenant, user, tool, limit, status, degraded in rows
    ]


def first_trip(con: Any, flt: Filter) -> float | None:
    """When a breaker first shed a call (status 503, not degraded), epoch seconds."""
    where, params = flt.where()
    rows = _rows(
        con,
        f"""SELECT min("time") FROM costs
            WHERE type = '{REJECTED}' AND status = 503 AND NOT degraded AND {where}""",
        params,
    )
    return None if not rows or rows[0][0] is None else _epoch(rows[0][0])


def event_rows(con: Any, event_id: str) -> list[dict[str, Any]]:
    """Every stored row (one per charge) of the ledger event ``event_id``."""
    cur = con.execute("SELECT * FROM ledger WHERE id = ? ORDER BY charge_index", [event_id])
    names = [d[0] for d in cur.description]
    return [
        {
            k: (v.isoformat() if isinstance(v, datetime) else v)
            for k, v in zip(names, r, strict=True)
        }
        for r in cur.fetchall()
    ]
