"""The budgets report: one row per limit and counter in the current period.

What ``mcpbg budgets`` prints, and the demo for its in-process
:class:`MemoryBackend`: for a policy and a backend, every limit's current
bucket for the contexts asked about (``user="u_42"``), or for every counter the
backend holds (a bounded listing). Each row's ``spent`` is what
:meth:`Governor.usage` answers for the same limit and context, read by
``Backend.usage`` a thousand keys per call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, Any

from mcp_budget_governor.caps import Effective, effective
from mcp_budget_governor.context import Context
from mcp_budget_governor.counters import Backend, fits
from mcp_budget_governor.forecast import exhausts_at
from mcp_budget_governor.keys import WILDCARD, key_pattern, parse_key, parse_lease_key
from mcp_budget_governor.limits import Limit
from mcp_budget_governor.money import Unit, format_dollars
from mcp_budget_governor.planning import LEASE_BUCKET, cap_ref, slot
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.scopes import Scope
from mcp_budget_governor.windows import Bucket, Window, bucket_for

if TYPE_CHECKING:
    import duckdb

#: How many keys a report lists at most unless told otherwise.
DEFAULT_MAX_KEYS = 10_000
#: Keys read per ``usage`` call: a Redis script blocks the server while it runs,
#: so a report over many counters reads them in short scripts, not one long one.
USAGE_CHUNK = 1_000


@dataclass(frozen=True, slots=True)
class BudgetRow:
    """One limit's counter in its current period, and what it has counted."""

    limit: Limit
    key: str
    values: tuple[str, ...]
    hashed: tuple[bool, ...]
    bucket: Bucket
    spent: int
    #: The counter's effective cap, its grant and their source (``caps.resolve``).
    effective: Effective | None = None

    @property
    def name(self) -> str:
        return self.limit.name

    @property
    def scope(self) -> str:
        """``user``, ``tenant+tool`` or ``global``."""
        return self.limit.scope_label

    @property
    def who(self) -> str:
        """The scope values, readable: ``u_42``, ``tenant=acme tool=search``, ``*`` when global."""
        dims = self.limit.dimensions
        if not dims:
            return "*"
        shown = [_show(v, h) for v, h in zip(self.values, self.hashed, strict=True)]
        if len(dims) == 1:
            return shown[0]
        return " ".join(f"{d.value}={v}" for d, v in zip(dims, shown, strict=True))

    @property
    def cap(self) -> int:
        """The effective cap (value cap, plan, run-time cap, or the default)."""
        return self.limit.cap if self.effective is None else self.effective.cap

    @property
    def grant(self) -> int:
        """Extra room granted in this period (not spend)."""
        return 0 if self.effective is None else self.effective.grant

    @property
    def source(self) -> str:
        """Where the cap comes from: ``default``, ``value``, ``plan:pro``, ``run-time until …``."""
        if self.effective is None:
            return "default"
        src = self.effective.source
        if src.startswith("run-time until "):
            src = f"run-time until {_iso(int(src.rsplit(' ', 1)[1]))}"
        return src

    @property
    def remaining(self) -> int:
        return max(0, self.cap + self.grant - self.spent)

    @property
    def exceeded(self) -> bool:
        """The limit is spent: the next check it gates is refused (``counters.fits``)."""
        return not fits(self.spent, 0, self.cap + self.grant)

    def exhausts_at(self, now: float) -> float | None:
        """When the cap (with its grant) is reached at this period's rate (``forecast``)."""
        if self.bucket is LEASE_BUCKET:
            return None
        total = self.cap + self.grant
        return exhausts_at(self.spent, total, self.bucket.start, self.bucket.end, now)

    def forecast(self, now: float) -> str:
        """The table's cell: the projected time when before the period's end, else ``-``."""
        at = self.exhausts_at(now)
        if at is None or self.bucket.end is None or at >= self.bucket.end:
            return "-"
        return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M UTC")

    def as_json(self, tz: tzinfo = UTC, now: float | None = None) -> dict[str, Any]:
        """The row for machines: amounts as integers in the limit's unit."""
        values = {
            d.value: (None if h else v)
            for d, v, h in zip(self.limit.dimensions, self.values, self.hashed, strict=True)
        }
        return {
            "name": self.name,
            "scope": self.scope,
            "scope_values": values,
            "hashed": [
                d.value for d, h in zip(self.limit.dimensions, self.hashed, strict=True) if h
            ],
            "key": self.key,
            "window": self.limit.window_label,
            "period": period(self.limit.window, self.bucket, tz),
            "bucket": self.bucket.label,
            "period_start": _iso(self.bucket.start),
            "period_end": _iso(self.bucket.end),
            "unit": self.limit.unit.value,
            "spent": self.spent,
            "limit": self.cap,
            "limit_source": self.source,
            "default_limit": self.limit.cap,
            "grant": self.grant,
            "remaining": self.remaining,
            "exceeded": self.exceeded,
            **self._forecast_json(time.time() if now is None else now),
        }

    def _forecast_json(self, now: float) -> dict[str, Any]:
        at = self.exhausts_at(now)
        end = self.bucket.end
        return {
            "projected_exhaust_at": _iso(at),
            "projected_before_end": at is not None and end is not None and at < end,
        }


@dataclass(frozen=True, slots=True)
class BudgetReport:
    """The rows, and what the listing left out.

    ``listed``: how many counter keys the backend listed (the limits whose
    rows cannot be read directly); ``truncated``: it had more than ``max_keys``
    in the current periods, so some rows are missing.
    """

    rows: tuple[BudgetRow, ...]
    at: float
    tz: tzinfo
    listed: int
    truncated: bool
    #: What the ledger adds (:func:`with_ledger`); None: no ledger was read, so
    #: open reservations and session forks are not known (never zero).
    holds: LedgerHolds | None = None

    @property
    def exceeded(self) -> bool:
        return any(row.exceeded for row in self.rows)

    def as_json(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            item = row.as_json(self.tz, self.at)
            root = session_root(row)
            if root is not None:
                item["session_root"] = root
                item["forks"] = None if self.holds is None else list(self.holds.forks[root])
            rows.append(item)
        return {
            "at": _iso(self.at),
            "rows": rows,
            "listed_keys": self.listed,
            "truncated": self.truncated,
            "open_reservations": None
            if self.holds is None
            else [r.as_json() for r in self.holds.reservations],
        }


@dataclass(frozen=True, slots=True)
class OpenReservation:
    """A ``reserved`` event's charge with no ``settled`` or ``released`` event naming it."""

    id: str
    time: datetime
    limit: str
    key: str
    unit: Unit
    amount: int
    who: str

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "reserved_at": _utc(self.time).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "limit": self.limit,
            "key": self.key,
            "unit": self.unit.value,
            "amount": self.amount,
        }


@dataclass(frozen=True, slots=True)
class LedgerHolds:
    """Open reservations on the report's counters, and each session root's forks."""

    reservations: tuple[OpenReservation, ...]
    forks: dict[str, tuple[str, ...]]


def session_root(row: BudgetRow) -> str | None:
    """The session a session-window row counts for (its root), None for other rows
    or a hashed session id."""
    if row.limit.window is not Window.SESSION:
        return None
    i = row.limit.dimensions.index(Scope.SESSION)
    return None if row.hashed[i] else row.values[i]


# Reserved events whose id no settled/released event names: one row per charge.
_OPEN_RESERVATIONS = """
    SELECT r.id, r."time", r."limit", r."key", r.unit, r.amount
    FROM ledger r
    WHERE r."type" = 'mcpbg.reserved.v1' AND r."key" IS NOT NULL
      AND NOT EXISTS (
        SELECT 1 FROM ledger e
        WHERE e.reservation = r.id AND e."type" IN ('mcpbg.settled.v1', 'mcpbg.released.v1'))
    ORDER BY r."time", r.id, r.charge_index
"""
_FORKS = """
    SELECT DISTINCT session_root, "session" FROM costs
    WHERE session_root IN (SELECT unnest(?)) AND "session" <> session_root
    ORDER BY 1, 2
"""


def with_ledger(report: BudgetReport, con: duckdb.DuckDBPyConnection) -> BudgetReport:
    """``report`` with what the ledger view ``con`` (``ledger_view.open_ledger``) knows:
    the reservations still open on its rows' counters (a reserved event with no
    settled or released event for it), and the forks of each session root seen.

    Redis keeps no record of a reservation (its estimate is simply counted), so
    the ledger is where they are listed; every reservation ends with one closing
    event naming it (a release, or a settlement: without charges when the
    estimate stood), so only those still in progress, or whose process died
    before closing them, are listed.
    """
    rows = {row.key: row for row in report.rows}
    open_ = tuple(
        OpenReservation(rid, at, limit, key, Unit(unit), int(amount), rows[key].who)
        for rid, at, limit, key, unit, amount in con.execute(_OPEN_RESERVATIONS).fetchall()
        if key in rows
    )
    roots = sorted({r for r in map(session_root, report.rows) if r is not None})
    forks: dict[str, list[str]] = {root: [] for root in roots}
    if roots:
        for root, fork in con.execute(_FORKS, [roots]).fetchall():
            forks[root].append(fork)
    holds = LedgerHolds(open_, {k: tuple(v) for k, v in forks.items()})
    return dataclasses.replace(report, holds=holds)


async def budget_report(
    policy: Policy,
    backend: Backend,
    *,
    user: str | None = None,
    tenant: str | None = None,
    tool: str | None = None,
    session: str | None = None,
    agent: str | None = None,
    max_keys: int = DEFAULT_MAX_KEYS,
    now: float | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> BudgetReport:
    """Every limit's current counter for a context, or for every active key.

    With scope values given (``user="u_42"``), a limit whose scope they cover
    gets its row even when nothing was counted yet (global limits included),
    and a limit that counts per more dimensions (``user+tool``) gets a row per
    counter the backend lists for that user. With none given, every counter of
    the policy's limits in its current period gets a row, and each global
    limit one. The backend lists one limit's current period at a time
    (``keys.key_pattern``: past periods and other limits' keys never come
    back), ``max_keys`` keys in all (``truncated`` when there were more);
    ``progress(limit name, keys listed so far)`` is called before each listing.
    """
    now = time.time() if now is None else now
    tz = policy.tz
    ctx = Context(user=user, tenant=tenant, tool=tool, session=session, agent=agent)
    given = {d for d in Scope if getattr(ctx, d.value) is not None}
    found: dict[str, tuple[Limit, tuple[str, ...], tuple[bool, ...], Bucket]] = {}
    for limit in policy:
        if set(limit.dimensions) <= given:
            s = slot(limit, ctx, now, tz, 0, enforce=False)
            assert s is not None  # the context supplies every dimension
            values = tuple(getattr(ctx, d.value) for d in limit.dimensions)
            found[s.key] = (limit, values, (False,) * len(values), s.bucket)
    listed, truncated = 0, False
    known = {d: getattr(ctx, d.value) for d in given}
    for limit in policy:
        dims = set(limit.dimensions)
        if dims <= given or (given and not dims & given):
            continue  # read directly above, or about none of the given values
        if progress is not None:
            progress(limit.name, listed)
        if limit.concurrent:
            listed, truncated = await _lease_sets(
                limit, backend, known, found, listed, max_keys, truncated
            )
            if truncated:
                break
            continue
        bucket = bucket_for(limit.window, now, tz, limit.anchor_day or 1)
        # Per-value billing days: each value's current period has its own label.
        label = WILDCARD if limit.anchors else bucket.label
        pattern = key_pattern(limit.name, limit.dimensions, known, label)
        keys = await backend.counter_keys(max_keys - listed + 1, match=pattern)
        if len(keys) > max_keys - listed:
            keys, truncated = keys[: max_keys - listed], True
        listed += len(keys)
        for key in keys:
            parsed = parse_key(key)
            # A wildcard can span a separator (user=* matching "a,tool=b"): keep exact keys.
            if parsed is None or parsed.dims != limit.dimensions or key in found:
                continue
            here = bucket
            if limit.anchors:
                here = bucket_for(limit.window, now, tz, limit.anchor_for(parsed.values))
                if parsed.bucket != here.label:
                    continue  # an ended period of that value
            found[key] = (limit, parsed.values, parsed.hashed, here)
        if truncated:
            break
    order = {limit.name: i for i, limit in enumerate(policy)}
    keys_in_order = sorted(found, key=lambda k: (order[found[k][0].name], found[k][1]))
    leases = {k for k in keys_in_order if found[k][0].concurrent}
    counters = [k for k in keys_in_order if k not in leases]
    by_key: dict[str, int] = {}
    for start in range(0, len(counters), USAGE_CHUNK):
        chunk = counters[start : start + USAGE_CHUNK]
        by_key.update(zip(chunk, await backend.usage(chunk), strict=True))
    if leases:  # calls in progress: live leases, not spend
        held = sorted(leases)
        by_key.update(zip(held, await _in_progress(backend, held), strict=True))
    spent = [by_key[k] for k in keys_in_order]
    resolved = await _effective(policy, backend, keys_in_order, found, now)
    rows = tuple(
        BudgetRow(found[k][0], k, found[k][1], found[k][2], found[k][3], total, eff)
        for k, total, eff in zip(keys_in_order, spent, resolved, strict=True)
    )
    return BudgetReport(rows, now, tz, listed, truncated)


async def _in_progress(backend: Backend, keys: list[str]) -> list[int]:
    """Live leases per lease set (0 each for a backend without concurrency caps)."""
    count = getattr(backend, "in_progress", None)
    if count is None:
        return [0] * len(keys)
    out: list[int] = []
    for start in range(0, len(keys), USAGE_CHUNK):
        out += await count(keys[start : start + USAGE_CHUNK])
    return out


async def _lease_sets(
    limit: Limit,
    backend: Backend,
    known: dict[Scope, Any],
    found: dict[str, tuple[Limit, tuple[str, ...], tuple[bool, ...], Bucket]],
    listed: int,
    max_keys: int,
    truncated: bool,
) -> tuple[int, bool]:
    """Add the lease sets of concurrency cap ``limit`` holding a lease, for the values
    asked about; returns the keys listed so far and whether the listing was cut."""
    lister = getattr(backend, "lease_keys", None)
    if lister is None:
        return listed, truncated
    keys = await lister(max_keys - listed + 1)
    for key in keys:
        parsed = parse_lease_key(key)
        if parsed is None or parsed.limit != limit.name or parsed.dims != limit.dimensions:
            continue
        by_dim = dict(zip(parsed.dims, parsed.values, strict=True))
        if any(by_dim.get(d) != v for d, v in known.items()):
            continue
        if listed >= max_keys:
            return listed, True
        listed += 1
        found.setdefault(key, (limit, parsed.values, parsed.hashed, LEASE_BUCKET))
    return listed, truncated


async def _effective(
    policy: Policy,
    backend: Backend,
    keys: list[str],
    found: dict[str, tuple[Limit, tuple[str, ...], tuple[bool, ...], Bucket]],
    now: float,
) -> list[Effective | None]:
    """Each key's effective cap, as the admission script resolves it (``caps.effective``)."""
    overrides = getattr(backend, "overrides", None)
    grants_of = getattr(backend, "grants_of", None)
    if overrides is None or grants_of is None:  # a backend without run-time changes
        return [None] * len(keys)
    caps, assigned = await overrides()
    grants: list[int] = []
    counters = [k for k in keys if not found[k][0].concurrent]  # a lease set has no grant
    for start in range(0, len(counters), USAGE_CHUNK):
        grants += await grants_of(counters[start : start + USAGE_CHUNK])
    granted = dict(zip(counters, grants, strict=True))
    grants = [granted.get(k, 0) for k in keys]
    out: list[Effective | None] = []
    for key, grant in zip(keys, grants, strict=True):
        limit, values, hashed, _ = found[key]
        parsed = parse_lease_key(key) if limit.concurrent else parse_key(key)
        segment = parsed.scope if parsed is not None else ""
        ref = cap_ref(policy, limit, segment, values) if not any(hashed) else None
        if ref is None:
            out.append(Effective(limit.cap, grant, "default"))
            continue
        runtime = caps.get(ref.caps_key, {}).get(ref.field) if ref.field else None
        out.append(
            effective(
                ref,
                limit.cap,
                runtime=None if runtime is None else runtime[:2],
                assigned=assigned,
                grant=grant,
                now=now,
            )
        )
    return out


def format_amount(unit: Unit, amount: int) -> str:
    """Money in dollars (``$7.420000``), calls and tokens with thousands separators."""
    if unit is Unit.USD_MICROS:
        return format_dollars(amount)
    return f"{amount:,}"


def period(window: Window, bucket: Bucket, tz: tzinfo = UTC) -> str:
    """A bucket for people: ``2026-11-29 19:14 UTC``, ``2026-11-29``, ``2026-W48``,
    ``2026-11 (Europe/Paris)``, a billing month ``2026-11-15 to 2026-12-14``."""
    if bucket is LEASE_BUCKET or window is None:
        return "in progress"
    if bucket.start is None:
        return "this session"
    if window in (Window.MINUTE, Window.HOUR):
        return datetime.fromtimestamp(bucket.start, UTC).strftime("%Y-%m-%d %H:%M UTC")
    local = datetime.fromtimestamp(bucket.start, tz)
    if window is Window.WEEK:
        text = local.strftime("%G-W%V")
    elif window is Window.MONTH and local.day != 1:  # a billing day: both ends
        assert bucket.end is not None
        last = datetime.fromtimestamp(bucket.end, tz) - timedelta(days=1)
        text = f"{local:%Y-%m-%d} to {last:%Y-%m-%d}"
    else:
        text = local.strftime("%Y-%m-%d" if window is Window.DAY else "%Y-%m")
    return text if tz is UTC else f"{text} ({tz})"


HEADERS = (
    "name",
    "scope",
    "key",
    "window",
    "period",
    "spent",
    "limit",
    "source",
    "remaining",
    "exceeded",
    "forecast",
)
NUMERIC = ("spent", "limit", "remaining")


def table_rows(report: BudgetReport) -> list[tuple[str, ...]]:
    """The report as text cells under :data:`HEADERS`."""
    return [
        (
            row.name,
            row.scope,
            row.who,
            row.limit.window_label,
            period(row.limit.window, row.bucket, report.tz),
            format_amount(row.limit.unit, row.spent),
            format_amount(row.limit.unit, row.cap),
            row.source
            + (f" + grant {format_amount(row.limit.unit, row.grant)}" if row.grant else ""),
            format_amount(row.limit.unit, row.remaining),
            "yes" if row.exceeded else "no",
            row.forecast(report.at),
        )
        for row in report.rows
    ]


RESERVATION_HEADERS = ("reservation", "limit", "key", "amount", "reserved at")
SESSION_HEADERS = ("name", "root", "forks")
#: What the table says without a ledger source, instead of a zero.
NOT_KNOWN = (
    "open reservations and session forks: not known without a ledger "
    "(--archive-dir or --ledger-dir)"
)


def reservation_rows(report: BudgetReport) -> list[tuple[str, ...]]:
    """The open reservations as text cells under :data:`RESERVATION_HEADERS`."""
    assert report.holds is not None
    return [
        (
            r.id,
            r.limit,
            r.who,
            format_amount(r.unit, r.amount),
            _utc(r.time).strftime("%Y-%m-%d %H:%M:%S UTC"),
        )
        for r in report.holds.reservations
    ]


def session_rows(report: BudgetReport) -> list[tuple[str, ...]]:
    """Per session-window row: its root and forks, under :data:`SESSION_HEADERS`."""
    out: list[tuple[str, ...]] = []
    for row in report.rows:
        root = session_root(row)
        if root is None:
            continue
        if report.holds is None:
            forks = "not known"
        else:
            forks = ", ".join(_show(f, False) for f in report.holds.forks[root]) or "none seen"
        out.append((row.name, _show(root, False), forks))
    return out


def _show(value: str, hashed: bool) -> str:
    if hashed:
        return f"{value[:13]}… (hashed)"
    if value == "":
        return '""'
    return value if value.isprintable() else repr(value)[1:-1]


def _utc(at: datetime) -> datetime:
    """A ledger time in UTC (DuckDB may hand it back naive, in the session's UTC)."""
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
