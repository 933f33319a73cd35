"""A fast synthetic ledger archive: schema-valid Parquet segments for benchmarks and tests.

:func:`write_archive` writes ``events`` ledger events spread over one month
as the stream worker's archiver would (``stream/archiver.py``: same
:data:`~mcp_budget_governor.stream.archiver.SCHEMA`, one file per UTC date
and partition, named by partition and offset range). Every column is built
with pyarrow compute, never a Python loop per row, so 1,000,000 events take
a few seconds.

The mix, under a fixed policy (limit, window, scope, unit):

==============  =====  =========================================================
type            share  charges
==============  =====  =========================================================
admitted        50 %   ``burst`` (minute, user, 1 call), ``daily`` (day, user,
                       1 call), ``tenant_calls`` (day, tenant, 1 call)
rejected         5 %   none (429 by ``burst``/``daily``; one in ten a 503 by the
                       ``spend_breaker`` breaker)
metered         35 %   ``spend`` (day, tenant, USD) and ``user_spend`` (month,
                       user, USD): the *same* dollars on two USD limits, the case
                       the ledger view's ``costs`` rule counts once
reserved         5 %   ``spend`` and ``user_spend``: the estimate
settled          3 %   both: a signed delta (``reservation`` = a reserved id)
released         2 %   both: minus an estimate
==============  =====  =========================================================

Metered events are model calls: a model from :data:`MODELS`, token counts
(input includes cache reads and writes, as ``prices.py`` defines), the
built-in price table's version, and the USD cost computed from
``PriceTable.builtin()`` for those tokens, exactly (integer arithmetic,
rounded up to the micro like :meth:`PriceTable.cost_micros`; the tests
compare a sample with it). Users are skewed (a few spend most) and each
belongs to one tenant; events are partitioned by tenant like the Kafka ledger.

>>> stats = write_archive("/tmp/archive", 1_000_000, seed=1)  # doctest: +SKIP
>>> stats.usd_micros  # the month's spend, each event's USD counted once  # doctest: +SKIP

Run as a script to write one: ``python -m testing.ledger_gen DIR --events N``.
"""

from __future__ import annotations

import argparse
import calendar
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from mcp_budget_governor.keys import PREFIX
from mcp_budget_governor.ledger import partition_key, partition_of
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.stream.archiver import COMPRESSION, SCHEMA, segment_name
from mcp_budget_governor.windows import GRACE_SECONDS

__all__ = ["MODELS", "TOOLS", "TYPES", "GenStats", "write_archive"]

#: Event types in code order, with their share of events.
TYPES: tuple[tuple[str, float], ...] = (
    ("mcpbg.admitted.v1", 0.50),
    ("mcpbg.rejected.v1", 0.05),
    ("mcpbg.metered.v1", 0.35),
    ("mcpbg.reserved.v1", 0.05),
    ("mcpbg.settled.v1", 0.03),
    ("mcpbg.released.v1", 0.02),
)
#: Models of metered events (flat prices under 200k prompt tokens, all in the built-in table).
MODELS: tuple[str, ...] = (
    "gpt-4o",
    "gpt-4o-mini",
    "gpt-4.1-mini",
    "claude-sonnet-4-5",
    "claude-haiku-4-5",
    "gemini-2.5-flash",
)
TOOLS: tuple[str, ...] = ("search", "fetch", "summarize", "code", "sql", "browse")
TOPIC = "mcpbg.ledger"
PARTITIONS = 3
SOURCE = "/mcpbg/ledger-gen"

# Per (type code, charge index): limit, window, scope (0 user, 1 tenant), unit.
_CHARGES: dict[int, tuple[tuple[str, str, int, str], ...]] = {
    0: (
        ("burst", "minute", 0, "calls"),
        ("daily", "day", 0, "calls"),
        ("tenant_calls", "day", 1, "calls"),
    ),
    1: (),
    2: (("spend", "day", 1, "usd_micros"), ("user_spend", "month", 0, "usd_micros")),
    3: (("spend", "day", 1, "usd_micros"), ("user_spend", "month", 0, "usd_micros")),
    4: (("spend", "day", 1, "usd_micros"), ("user_spend", "month", 0, "usd_micros")),
    5: (("spend", "day", 1, "usd_micros"), ("user_spend", "month", 0, "usd_micros")),
}
_MAX_CHARGES = 3
_INT = pa.int64()
_STR = pa.string()
_PRICE_SCALE = 1000  # prices in thousandths of a dollar per MTok are integers for MODELS


@dataclass(frozen=True)
class GenStats:
    """What :func:`write_archive` wrote.

    ``usd_micros``: the spend under the ledger view's ``costs`` rule (each
    event's first USD charge, every event type); ``metered_usd_micros`` the
    same over metered events only. ``by_type``: events per type.
    ``amount_by_key`` is filled only when asked (``keep_totals=True``).
    """

    directory: Path
    events: int
    rows: int
    files: int
    usd_micros: int
    metered_usd_micros: int
    by_type: dict[str, int]
    seconds: float
    amount_by_key: dict[str, int] = field(default_factory=dict)


def _uniform(n: int, seed: int) -> pa.Array:
    return pc.random(n, initializer=seed)


def _ints(n: int, lo: int, hi: int, seed: int) -> pa.Array:
    """``n`` integers in ``[lo, hi)``, uniform."""
    return pc.add(pc.cast(pc.floor(pc.multiply(_uniform(n, seed), hi - lo)), _INT), lo)


def _ids(n: int, t_us: pa.Array, seed: int) -> pa.Array:
    """UUIDv7-shaped ids: 48 bits of the event's millisecond time, then random bits."""
    ms = pc.divide(t_us, 1000)
    raw = bytearray(random.Random(seed).randbytes(16 * n))
    for k in range(6):  # big-endian time bytes, column by column
        byte = pc.cast(pc.bit_wise_and(pc.shift_right(ms, 8 * (5 - k)), 255), pa.uint8())
        raw[k::16] = byte.buffers()[1].to_pybytes()[byte.offset : byte.offset + n]
    raw[6::16] = bytes((b & 0x0F) | 0x70 for b in raw[6::16])  # version 7
    raw[8::16] = bytes((b & 0x3F) | 0x80 for b in raw[8::16])  # RFC 4122 variant
    text = pa.py_buffer(raw.hex().encode())
    hexes = pc.cast(pa.Array.from_buffers(pa.binary(32), n, [None, text]), _STR)
    cut = [(0, 8), (8, 12), (12, 16), (16, 20), (20, 32)]
    return pc.binary_join_element_wise(*(pc.utf8_slice_codeunits(hexes, a, b) for a, b in cut), "-")


def _scaled_prices(table: PriceTable, model: str) -> tuple[int, int, int, int]:
    """input, output, cache-read, cache-write prices x 1000 as integers (exact for MODELS)."""
    price = table.price_of(model)
    rates = (
        price.input_per_mtok,
        price.output_per_mtok,
        price.cache_read_per_mtok
        if price.cache_read_per_mtok is not None
        else price.input_per_mtok,
        price.cache_write_per_mtok
        if price.cache_write_per_mtok is not None
        else price.input_per_mtok,
    )
    scaled = tuple(Decimal(r) * _PRICE_SCALE for r in rates)
    if any(s != s.to_integral_value() for s in scaled) or (
        price.tiers and price.tiers[0].start < 200_000
    ):
        raise ValueError(f"{model}: prices not exact in thousandths, or tiers below 200k tokens")
    return tuple(int(s) for s in scaled)  # type: ignore[return-value]


def write_archive(
    directory: str | Path,
    events: int,
    *,
    seed: int = 0,
    month: str = "2026-11",
    tenants: int = 20,
    users: int = 400,
    topic: str = TOPIC,
    partitions: int = PARTITIONS,
    keep_totals: bool = False,
) -> GenStats:
    """Write ``events`` synthetic ledger events of ``month`` (``YYYY-MM``) under ``directory``.

    Deterministic for a given ``seed``. ``keep_totals=True`` also returns
    the sum of amounts per counter key (independently of DuckDB, for tests).
    """
    started = time.perf_counter()
    if events < 1:
        raise ValueError(f"events: at least 1 (got {events})")
    year, mon = (int(x) for x in month.split("-"))
    start = datetime(year, mon, 1, tzinfo=UTC)
    days = calendar.monthrange(year, mon)[1]
    start_s = int(start.timestamp())
    month_end_s = start_s + days * 86_400
    span_us = days * 86_400 * 1_000_000
    prices = PriceTable.builtin()
    out = Path(directory)
    n = events
    s = seed * 1000 + 1

    # -- one value per event ----------------------------------------------------
    t_us = pc.add(
        pc.cast(pc.floor(pc.multiply(_uniform(n, s), span_us)), _INT), start_s * 1_000_000
    )
    t_us = pc.take(t_us, pc.sort_indices(t_us))
    u = _uniform(n, s + 1)
    bounds, acc = [], 0.0
    for _, share in TYPES:
        acc += share
        bounds.append(acc)
    code = pc.if_else(
        pc.less(u, bounds[0]),
        0,
        pc.if_else(
            pc.less(u, bounds[1]),
            1,
            pc.if_else(
                pc.less(u, bounds[2]),
                2,
                pc.if_else(pc.less(u, bounds[3]), 3, pc.if_else(pc.less(u, bounds[4]), 4, 5)),
            ),
        ),
    )
    code = pc.cast(code, _INT)
    # Skewed users (squared uniform: low numbers spend most); a user's tenant is fixed.
    uu = _uniform(n, s + 2)
    user_n = pc.cast(pc.floor(pc.multiply(pc.multiply(uu, uu), users)), _INT)
    tenant_n = pc.cast(pc.divide(pc.multiply(user_n, tenants), users), _INT)
    user_names = pa.array([f"u{i:05d}" for i in range(users)])
    tenant_names = [f"t{i:03d}" for i in range(tenants)]
    user = pc.take(user_names, user_n)
    tenant = pc.take(pa.array(tenant_names), tenant_n)
    tool = pc.take(pa.array(TOOLS), _ints(n, 0, len(TOOLS), s + 3))
    day_n = pc.divide(pc.subtract(t_us, start_s * 1_000_000), 86_400_000_000)
    session = pc.binary_join_element_wise("s", pc.cast(user_n, _STR), "-", pc.cast(day_n, _STR), "")
    ids = _ids(n, t_us, s + 10)
    time_col = pc.cast(t_us, pa.timestamp("us", tz="UTC"))

    metered = pc.equal(code, 2)
    model_n = _ints(n, 0, len(MODELS), s + 20)
    inp = _ints(n, 200, 60_000, s + 21)
    outp = _ints(n, 10, 4_000, s + 22)
    cr = pc.if_else(
        pc.less(_uniform(n, s + 23), 0.5),
        pc.cast(pc.floor(pc.multiply(pc.cast(inp, pa.float64()), _uniform(n, s + 24))), _INT),
        0,
    )
    cr = pc.cast(pc.divide(cr, 2), _INT)  # at most half the prompt
    cw = pc.if_else(pc.less(_uniform(n, s + 25), 0.2), pc.divide(inp, 10), 0)
    cw = pc.cast(cw, _INT)
    # Exact cost: sum(tokens x price/MTok) is micro-USD; prices are integers in
    # thousandths, so the sum x 1000 is an integer, rounded up once.
    table_prices = [_scaled_prices(prices, m) for m in MODELS]
    p_in, p_out, p_cr, p_cw = (pa.array([p[k] for p in table_prices], _INT) for k in range(4))
    uncached = pc.subtract(pc.subtract(inp, cr), cw)
    num = pc.add(
        pc.add(
            pc.multiply(uncached, pc.take(p_in, model_n)),
            pc.multiply(outp, pc.take(p_out, model_n)),
        ),
        pc.add(pc.multiply(cr, pc.take(p_cr, model_n)), pc.multiply(cw, pc.take(p_cw, model_n))),
    )
    cost = pc.divide(pc.add(num, _PRICE_SCALE - 1), _PRICE_SCALE)
    estimate = _ints(n, 25_000, 100_000, s + 30)
    delta = _ints(n, -25_000, 75_000, s + 31)
    usd = pc.if_else(
        metered,
        cost,
        pc.if_else(
            pc.equal(code, 3),
            estimate,
            pc.if_else(pc.equal(code, 4), delta, pc.negate(estimate)),
        ),
    )
    null_int = pa.nulls(n, _INT)
    null_str = pa.nulls(n, _STR)
    model = pc.if_else(metered, pc.take(pa.array(MODELS), model_n), null_str)
    tok = {
        "input_tokens": pc.if_else(metered, inp, null_int),
        "output_tokens": pc.if_else(metered, outp, null_int),
        "cache_read_tokens": pc.if_else(metered, cr, null_int),
        "cache_write_tokens": pc.if_else(metered, cw, null_int),
    }
    price_version = pc.if_else(metered, pa.repeat(pa.scalar(prices.version), n), null_str)
    rejected = pc.equal(code, 1)
    breaker = pc.and_(rejected, pc.less(_uniform(n, s + 40), 0.1))
    status = pc.if_else(breaker, 503, pc.if_else(rejected, 429, 200))
    decision_limit = pc.if_else(
        breaker,
        "spend_breaker",
        pc.if_else(
            rejected, pc.take(pa.array(["burst", "daily"]), _ints(n, 0, 2, s + 41)), null_str
        ),
    )
    # A settlement or release names some reserved event.
    reserved_ids = ids.filter(pc.equal(code, 3))
    if len(reserved_ids) == 0:
        reserved_ids = ids.slice(0, 1)
    ref = pc.take(reserved_ids, _ints(n, 0, len(reserved_ids), s + 42))
    reservation = pc.if_else(pc.or_(pc.equal(code, 4), pc.equal(code, 5)), ref, null_str)

    # Partitions by tenant (the Kafka ledger's key); offsets ascend in time per partition.
    part_of_tenant = pa.array(
        [partition_of(partition_key(name, None), partitions) for name in tenant_names], _INT
    )
    partition = pc.take(part_of_tenant, tenant_n)
    order = pc.sort_indices(
        pa.table({"p": partition, "t": t_us}), sort_keys=[("p", "ascending"), ("t", "ascending")]
    )
    ev = pa.table(
        {
            "partition": partition,
            "t_us": t_us,
            "time": time_col,
            "id": ids,
            "code": code,
            "user": user,
            "tenant": tenant,
            "tool": tool,
            "session": session,
            "day": day_n,
            "usd": usd,
            "model": model,
            **tok,
            "price_version": price_version,
            "status": status,
            "decision_limit": decision_limit,
            "reservation": reservation,
        }
    ).take(order)
    part_sorted = ev.column("partition").combine_chunks()
    counts = pc.value_counts(part_sorted)
    firsts: dict[int, int] = {}
    pos = 0
    for p in sorted(int(v["values"]) for v in counts.to_pylist()):
        firsts[p] = pos
        pos += int(pc.sum(pc.equal(part_sorted, p)).as_py())
    first_of = pa.array([firsts.get(p, 0) for p in range(partitions)], _INT)
    offset = pc.subtract(pa.array(range(n), _INT), pc.take(first_of, part_sorted))
    ev = ev.append_column("offset", offset)

    # -- one row per charge (rejections: one row with NULL charge columns) -------
    codes = ev.column("code").combine_chunks()
    ncharges = pc.take(pa.array([len(_CHARGES[c]) for c in range(6)], _INT), codes)
    pieces_event, pieces_k = [], []
    idx = pa.array(range(n), _INT)
    for k in range(_MAX_CHARGES):
        has = pc.greater(ncharges, k) if k else pc.greater_equal(ncharges, 0)
        sel = idx.filter(has)
        pieces_event.append(sel)
        pieces_k.append(pa.repeat(pa.scalar(k, _INT), len(sel)))
    rows_ix = pa.table({"e": pa.concat_arrays(pieces_event), "k": pa.concat_arrays(pieces_k)})
    rows_ix = rows_ix.take(
        pc.sort_indices(rows_ix, sort_keys=[("e", "ascending"), ("k", "ascending")])
    )
    e = rows_ix.column("e").combine_chunks()
    k = rows_ix.column("k").combine_chunks()
    rows = ev.take(e)
    r_code = rows.column("code").combine_chunks()
    has_charge = pc.greater(pc.take(ncharges, e), 0)
    # Lookups by (code, k): limit, window, scope, unit.
    slot = pc.add(pc.multiply(r_code, _MAX_CHARGES), k)
    table_of = [
        _CHARGES[c][j] if j < len(_CHARGES[c]) else None
        for c in range(6)
        for j in range(_MAX_CHARGES)
    ]
    lim = pc.take(pa.array([x[0] if x else None for x in table_of], _STR), slot)
    win = pc.take(pa.array([x[1] if x else None for x in table_of], _STR), slot)
    scope_kind = pc.take(pa.array([x[2] if x else None for x in table_of], _INT), slot)
    unit = pc.take(pa.array([x[3] if x else None for x in table_of], _STR), slot)
    r_t = rows.column("t_us").combine_chunks()
    # Labels by lookup (a month has 44,640 minutes at most): far cheaper than strftime per row.
    r_minute = pc.divide(pc.subtract(r_t, start_s * 1_000_000), 60_000_000)
    minute_labels = pa.array(
        [
            datetime.fromtimestamp(start_s + 60 * m, UTC).strftime("%Y%m%dT%H%M")
            for m in range(days * 1440)
        ]
    )
    day_labels = pa.array(
        [datetime.fromtimestamp(start_s + 86_400 * d, UTC).strftime("%Y%m%d") for d in range(days)]
    )
    minute_label = pc.take(minute_labels, r_minute)
    day_label = pc.take(day_labels, pc.divide(r_minute, 1440))
    month_label = f"{year:04d}{mon:02d}"
    bucket = pc.if_else(
        pc.equal(win, "minute"),
        minute_label,
        pc.if_else(pc.equal(win, "day"), day_label, month_label),
    )
    r_s = pc.divide(r_t, 1_000_000)
    minute_end = pc.add(pc.multiply(pc.divide(r_s, 60), 60), 60 + GRACE_SECONDS)
    day_end = pc.add(pc.multiply(pc.divide(r_s, 86_400), 86_400), 86_400 + GRACE_SECONDS)
    expire_at = pc.if_else(
        pc.equal(win, "minute"),
        minute_end,
        pc.if_else(pc.equal(win, "day"), day_end, month_end_s + GRACE_SECONDS),
    )
    scope = pc.if_else(
        pc.equal(scope_kind, 0),
        pc.binary_join_element_wise("user=", rows.column("user").combine_chunks(), ""),
        pc.binary_join_element_wise("tenant=", rows.column("tenant").combine_chunks(), ""),
    )
    key = pc.binary_join_element_wise(PREFIX, lim, scope, bucket, ":")
    amount = pc.if_else(pc.equal(unit, "calls"), 1, rows.column("usd").combine_chunks())
    count = len(rows)

    def null_unless(values: pa.Array, typ: pa.DataType) -> pa.Array:
        return pc.if_else(has_charge, values, pa.nulls(count, typ))

    type_names = pa.array([t for t, _ in TYPES])
    columns = {
        "topic": pa.repeat(pa.scalar(topic, _STR), count),
        "partition": rows.column("partition"),
        "offset": rows.column("offset"),
        "id": rows.column("id"),
        "type": pc.take(type_names, r_code),
        "time": rows.column("time"),
        "source": pa.repeat(pa.scalar(SOURCE, _STR), count),
        "subject": pc.binary_join_element_wise("user/", rows.column("user").combine_chunks(), ""),
        "user": rows.column("user"),
        "tenant": rows.column("tenant"),
        "tool": rows.column("tool"),
        "session": rows.column("session"),
        "agent": pa.nulls(count, _STR),
        "charge_index": null_unless(k, _INT),
        "limit": null_unless(lim, _STR),
        "unit": null_unless(unit, _STR),
        "amount": null_unless(pc.cast(amount, _INT), _INT),
        "window": null_unless(win, _STR),
        "bucket": null_unless(bucket, _STR),
        "key": null_unless(key, _STR),
        "expire_at": null_unless(pc.cast(expire_at, _INT), _INT),
        "decision_limit": rows.column("decision_limit"),
        "status": pc.cast(rows.column("status"), _INT),
        "over": _empty_lists(count),
        "degraded": pa.repeat(pa.scalar(False), count),
        "model": rows.column("model"),
        "input_tokens": rows.column("input_tokens"),
        "output_tokens": rows.column("output_tokens"),
        "cache_read_tokens": rows.column("cache_read_tokens"),
        "cache_write_tokens": rows.column("cache_write_tokens"),
        "price_version": rows.column("price_version"),
        "reservation": rows.column("reservation"),
        "session_root": pa.nulls(count, _STR),
        "change": pa.nulls(count, _STR),  # generated ledgers hold no run-time changes
        "spent": pa.nulls(count, _STR),  # nor approvals
    }
    table = pa.Table.from_arrays(
        [_as_array(columns[name], SCHEMA.field(name).type) for name in SCHEMA.names],
        schema=SCHEMA,
    )

    # -- files: one per (partition, UTC date), rows contiguous in that order -----
    r_part = rows.column("partition").combine_chunks()
    r_day = rows.column("day").combine_chunks()
    group = pc.add(pc.multiply(r_part, 1000), r_day)
    runs = pc.run_end_encode(group)
    ends = runs.run_ends.to_pylist()
    values = runs.values.to_pylist()
    r_offset = rows.column("offset").combine_chunks()
    jobs = []
    begin = 0
    for end, g in zip(ends, values, strict=True):
        p, d = divmod(int(g), 1000)
        first = int(r_offset[begin].as_py())
        last = int(r_offset[end - 1].as_py())
        day = datetime.fromtimestamp(start_s + d * 86_400, UTC).date().isoformat()
        folder = out / f"date={day}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((table.slice(begin, end - begin), folder / segment_name(topic, p, first, last)))
        begin = end
    # Parquet encoding releases the GIL: a few files at once.
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda job: pq.write_table(job[0], job[1], compression=COMPRESSION), jobs))
    files = len(jobs)

    # -- what was written -----------------------------------------------------------
    ev_usd = ev.column("usd").combine_chunks()
    ev_code = codes
    # Rejections and admissions carry no USD charge: exclude their placeholder values.
    has_usd = pc.greater_equal(ev_code, 2)
    usd_total = int(pc.sum(ev_usd.filter(has_usd)).as_py() or 0)
    metered_total = int(pc.sum(ev_usd.filter(pc.equal(ev_code, 2))).as_py() or 0)
    by_type = {
        TYPES[int(v["values"])][0]: int(v["counts"]) for v in pc.value_counts(ev_code).to_pylist()
    }
    totals: dict[str, int] = {}
    if keep_totals:
        keyed = pa.table({"key": table.column("key"), "amount": table.column("amount")}).filter(
            pc.is_valid(table.column("key"))
        )
        agg = keyed.group_by("key").aggregate([("amount", "sum")])
        totals = dict(
            zip(agg.column("key").to_pylist(), agg.column("amount_sum").to_pylist(), strict=True)
        )
    return GenStats(
        out,
        n,
        count,
        files,
        usd_total,
        metered_total,
        by_type,
        time.perf_counter() - started,
        totals,
    )


def _empty_lists(count: int) -> pa.Array:
    return pa.ListArray.from_arrays(
        pa.repeat(pa.scalar(0, pa.int32()), count + 1), pa.array([], _STR)
    )


def _as_array(values: pa.Array | pa.ChunkedArray, typ: pa.DataType) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    return values if values.type == typ else pc.cast(values, typ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--month", default="2026-11")
    args = parser.parse_args()
    stats = write_archive(args.directory, args.events, seed=args.seed, month=args.month)
    print(
        f"{stats.events:,} events, {stats.rows:,} rows, {stats.files} files in "
        f"{stats.seconds:.2f} s under {stats.directory}"
    )


if __name__ == "__main__":
    main()
