"""The projector's fast decoder never disagrees with the full pydantic parse.

The property, over valid events (as producers encode them, charges planned by
the governor's own rules), events with one field mutated (wrong types, bounds,
unknown or missing fields, other time forms), hostile charges (schema-valid,
but no governor's: internal keys, another limit's or caller's key, a bad
expiry, a wrong sign), duplicated keys and corrupted bytes:

- ``decode(raw)`` accepts  =>  ``parse(raw)`` accepts, and both give the same
  ``AppliedEvent`` (and the same charges for the alert evaluator);
- through the :class:`Projector`, every record gets the full parse's verdict:
  applied exactly as ``to_applied(parse(raw))``, or dead-lettered with
  ``parse``'s reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

import orjson
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mcp_budget_governor import planning
from mcp_budget_governor.context import Context
from mcp_budget_governor.counters import AppliedEvent
from mcp_budget_governor.events import MalformedEventError, encode, parse
from mcp_budget_governor.keys import EPOCH_KEY, SEEN_PREFIX, WATERMARK_KEY
from mcp_budget_governor.ledger import EntryType, LedgerCharge, LedgerEntry, TokenUsage, new_id
from mcp_budget_governor.limits import NAME_PATTERN, Limit
from mcp_budget_governor.money import MAX_AMOUNT, Unit
from mcp_budget_governor.provenance import CLOSING_KINDS, RECOVERED_SESSION_SECONDS, SIGNS, Sign
from mcp_budget_governor.scopes import Scope
from mcp_budget_governor.stream.fastdecode import decode
from mcp_budget_governor.stream.projector import DeadLetter, Projector, to_applied
from mcp_budget_governor.windows import SESSION_TTL_SECONDS, Window
from testing.change_support import CHANGE_KINDS, changes_for

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- valid events, as the producers encode them ---------------------------------

names = st.from_regex(NAME_PATTERN, fullmatch=True)
texts = st.text(max_size=12)
amounts = st.one_of(
    st.integers(-MAX_AMOUNT, MAX_AMOUNT),
    st.sampled_from([0, 1, -1, MAX_AMOUNT, -MAX_AMOUNT]),
)
ZONES = [UTC, ZoneInfo("Europe/Paris"), ZoneInfo("America/Santiago"), ZoneInfo("Asia/Kolkata")]
limits = st.builds(
    Limit,
    names,
    cap=st.integers(1, MAX_AMOUNT),
    window=st.sampled_from(list(Window)),
    scope=st.lists(st.sampled_from(list(Scope)), unique=True, max_size=3).map(tuple),
    unit=st.sampled_from([u for u in Unit if u is not Unit.CONCURRENT]),
)


def signed(sign: Sign) -> st.SearchStrategy[int]:
    """The amounts a governor writes in an event of that sign."""
    if sign is Sign.POSITIVE:
        return st.integers(1, MAX_AMOUNT) | st.sampled_from([1, MAX_AMOUNT])
    if sign is Sign.NEGATIVE:
        return st.integers(-MAX_AMOUNT, -1) | st.sampled_from([-1, -MAX_AMOUNT])
    return st.integers(1, MAX_AMOUNT) | st.integers(-MAX_AMOUNT, -1)


usages = st.none() | st.builds(
    TokenUsage,
    st.text(min_size=1, max_size=8),
    st.integers(0, MAX_AMOUNT),
    st.integers(0, MAX_AMOUNT),
    st.integers(0, MAX_AMOUNT),
    st.integers(0, MAX_AMOUNT),
    st.none() | texts,
)
contexts = st.builds(
    Context,
    user=st.none() | texts,
    tenant=st.none() | texts,
    tool=st.none() | texts,
    session=st.none() | texts,
    agent=st.none() | texts,
)


@st.composite
def entries(draw: st.DrawFn) -> LedgerEntry:
    kind = draw(st.sampled_from(list(EntryType)))
    # Up to 2096: the whole range producers can stamp, fractions of a second included.
    planned = draw(st.floats(0, 4e9, allow_nan=False))
    ctx = draw(contexts)
    charges: list[LedgerCharge] = []
    if SIGNS[kind] is not Sign.NONE:
        tz = draw(st.sampled_from(ZONES))
        for limit in draw(st.lists(limits, max_size=3, unique_by=lambda lim: lim.name)):
            amount = draw(signed(SIGNS[kind]))
            s = planning.slot(limit, ctx, planned, tz, amount, enforce=False)
            if s is not None:
                charges.append(s.ledger_charge())
    # A check's plan serves its whole minute; a settlement comes after its reservation.
    later = draw(st.floats(0, 86_400 * 40)) if SIGNS[kind] in (Sign.NONZERO, Sign.NEGATIVE) else 0.0
    within = draw(st.floats(0, 59.999)) if kind is EntryType.ADMITTED else 0.0
    when = planned + later if later else min(planned + within, (planned // 60) * 60 + 59.999)
    assume(charges or kind is not EntryType.RECOVERED)  # a recovery carries what it settles
    change = None
    if kind in CHANGE_KINDS:  # a change names its own context
        change, ctx = draw(changes_for(kind, when))
    return LedgerEntry(
        id=new_id(),
        type=kind,
        time=when,
        context=ctx,
        charges=tuple(charges),
        limit=draw(st.none() | names),
        status=draw(st.integers(100, 599)),
        over=tuple(draw(st.lists(names, max_size=2))),
        usage=draw(usages),
        degraded=draw(st.booleans()),
        # A close that charges nothing names its reservation (provenance.closing_problem).
        reservation=new_id() if kind in CLOSING_KINDS and not charges else draw(st.none() | texts),
        change=change,
    )


valid_records = entries().map(lambda e: encode(e, "/mcpbg/test"))

# -- mutations ------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(
        [0, 1, -1, 99, 100, 599, 600, MAX_AMOUNT, MAX_AMOUNT + 1, -MAX_AMOUNT - 1, 2**63]
    ),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1.0, 0.0, 200.0, 2.5]),
    st.text(max_size=70),
    st.sampled_from(["", "1.0", "calls", "day", "mcpbg:v1:", "mcpbg.admitted.v1", "true"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=4,
)
times = st.one_of(
    st.datetimes(
        min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(UTC)
    ).map(lambda d: d.isoformat()),
    st.sampled_from(
        [
            "2026-11-29T21:40:45Z",
            "2026-11-29T21:40:45.123Z",
            "2026-11-29T21:40:45.123456+00:00",
            "2026-11-29T21:40:45.123456z",
            "2026-11-29 21:40:45.123456Z",
            "2026-11-29T21:40:45.1234567Z",
            "2026-11-29T21:40:60.000000Z",
            "2026-02-30T21:40:45.000000Z",
            "2026-13-01T00:00:00.000000Z",
            "0000-01-01T00:00:00.000000Z",
            "0001-01-01T00:00:00.000000Z",
            "2026-11-29T21:40:45.12345\u0661Z",
            "2026-11-29T21:40:45.123456",
            "1764442477",
        ]
    ),
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (dict keys, list indexes)."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


def nudged(value: Any) -> list[Any]:
    """Values close to ``value``: the mistakes a producer bug would make."""
    if isinstance(value, bool):
        return [not value, int(value), str(value).lower(), None]
    if isinstance(value, int):
        bounds = [0, -1, 99, 100, 599, 600, MAX_AMOUNT, MAX_AMOUNT + 1, -MAX_AMOUNT - 1]
        return [value + 1, value - 1, -value, float(value), str(value), True, None, *bounds]
    if isinstance(value, str):
        edits = [value + "\n", value[:-1], value.upper(), " " + value, "_" + value[1:]]
        return [*edits, "", "x" * 64, "x" * 65, "\u0661", None, 1]
    if isinstance(value, list):
        return [[], tuple(value) and value[:1], {}, None]
    return [None, [], "x"]


@st.composite
def mutated_records(draw: st.DrawFn) -> bytes:
    doc = orjson.loads(draw(valid_records))
    every = paths(doc)[1:]
    depth = draw(st.sampled_from(sorted({len(p) for p in every})))
    path = draw(st.sampled_from([p for p in every if len(p) == depth]))
    *parent_path, last = path
    parent: Any = doc
    for step in parent_path:
        parent = parent[step]
    how = draw(st.sampled_from(["replace", "nudge", "delete", "extra", "time"]))
    if how == "replace":
        parent[last] = draw(json_values)
    elif how == "nudge":
        parent[last] = draw(st.sampled_from(nudged(parent[last])))
    elif how == "delete":
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
    elif how == "extra":
        target = parent if isinstance(parent, dict) else doc
        target[draw(st.sampled_from(["extra", "Limit", "ids", "usage", "x"]))] = draw(json_values)
    else:
        doc["time"] = draw(times)
    return orjson.dumps(doc)


@st.composite
def duplicated_keys(draw: st.DrawFn) -> bytes:
    raw = draw(valid_records)
    field = draw(
        st.sampled_from(
            [b'"id":', b'"type":', b'"source":', b'"time":', b'"data":', b'"amount":', b'"key":']
        )
    )
    value = orjson.dumps(draw(json_scalars))
    return raw.replace(field, field + value + b"," + field, 1)


@st.composite
def corrupted_bytes(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(valid_records))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(raw) - 1))
        what = draw(st.sampled_from(["flip", "delete", "insert"]))
        if what == "flip":
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif what == "delete":
            del raw[at]
        else:
            raw.insert(at, draw(st.sampled_from(b'{}[],:"\\0 e.-x\xff')))
    return bytes(raw)


SPEND = Limit("spend", cap=10**9, window=Window.DAY, unit=Unit.USD_MICROS, scope=Scope.USER)


def planned(limit: Limit, ctx: Context, now: float, amount: int) -> LedgerCharge:
    """The charge a governor writes for ``limit`` and ``ctx`` at ``now``."""
    s = planning.slot(limit, ctx, now, UTC, amount, enforce=False)
    assert s is not None
    return s.ledger_charge()


def hostile_charge(charge: LedgerCharge, kind: EntryType, time: float) -> list[dict[str, Any]]:
    """Schema-valid variants of ``charge`` that no governor writes in a ``kind`` event."""
    day = datetime.fromtimestamp(time, UTC).strftime("%Y%m%d")
    base = {
        "limit": charge.limit,
        "unit": charge.unit.value,
        "amount": charge.amount,
        "window": charge.window.value,
        "bucket": charge.bucket,
        "key": charge.key,
        "expire_at": charge.expire_at,
    }
    head, scope, bucket = charge.key.rsplit(":", 2)
    other_scope = "user=intruder" if scope != "user=intruder" else "user=other"
    keys = [
        WATERMARK_KEY,
        EPOCH_KEY,
        f"{SEEN_PREFIX}:{day}",
        f"mcpbg:v1:_{charge.limit}:{scope}:{bucket}",
        f"mcpbg:v1:other:{scope}:{bucket}",  # another limit's counter
        f"{head}:{other_scope}:{bucket}",  # another caller's counter
        f"{head}:{scope}:19700101",  # another bucket (unless it is this one: left out below)
        f"{head}:{scope}:{bucket}:x",
        charge.key + "x" * 2000,
    ]
    sign = SIGNS[kind]
    amounts = [0, -charge.amount] if sign is not Sign.NONZERO else [0]
    expiries = [2**62, 2**40]
    if charge.window is Window.SESSION:  # at most the event's time plus the TTL (within 1 s)
        # a recovery may push a session's expiry far further (it settles a counter
        # written long after its reservation began)
        ttl = RECOVERED_SESSION_SECONDS if kind is EntryType.RECOVERED else SESSION_TTL_SECONDS
        expiries.append(math.ceil(time) + ttl + 2)
        if kind in (EntryType.ADMITTED, EntryType.METERED, EntryType.RESERVED):
            expiries.append(math.floor(time / 60) * 60 + SESSION_TTL_SECONDS - 1)
    else:  # exactly the bucket's end plus grace
        expiries += [charge.expire_at + 1, charge.expire_at - 3600]
    out = [{**base, "key": k} for k in keys if k != charge.key]
    out += [{**base, "amount": a} for a in amounts]
    out += [{**base, "expire_at": e} for e in expiries if e != charge.expire_at]
    out += [
        {**base, "bucket": b}
        for b in ("19700101", "20000101", "session", charge.bucket + "@UTC")
        if b != charge.bucket
    ]
    out += [{**base, "window": w.value} for w in Window if w is not charge.window]
    return out


@st.composite
def hostile_records(draw: st.DrawFn) -> bytes:
    """A valid event with one charge replaced by a schema-valid one no governor writes."""
    entry = draw(entries().filter(lambda e: bool(e.charges)))
    doc = orjson.loads(encode(entry, "/mcpbg/test"))
    at = draw(st.integers(0, len(entry.charges) - 1))
    bad = draw(st.sampled_from(hostile_charge(entry.charges[at], entry.type, entry.time)))
    doc["data"]["charges"][at] = bad
    if draw(st.booleans()):  # the same limit twice
        doc["data"]["charges"].append(doc["data"]["charges"][0])
    return orjson.dumps(doc)


def hostile_links(event_id: str, reservation: str) -> list[Any]:
    """``reservation`` values no governor writes in a close that charges nothing."""
    return [
        None,
        "DELETE",
        "",
        "r1",
        event_id,  # closes itself
        reservation.upper(),
        reservation[:-1],
        reservation + "0",
        reservation + "\n",
        reservation.replace("-", "_"),
        1,
        [reservation],
    ]


@st.composite
def hostile_closings(draw: st.DrawFn) -> bytes:
    """A zero-delta close (settled or released, no charges) whose link to its reservation
    is not a governor's, or that carries the zero as a charge on the counter."""
    entry = LedgerEntry(
        new_id(),
        draw(st.sampled_from(sorted(CLOSING_KINDS))),
        draw(st.floats(0, 4e9, allow_nan=False)),
        draw(contexts),
        (),
        reservation=new_id(),
    )
    doc = orjson.loads(encode(entry, "/mcpbg/test"))
    assert parse(orjson.dumps(doc)).data.reservation == entry.reservation  # valid as written
    assert entry.reservation is not None
    if draw(st.booleans()):
        zero = planned(SPEND, Context(user="u1"), entry.time, 1)
        doc["data"]["context"]["user"] = "u1"
        doc["data"]["charges"] = [{**dataclass_dict(zero), "amount": 0}]
        return orjson.dumps(doc)
    link = draw(st.sampled_from(hostile_links(entry.id, entry.reservation)))
    if link == "DELETE":
        del doc["data"]["reservation"]
    else:
        doc["data"]["reservation"] = link
    return orjson.dumps(doc)


def dataclass_dict(charge: LedgerCharge) -> dict[str, Any]:
    return {
        "limit": charge.limit,
        "unit": charge.unit.value,
        "amount": charge.amount,
        "window": charge.window.value,
        "bucket": charge.bucket,
        "key": charge.key,
        "expire_at": charge.expire_at,
    }


any_record = st.one_of(
    valid_records,
    mutated_records(),
    hostile_records(),
    hostile_closings(),
    duplicated_keys(),
    corrupted_bytes(),
)


def verdict(raw: bytes, offset: int) -> AppliedEvent | str:
    """The full parse's verdict: the event as applied, or the dead-letter reason."""
    try:
        return to_applied(parse(raw), offset)
    except MalformedEventError as exc:
        return exc.reason


# -- the properties -----------------------------------------------------------------


@SETTINGS
@given(valid_records, st.integers(0, 2**62))
def test_valid_events_take_the_fast_path_and_match_the_full_parse(raw: bytes, offset: int) -> None:
    fast = decode(raw, offset)
    assert fast is not None, raw  # producers' own output must never need the slow path
    event = parse(raw)
    assert fast.event == to_applied(event, offset)
    assert [(c.limit, c.bucket, c.key, c.amount, c.expire_at) for c in fast.charges] == [
        (c.limit, c.bucket, c.key, c.amount, c.expire_at) for c in event.data.charges
    ]


@SETTINGS
@given(hostile_records(), st.integers(0, 99))
def test_hostile_charges_are_refused_by_both_paths(raw: bytes, offset: int) -> None:
    """No charge a governor could not have written reaches the counters, by either path."""
    assert decode(raw, offset) is None
    reason = verdict(raw, offset)
    assert isinstance(reason, str) and "data.charges" in reason, reason


@settings(SETTINGS, max_examples=200)
@given(hostile_closings(), st.integers(0, 99))
def test_a_zero_delta_close_without_its_reservation_is_refused_by_both_paths(
    raw: bytes, offset: int
) -> None:
    """A close that charges nothing must name the reservation it ends (a UUID, not its own
    id), and a zero delta is no charge: the counters never see either variant."""
    assert decode(raw, offset) is None
    reason = verdict(raw, offset)
    assert isinstance(reason, str), reason
    assert "data.reservation" in reason or "data.charges.0: amount 0" in reason, reason


@settings(SETTINGS, max_examples=2000)
@given(
    st.one_of(
        mutated_records(),
        hostile_records(),
        hostile_closings(),
        duplicated_keys(),
        corrupted_bytes(),
    ),
    st.integers(0, 99),
)
def test_whatever_the_fast_path_accepts_the_full_parse_accepts_identically(
    raw: bytes, offset: int
) -> None:
    fast = decode(raw, offset)
    expected = verdict(raw, offset)
    if fast is not None:
        assert fast.event == expected, raw


class Recorder:
    """A backend that records what would be applied, and a dead-letter sink."""

    def __init__(self) -> None:
        self.applied: list[AppliedEvent] = []
        self.letters: list[DeadLetter] = []

    async def apply(
        self,
        partition: str,
        events: Sequence[AppliedEvent],
        *,
        require_epoch: bool = False,
        through: int = -1,
    ) -> int:
        self.applied += events
        return len(events)

    async def watermark(self, partition: str) -> int:
        return -1


@SETTINGS
@given(st.lists(any_record, min_size=1, max_size=12))
async def test_the_projector_gives_every_record_the_full_parse_verdict(
    raws: list[bytes],
) -> None:
    recorder = Recorder()
    projector = Projector(recorder, "t", dlq=recorder.letters.append)  # type: ignore[arg-type]
    result = await projector.apply_batch(0, list(enumerate(raws)))
    expected = [verdict(raw, offset) for offset, raw in enumerate(raws)]
    assert recorder.applied == [v for v in expected if isinstance(v, AppliedEvent)]
    assert [(d.offset, d.reason, d.raw) for d in recorder.letters] == [
        (offset, v, raws[offset]) for offset, v in enumerate(expected) if isinstance(v, str)
    ]
    assert result.valid == len(recorder.applied) and result.dead == len(recorder.letters)


def test_the_fast_path_is_taken_for_the_common_shape_and_refused_for_others() -> None:
    """Not vacuous: the mutations above do reach both branches."""
    entry = LedgerEntry(
        new_id(),
        EntryType.METERED,
        1764442477.25,
        Context(user="u1", tenant="acme"),
        (planned(SPEND, Context(user="u1", tenant="acme"), 1764442477.25, 1500),),
    )
    raw = encode(entry, "/src")
    decoded = decode(raw, 7)
    assert decoded is not None and decoded.event.time == 1764442477.25
    doc = orjson.loads(raw)
    doc["data"]["charges"][0]["amount"] = 1500.0  # a float amount: the full parse refuses it
    assert decode(orjson.dumps(doc), 7) is None
    assert isinstance(verdict(orjson.dumps(doc), 7), str)
    doc["data"]["charges"][0]["amount"] = 1500
    doc["time"] = "2025-11-29T18:54:37.25+00:00"  # valid, but not the producers' form
    assert decode(orjson.dumps(doc), 7) is None
    assert verdict(orjson.dumps(doc), 7) == decoded.event


def test_every_field_nudged_to_each_near_miss_gets_the_full_parse_verdict() -> None:
    """Exhaustive over one full event: each field, each near-miss value, each removal."""
    ctx = Context(user="u1", tenant="acme", tool="search", session="s", agent="a")
    at = 1764442477.5
    entry = LedgerEntry(
        new_id(),
        EntryType.METERED,
        at,
        ctx,
        (
            planned(SPEND, Context(user="u1"), 1764442477.5, 1500),
            planned(Limit("calls", cap=9, window=Window.MINUTE, scope=Scope.AGENT), ctx, at, 1),
        ),
        limit="spend",
        status=599,
        over=("calls",),
        usage=TokenUsage("m", 1, 2, 3, MAX_AMOUNT, "2025-11"),
        degraded=True,
        reservation="r1",
    )
    base = orjson.loads(encode(entry, "/src"))
    checked = fast_taken = 0
    for path in paths(base)[1:]:
        *parent_path, last = path
        probe = orjson.loads(orjson.dumps(base))
        parent: Any = probe
        for step in parent_path:
            parent = parent[step]
        original = parent[last]
        for value in [*nudged(original), "DELETE"]:
            if value == "DELETE":
                if isinstance(parent, dict):
                    del parent[last]
                else:
                    parent.pop(last)
            else:
                parent[last] = value
            raw = orjson.dumps(probe)
            fast = decode(raw, 3)
            if fast is not None:
                fast_taken += 1
                assert fast.event == verdict(raw, 3), (path, value)
            checked += 1
            probe = orjson.loads(orjson.dumps(base))
            parent = probe
            for step in parent_path:
                parent = parent[step]
    assert checked > 400 and 0 < fast_taken < checked
