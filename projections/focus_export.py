"""FOCUS CostAndUsage export: the ledger's costs aggregated in DuckDB, written atomically.

:func:`export_focus` reads the ``costs`` view of :func:`~.ledger_view.open_ledger`
(one row per event, its USD counted once: the rule ``mcpbg costs`` uses too),
keeps the events of the period with a USD amount (and the settlements without
charges of their reservations: calls whose estimate stood, billed nothing),
splits each model call's micros over its token meters
(``mcp_budget_governor.focus``'s rule, computed here in integer SQL: HUGEINT
products, no float), aggregates per charge period
(hour or day), tenant, user, tool, model, meter and unit price, renders every
value as FOCUS text (exact decimals with a decimal point, ``...Z`` times,
printable-ASCII strings), checks the rows against the rules focus-validator
does not enforce, and writes CSV or Parquet through a temporary file in the
target folder renamed at the end: a failure leaves no partial file.

>>> options = ExportOptions(*windows.parse_period("2026-11"))  # doctest: +SKIP
>>> # only the period's date folders are read:
>>> con = open_ledger(archive, since=options.start, until=options.end)  # doctest: +SKIP
>>> export_focus(con, "focus-2026-11.csv", options)  # doctest: +SKIP
ExportResult(rows=..., billed_micros=..., ...)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import duckdb

from mcp_budget_governor.csv_safety import neutralise_sql
from mcp_budget_governor.errors import GovernorError, InvalidInputError, UnknownModelError
from mcp_budget_governor.focus import (
    FOCUS_1_2,
    METERS,
    TOKEN_METERS,
    FocusVersion,
    Granularity,
    Kind,
    Meter,
    ascii_text,
    rate_text,
)
from mcp_budget_governor.focus_checks import check_columns, check_row
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.record_log import fsync_dir
from mcp_budget_governor.projections.ledger_view import LedgerError, query_error, require_events
from mcp_budget_governor.projections.sql_quote import quote_ident as _ident
from mcp_budget_governor.projections.sql_quote import quote_string as _quote

__all__ = ["ExportError", "ExportOptions", "ExportResult", "export_focus", "focus_table"]

#: Output formats by file suffix.
FORMATS = {".csv": "csv", ".parquet": "parquet"}
_MICROS_SCALE = 6
# Rates are scaled to integers by 10**scale; tokens (<= 2**53) x rate must stay
# well inside HUGEINT (2**127), and the ListCost decimal inside DECIMAL(38).
_MAX_RATE_UNITS = 10**20


class ExportError(GovernorError):
    """The export cannot be made (bad output path, a row breaking a FOCUS rule...)."""


@dataclass(frozen=True)
class ExportOptions:
    """What to export: ``[start, end)`` in UTC, the row granularity and the account names."""

    start: datetime
    end: datetime
    granularity: Granularity = Granularity.HOUR
    billing_account_id: str = "mcpbg"
    billing_account_name: str = "mcp-budget-governor"
    provider: str = "mcp-budget-governor"
    version: FocusVersion = FOCUS_1_2
    #: How errors name the period (``--period 2026-11``); default: the UTC range.
    label: str | None = None


@dataclass
class ExportResult:
    """What :func:`export_focus` wrote."""

    path: Path
    format: str
    rows: int
    events: int
    billed_micros: int
    seconds: float
    stages: dict[str, float] = field(default_factory=dict)


Progress = Callable[[str], None]


def _noop(_: str) -> None:
    return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _big(value: int) -> str:
    """An integer literal DuckDB reads exactly, whatever its size."""
    return f"CAST('{value}' AS HUGEINT)" if abs(value) >= 2**62 else str(value)


def _dec_sql(expr: str, scale: int) -> str:
    """SQL text of ``expr / 10**scale`` exactly: ``focus.decimal_text`` in SQL.

    Through an exact DECIMAL (integer arithmetic) and DuckDB's own decimal
    text, with trailing zeros dropped but one digit kept after the point.
    """
    if scale == 0:
        return f"(CAST({expr} AS VARCHAR) || '.0')"
    text = f"rtrim(CAST({_scaled_sql(expr, scale)} AS VARCHAR), '0')"
    return f"(CASE WHEN ends_with({text}, '.') THEN {text} || '0' ELSE {text} END)"


def _rates_table(con: duckdb.DuckDBPyConnection, models: list[str], prices: PriceTable) -> int:
    """Create ``_fx_rates`` (model, tier start, rates as integers x 10**scale); return scale."""
    from mcp_budget_governor.focus import tier_rates

    tiers: list[tuple[str, int, tuple[Decimal, ...]]] = []
    for model in models:
        try:
            price = prices.price_of(model)
        except UnknownModelError as exc:
            raise ExportError(
                f"{exc} (the ledger holds costs of it; give the table that priced it with --prices)"
            ) from None
        tiers += [(model, start, rates) for start, rates in tier_rates(price)]
    scale = 0
    for _, _, rates in tiers:
        for rate in rates:
            exponent = rate.normalize().as_tuple().exponent
            assert isinstance(exponent, int)
            scale = max(scale, -exponent)
    rows = []
    for model, start, rates in tiers:
        units = [int(rate.scaleb(scale)) for rate in rates]
        if max(units) >= _MAX_RATE_UNITS:
            raise ExportError(
                f"model {model!r}: a price too large or too precise to export exactly"
            )
        rows.append((model, start, *units, *(rate_text(r) for r in rates)))
    con.execute(
        "CREATE OR REPLACE TEMP TABLE _fx_rates (model VARCHAR, start BIGINT, "
        "r0 HUGEINT, r1 HUGEINT, r2 HUGEINT, r3 HUGEINT, "
        "p0 VARCHAR, p1 VARCHAR, p2 VARCHAR, p3 VARCHAR)"
    )
    if rows:
        con.executemany("INSERT INTO _fx_rates VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    return scale


def _split_sql(scale: int) -> str:
    """Per token event: the four meters' shares of its micros (``focus.split_cost`` in SQL)."""
    unit = _big(10**scale)
    ceil = [f"(n{i} * r{i} + {unit} - 1) // {unit}" for i in range(4)]
    weights = [
        f"CASE WHEN c0 + c1 + c2 + c3 > 0 THEN c{i} WHEN n0 + n1 + n2 + n3 > 0 THEN n{i} "
        f"ELSE {1 if i == 0 else 0} END"
        for i in range(4)
    ]
    ranks = []
    for i in range(4):
        beats = [f"(m{j} {'>=' if j < i else '>'} m{i})::INT" for j in range(4) if j != i]
        ranks.append("1 + " + " + ".join(beats))
    shares = ",\n".join(
        f"sg * (q{i} + CASE WHEN {ranks[i]} <= a - (q0 + q1 + q2 + q3) THEN 1 ELSE 0 END) AS s{i}"
        for i in range(4)
    )
    return f"""
        SELECT period, tenant, "user", tool, model, n0, n1, n2, n3, r0, r1, r2, r3,
               p0, p1, p2, p3, {shares}
        FROM (
            SELECT *, a * w0 // ww AS q0, a * w0 % ww AS m0, a * w1 // ww AS q1, a * w1 % ww AS m1,
                      a * w2 // ww AS q2, a * w2 % ww AS m2, a * w3 // ww AS q3, a * w3 % ww AS m3
            FROM (
                SELECT *, w0 + w1 + w2 + w3 AS ww
                FROM (
                    SELECT *, {weights[0]} AS w0, {weights[1]} AS w1,
                              {weights[2]} AS w2, {weights[3]} AS w3
                    FROM (
                        SELECT *, {ceil[0]} AS c0, {ceil[1]} AS c1,
                                  {ceil[2]} AS c2, {ceil[3]} AS c3
                        FROM (
                            SELECT e.*, r.r0, r.r1, r.r2, r.r3, r.p0, r.p1, r.p2, r.p3,
                                   CAST(abs(e.usd_micros) AS HUGEINT) AS a,
                                   CAST(sign(e.usd_micros) AS HUGEINT) AS sg,
                                   CAST(greatest(e.input_tokens - e.cache_read_tokens
                                                 - e.cache_write_tokens, 0) AS HUGEINT) AS n0,
                                   CAST(e.output_tokens AS HUGEINT) AS n1,
                                   CAST(e.cache_read_tokens AS HUGEINT) AS n2,
                                   CAST(e.cache_write_tokens AS HUGEINT) AS n3
                            FROM _fx_ev e ASOF JOIN _fx_rates r
                              ON e.model = r.model AND e.input_tokens > r.start
                        )
                    )
                )
            )
        )"""


def focus_table(
    con: duckdb.DuckDBPyConnection,
    options: ExportOptions,
    prices: PriceTable | None = None,
    progress: Progress = _noop,
) -> tuple[int, int, int]:
    """Build ``_fx_agg`` (the rows' integers) and the views ``_fx_out`` (FOCUS text) and
    ``_fx_typed`` (typed, for Parquet) over it.

    Returns (rows, costed events, billed micros).

    Raises :class:`ExportError` for an unpriced model or when the ledger has
    no event at all in the period (a month it does not cover is a mistake,
    while a covered period without costs is written as an empty export).
    """
    prices = PriceTable.builtin() if prices is None else prices
    step = "hour" if options.granularity is Granularity.HOUR else "day"
    lo, hi = options.start, options.end
    progress("reading the ledger")
    try:
        con.execute(
            f"""
            CREATE OR REPLACE TEMP TABLE _fx_ev AS
            SELECT date_trunc('{step}', "time") AS period, tenant, "user", tool, model, "type",
                   usd_micros, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                   id, reservation
            FROM costs WHERE "time" >= ? AND "time" < ?
                AND (usd_micros <> 0 OR ("type" = 'mcpbg.settled.v1' AND charges = 0
                                         AND reservation IS NOT NULL))
            """,
            [lo, hi],
        )
        # A settlement with no charges is a call whose estimate stood (its reserved
        # event billed it): a completed call when that reservation is a costed one here.
        con.execute(
            """
            DELETE FROM _fx_ev WHERE usd_micros = 0 AND reservation NOT IN (
                SELECT id FROM _fx_ev WHERE "type" = 'mcpbg.reserved.v1')
            """
        )
    except duckdb.Error as exc:
        raise query_error(exc) from None
    query = "SELECT count(*) FILTER (WHERE usd_micros <> 0) FROM _fx_ev"
    (events,) = con.execute(query).fetchone() or (0,)
    if not events:
        _require_events(con, options)
    models = [
        m
        for (m,) in con.execute(
            "SELECT DISTINCT model FROM _fx_ev WHERE model IS NOT NULL"
        ).fetchall()
    ]
    scale = _rates_table(con, sorted(models), prices)
    progress(f"splitting and aggregating {events:,} costed events")
    con.execute(f"CREATE OR REPLACE TEMP TABLE _fx_split AS {_split_sql(scale)}")
    meters = [
        f"SELECT period, tenant, \"user\", tool, model, '{meter.value}' AS meter, "
        f"r{i} AS rate, p{i} AS price, n{i} AS qty, s{i} AS micros, "
        f"CAST(0 AS HUGEINT) AS calls FROM _fx_split WHERE n{i} > 0 OR s{i} <> 0"
        for i, meter in enumerate(TOKEN_METERS)
    ]
    tool = Meter.TOOL_CALLS.value
    # A few hundred distinct periods: their FOCUS text is made once each, then joined.
    ts = "'%Y-%m-%dT%H:%M:%SZ'"
    con.execute(
        f"""
        CREATE OR REPLACE TEMP TABLE _fx_periods AS
        SELECT period, strftime(period, {ts}) AS _cps,
               strftime(period + INTERVAL 1 {step}, {ts}) AS _cpe,
               strftime(date_trunc('month', period), {ts}) AS _bps,
               strftime(date_trunc('month', period) + INTERVAL 1 MONTH, {ts}) AS _bpe
        FROM (SELECT DISTINCT period FROM _fx_ev)
        """
    )
    con.execute(
        f"""
        CREATE OR REPLACE TEMP TABLE _fx_agg AS
        SELECT * FROM (
            SELECT period, tenant, "user", tool, model, meter, rate, price,
                   CAST(sum(qty) AS HUGEINT) AS qty, CAST(sum(micros) AS HUGEINT) AS micros,
                   CAST(sum(calls) AS HUGEINT) AS calls, count(*) AS events
            FROM ({" UNION ALL ".join(meters)}) t
            GROUP BY ALL
            UNION ALL
            SELECT period, tenant, "user", tool, NULL AS model, '{tool}' AS meter,
                   CAST(NULL AS HUGEINT) AS rate, '1.0' AS price,
                   CAST(sum(usd_micros) AS HUGEINT) AS qty,
                   CAST(sum(usd_micros) AS HUGEINT) AS micros,
                   CAST(count(*) FILTER (WHERE "type" IN ('mcpbg.metered.v1', 'mcpbg.settled.v1'))
                        AS HUGEINT) AS calls,
                   count(*) AS events
            FROM _fx_ev WHERE model IS NULL
            GROUP BY ALL
        ) JOIN _fx_periods USING (period)
        ORDER BY period, tenant NULLS FIRST, "user" NULLS FIRST, tool NULLS FIRST,
                 model NULLS FIRST, meter, rate
        """
    )
    for name in ("_fx_split", "_fx_ev", "_fx_rates", "_fx_periods"):
        con.execute(f"DROP TABLE IF EXISTS {name}")
    (billed,) = con.execute("SELECT coalesce(sum(micros), 0) FROM _fx_agg").fetchone() or (0,)
    progress("rendering FOCUS rows")
    escaped = _text_table(con)
    con.execute(f"CREATE OR REPLACE TEMP VIEW _fx_out AS {_render_sql(options, scale, escaped)}")
    typed = _render_sql(options, scale, escaped, typed=True)
    con.execute(f"CREATE OR REPLACE TEMP VIEW _fx_typed AS {typed}")
    (rows,) = con.execute("SELECT count(*) FROM _fx_agg").fetchone() or (0,)
    # What check_table reads in full: every row, or a repeatable sample of a large export.
    sample = (
        f" USING SAMPLE reservoir({CHECK_SAMPLE} ROWS) REPEATABLE (7)"
        if rows > CHECK_SAMPLE
        else ""
    )
    con.execute(f"CREATE OR REPLACE TEMP TABLE _fx_sample AS SELECT * FROM _fx_agg{sample}")
    sampled = _render_sql(options, scale, escaped, table="_fx_sample")
    con.execute(f"CREATE OR REPLACE TEMP VIEW _fx_sample_out AS {sampled}")
    return rows, events, int(billed)


def _require_events(con: duckdb.DuckDBPyConnection, options: ExportOptions) -> None:
    """Raise :class:`ExportError` unless the ledger has some event (costed or not) in the period."""
    try:
        require_events(con, options.start, options.end, options.label)
    except LedgerError as exc:
        raise ExportError(str(exc)) from None


def _text_table(con: duckdb.DuckDBPyConnection) -> bool:
    """``_fx_text(raw, txt)``: the dimension values that are not printable ASCII, escaped.

    Returns whether there is any (the rendering joins the table only then).
    """
    values = con.execute(
        """
        SELECT DISTINCT v FROM (
            SELECT tenant AS v FROM _fx_agg UNION ALL SELECT "user" FROM _fx_agg
            UNION ALL SELECT tool FROM _fx_agg UNION ALL SELECT model FROM _fx_agg)
        WHERE v IS NOT NULL AND NOT regexp_full_match(v, '[ -$&-~]*')
        """
    ).fetchall()
    con.execute("CREATE OR REPLACE TEMP TABLE _fx_text (raw VARCHAR PRIMARY KEY, txt VARCHAR)")
    if values:
        con.executemany(
            "INSERT INTO _fx_text VALUES (?, ?)", [(v, ascii_text(v)) for (v,) in values]
        )
    return bool(values)


def _scaled_sql(expr: str, scale: int) -> str:
    """``expr`` (an integer) / 10**scale as an exact DECIMAL(38, scale) (integer arithmetic)."""
    if scale == 0:
        return f"CAST({expr} AS DECIMAL(38, 0))"
    unit = "0." + "0" * (scale - 1) + "1"
    whole = f"CAST({expr} AS DECIMAL({37 - scale}, 0))"
    return f"({whole} * CAST('{unit}' AS DECIMAL({scale + 1}, {scale})))"


def _render_sql(
    options: ExportOptions, scale: int, escaped: bool, table: str = "_fx_agg", typed: bool = False
) -> str:
    """The FOCUS rows from ``table`` (and ``_fx_text``): text, or typed values for Parquet.

    Text is what CSV holds (and what the rules check); typed holds the same
    integers as exact DECIMALs, timestamps as TIMESTAMPTZ.
    """
    step = "1 HOUR" if options.granularity is Granularity.HOUR else "1 DAY"
    tool = Meter.TOOL_CALLS.value
    token = f"meter <> '{tool}'"

    def case(column: str) -> str:
        return (
            "CASE meter "
            + " ".join(
                f"WHEN '{m.value}' THEN {_quote(getattr(spec, column))}"
                for m, spec in METERS.items()
            )
            + " END"
        )

    # Computed once per row in the inner query, used by several columns.
    shared = {"_billed": _dec_sql("micros", _MICROS_SCALE)}
    billed = "_billed"
    tags = (
        "nullif('{' || concat_ws(',', "
        + ", ".join(
            f"CASE WHEN {c} IS NOT NULL THEN '\"{k}\":' || CAST(to_json({c}) AS VARCHAR) END"
            for k, c in (("tenant", "x_tenant"), ("user", "x_user"), ("tool", "x_tool"))
        )
        + ") || '}', '{}')"
    )
    shared["_sku"] = (
        f"CASE WHEN {token} THEN x_model || ':' || meter "
        f"WHEN x_tool IS NULL THEN '{tool}' ELSE x_tool || ':{tool}' END"
    )
    sku = "_sku"
    columns = {
        "BilledCost": billed,
        "BillingAccountId": _quote(options.billing_account_id),
        "BillingAccountName": _quote(options.billing_account_name),
        "BillingCurrency": "'USD'",
        "BillingPeriodEnd": "_bpe",
        "BillingPeriodStart": "_bps",
        "ChargeCategory": "'Usage'",
        "ChargeClass": "CAST(NULL AS VARCHAR)",
        "ChargeDescription": (
            f"CASE WHEN {token} THEN x_model ELSE coalesce(x_tool, '(no tool)') END "
            f"|| ' ' || {case('description')}"
        ),
        "ChargeFrequency": "'Usage-Based'",
        "ChargePeriodEnd": "_cpe",
        "ChargePeriodStart": "_cps",
        "CommitmentDiscountStatus": "CAST(NULL AS VARCHAR)",
        "ConsumedQuantity": _dec_sql(f"CASE WHEN {token} THEN qty ELSE calls END", 0),
        "ConsumedUnit": case("consumed_unit"),
        "ContractedCost": billed,
        "EffectiveCost": billed,
        "InvoiceId": "CAST(NULL AS VARCHAR)",
        "InvoiceIssuerName": _quote(options.provider),
        "ListCost": (
            f"CASE WHEN {token} THEN {_dec_sql('qty * rate', scale + _MICROS_SCALE)} "
            f"ELSE {billed} END"
        ),
        "ListUnitPrice": "price",
        "PricingCategory": "'Standard'",
        "PricingQuantity": _dec_sql("qty", _MICROS_SCALE),
        "PricingUnit": case("pricing_unit"),
        "ProviderName": _quote(options.provider),
        "PublisherName": _quote(options.provider),
        "ServiceCategory": case("service_category"),
        "ServiceName": case("service_name"),
        "ServiceSubcategory": case("service_subcategory"),
        "SkuId": sku,
        "SkuMeter": case("sku_meter"),
        "SkuPriceDetails": "CAST(NULL AS VARCHAR)",
        "SkuPriceId": f"({sku}) || ':' || price",
        "SubAccountId": "x_tenant",
        "SubAccountName": "x_tenant",
        "Tags": tags,
        "x_UserId": "x_user",
        "x_ToolName": "x_tool",
        "x_ModelId": "x_model",
        "x_Meter": "meter",
        "x_EventCount": "CAST(events AS VARCHAR)",
    }
    if typed:
        columns["SkuId"] = shared["_sku"]
        columns["SkuPriceId"] = f"({shared['_sku']}) || ':' || price"
        micros = _scaled_sql("micros", _MICROS_SCALE)
        columns.update(
            {
                "BilledCost": micros,
                "ContractedCost": micros,
                "EffectiveCost": micros,
                "BillingPeriodEnd": "date_trunc('month', period) + INTERVAL 1 MONTH",
                "BillingPeriodStart": "date_trunc('month', period)",
                "ChargePeriodEnd": f"period + INTERVAL {step}",
                "ChargePeriodStart": "period",
                "ConsumedQuantity": _scaled_sql(f"CASE WHEN {token} THEN qty ELSE calls END", 0),
                "ListCost": (
                    f"CASE WHEN {token} THEN {_scaled_sql('qty * rate', scale + _MICROS_SCALE)} "
                    # Same DECIMAL type in both branches: a CASE over two scales
                    # would be cast to the smaller one, rounding the token costs.
                    f"ELSE {_scaled_sql(f'micros * {_big(10**scale)}', scale + _MICROS_SCALE)} END"
                ),
                "ListUnitPrice": f"CAST(price AS DECIMAL(38, {scale}))",
                "PricingQuantity": _scaled_sql("qty", _MICROS_SCALE),
                "x_EventCount": "events",
            }
        )
    missing = [n for n in options.version.names if n not in columns]
    if missing:
        raise ExportError(f"FOCUS {options.version.version}: no mapping for {missing}")
    if not typed:
        # CSV text is read by spreadsheets: string cells that would start a formula
        # (a user id "=HYPERLINK(...)") get a leading quote; numbers and Parquet stay.
        for c in options.version.columns:
            if c.kind is Kind.STRING:
                columns[c.name] = neutralise_sql(f"({columns[c.name]})")
    select = ",\n".join(f"{columns[n]} AS {_ident(n)}" for n in options.version.names)
    dims = (("x_tenant", "tenant"), ("x_user", "user"), ("x_tool", "tool"), ("x_model", "model"))
    if escaped:  # rare: only then pay for the joins
        joins = " ".join(
            f"LEFT JOIN _fx_text {alias} ON {alias}.raw = a.{_ident(col)}" for alias, col in dims
        )
        picks = ", ".join(
            f"coalesce({alias}.txt, a.{_ident(col)}) AS {alias}" for alias, col in dims
        )
        source = f"(SELECT a.*, {picks} FROM {table} a {joins})"
    else:
        picks = ", ".join(f"{_ident(col)} AS {alias}" for alias, col in dims)
        source = f"(SELECT *, {picks} FROM {table})"
    if not typed:
        inner = ", ".join(f"{expr} AS {name}" for name, expr in shared.items())
        source = f"(SELECT *, {inner} FROM {source})"
    # The table is sorted; a plain projection keeps its order.
    return f"SELECT {select} FROM {source}"


#: Rows of a larger export are checked whole on a repeatable sample of this size.
CHECK_SAMPLE = 10_000
#: Columns whose distinct values are few and checked completely, whatever the size.
_COMPLETE = (
    (
        "ChargeCategory",
        "ChargeClass",
        "ChargeFrequency",
        "PricingCategory",
        "ServiceCategory",
        "ServiceSubcategory",
        "CommitmentDiscountStatus",
        "ConsumedUnit",
        "PricingUnit",
        "SkuMeter",
        "ServiceName",
        "BillingCurrency",
        "x_Meter",
    ),
    ("BillingPeriodStart", "ChargePeriodStart", "ChargePeriodEnd", "BillingPeriodEnd"),
    ("SubAccountId", "SubAccountName"),
    ("x_UserId",),
    ("x_ToolName",),
    ("x_ModelId",),
)


def check_table(con: duckdb.DuckDBPyConnection, version: FocusVersion = FOCUS_1_2) -> list[str]:
    """Check ``_fx_out`` against ``focus_checks.check_row``; return the problems found.

    Every row of an export of at most :data:`CHECK_SAMPLE` rows is checked; a
    larger one on a repeatable sample of that many rows (``_fx_sample_out``), plus every distinct
    value of the low-cardinality columns (enumerations, periods, names), so
    the rules that depend on the data's values are checked completely; the
    numbers are rendered by construction (integer arithmetic, tested against
    ``focus.decimal_text`` and ``focus.split_cost``).
    """
    names = [d[0] for d in con.execute("SELECT * FROM _fx_out LIMIT 0").description]
    problems = check_columns(names, version)
    (total,) = con.execute("SELECT count(*) FROM _fx_agg").fetchone() or (0,)
    queries = []
    if total > CHECK_SAMPLE:
        queries.append("SELECT * FROM _fx_sample_out")
        for columns in _COMPLETE:
            present = [c for c in columns if c in names]
            if present:
                queries.append(
                    f"SELECT DISTINCT {', '.join(_ident(c) for c in present)} FROM _fx_out"
                )
    else:
        queries.append("SELECT * FROM _fx_out")
    for query in queries:
        cursor = con.execute(query)
        header = [d[0] for d in cursor.description or ()]
        for values in cursor.fetchall():
            if issues := check_row(dict(zip(header, values, strict=True)), version):
                problems += issues
                if len(problems) >= 10:
                    return problems
    return problems


def _write(con: duckdb.DuckDBPyConnection, target: Path, fmt: str) -> None:
    path = _quote(str(target))
    if fmt == "csv":
        con.execute(f"COPY (SELECT * FROM _fx_out) TO {path} (FORMAT csv, HEADER true)")
    else:
        con.execute(f"COPY (SELECT * FROM _fx_typed) TO {path} (FORMAT parquet, COMPRESSION zstd)")


def export_focus(
    con: duckdb.DuckDBPyConnection,
    out: str | os.PathLike[str],
    options: ExportOptions,
    *,
    prices: PriceTable | None = None,
    progress: Progress = _noop,
    check: bool = True,
) -> ExportResult:
    """Write the FOCUS export of ``options``' period to ``out`` (``.csv`` or ``.parquet``).

    ``con`` holds the ledger views (:func:`~.ledger_view.open_ledger`).
    ``prices`` gives the per-meter rates (default: the built-in table). The
    file appears whole or not at all: written to a hidden temporary file in
    the same folder, renamed at the end, removed on any error.
    """
    started = time.perf_counter()
    target = Path(out)
    fmt = FORMATS.get(target.suffix.lower())
    if fmt is None:
        raise InvalidInputError("--out", str(out), "the file name must end in .csv or .parquet")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise ExportError(f"--out {target}: no such folder {folder}")
    if target.is_dir():
        raise ExportError(f"--out {target}: is a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ExportError(f"--out {target}: folder {folder} is not writable")
    stages: dict[str, float] = {}
    mark = time.perf_counter()
    temp = folder / f".{target.name}.{secrets.token_hex(4)}.tmp"
    try:
        rows, events, billed = focus_table(con, options, prices, progress)
        stages["aggregate"] = time.perf_counter() - mark
        if check:
            mark = time.perf_counter()
            progress(f"checking {rows:,} rows against the FOCUS rules")
            problems = check_table(con, options.version)
            stages["check"] = time.perf_counter() - mark
            if problems:
                raise ExportError(
                    f"a row breaks a FOCUS rule, nothing written: {problems[0]} "
                    f"({len(problems)} problems)"
                )
        mark = time.perf_counter()
        progress(f"writing {rows:,} rows to {target}")
        try:
            _write(con, temp, fmt)
        except duckdb.Error as exc:
            raise ExportError(f"--out {target}: writing failed: {_first_line(exc)}") from None
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, target)
        fsync_dir(folder)
        stages["write"] = time.perf_counter() - mark
    except duckdb.Error as exc:
        raise query_error(exc) from None
    except OSError as exc:
        raise ExportError(f"--out {target}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        for view in ("_fx_out", "_fx_typed", "_fx_sample_out"):
            with contextlib.suppress(duckdb.Error):
                con.execute(f"DROP VIEW IF EXISTS {view}")
        for name in (
            *("_fx_text", "_fx_agg", "_fx_sample", "_fx_ev", "_fx_split", "_fx_rates"),
            "_fx_periods",
        ):
            with contextlib.suppress(duckdb.Error):
                con.execute(f"DROP TABLE IF EXISTS {name}")
    return ExportResult(
        path=target,
        format=fmt,
        rows=rows,
        events=events,
        billed_micros=int(billed),
        seconds=time.perf_counter() - started,
        stages=stages,
    )
