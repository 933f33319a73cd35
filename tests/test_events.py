"""Ledger events: CloudEvents envelopes that round-trip, and clear errors for bad records."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC
from typing import Any

import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from mcp_budget_governor import MAX_AMOUNT, Context, Limit, Scope, Unit, Window, planning
from mcp_budget_governor.cli import main
from mcp_budget_governor.events import MalformedEventError, encode, json_schemas, parse, to_entry
from mcp_budget_governor.keys import EPOCH_KEY, SEEN_PREFIX, WATERMARK_KEY
from mcp_budget_governor.ledger import EntryType, LedgerCharge, LedgerEntry, TokenUsage, new_id
from mcp_budget_governor.limits import NAME_PATTERN
from mcp_budget_governor.provenance import CLOSING_KINDS, SIGNS, Sign
from testing.change_support import CHANGE_KINDS, changes_for

texts = st.one_of(st.none(), st.text(max_size=40))
limits = st.builds(
    Limit,
    st.from_regex(NAME_PATTERN, fullmatch=True),
    cap=st.just(10),
    unit=st.sampled_from([u for u in Unit if u is not Unit.CONCURRENT]),
    window=st.sampled_from(Window),
    scope=st.lists(st.sampled_from(Scope), unique=True, max_size=2).map(tuple),
)
usages = st.one_of(
    st.none(),
    st.builds(
        TokenUsage,
        model=st.text(min_size=1, max_size=30),
        input_tokens=st.integers(0, 10**9),
        output_tokens=st.integers(0, 10**9),
        cache_read_tokens=st.integers(0, 10**9),
        cache_write_tokens=st.integers(0, 10**9),
        price_version=st.one_of(st.none(), st.text(max_size=20)),
    ),
)


@st.composite
def entries(draw: Any) -> LedgerEntry:
    kind = draw(st.sampled_from(EntryType))
    now = draw(st.floats(0, 4e9)).__round__(6)
    ctx = Context(*(draw(texts) for _ in range(5)))
    charges = []  # what the governor plans: the only charges an event may carry
    sign = SIGNS[kind]
    for limit in draw(st.lists(limits, max_size=4, unique_by=lambda lim: lim.name)):
        if sign is Sign.NONE:
            break
        amount = draw(st.integers(1, MAX_AMOUNT)) * (-1 if sign is Sign.NEGATIVE else 1)
        slot = planning.slot(limit, ctx, now, UTC, amount, enforce=False)
        if slot is not None:
            charges.append(slot.ledger_charge())
    assume(charges or kind is not EntryType.RECOVERED)  # a recovery carries what it settles
    change = None
    if kind in CHANGE_KINDS:  # a change names its own context
        change, ctx = draw(changes_for(kind, now))
    return LedgerEntry(
        id=new_id(),
        type=kind,
        time=now,
        context=ctx,
        charges=tuple(charges),
        limit=draw(st.one_of(st.none(), st.just("burst"))),
        status=draw(st.sampled_from([200, 402, 429, 503])),
        over=tuple(draw(st.lists(st.just("shadow"), max_size=1))),
        usage=draw(usages),
        degraded=draw(st.booleans()),
        reservation=new_id()
        if kind in CLOSING_KINDS and not charges  # then it must name its reservation
        else draw(st.one_of(st.none(), st.just(new_id()))),
        change=change,
    )


@given(entries())
def test_encoded_entries_validate_and_round_trip(entry: LedgerEntry) -> None:
    raw = encode(entry, "/mcpbg/test")
    event = parse(raw)
    assert event.specversion == "1.0"
    assert event.type == f"mcpbg.{entry.type.value}.v1"
    back = to_entry(event)
    assert back.id == entry.id and back.charges == entry.charges
    assert back.context == entry.context and back.usage == entry.usage
    assert abs(back.time - entry.time) < 1e-5
    assert all(isinstance(c["amount"], int) for c in json.loads(raw)["data"]["charges"])


@given(entries())
def test_a_check_event_joined_from_its_template_is_the_full_encoding(entry: LedgerEntry) -> None:
    """A check's event (no usage, no reservation) is spliced from a cached template
    around its id and time: the same bytes as the whole event written by orjson, for
    the first event of a template and for the next ones (another id)."""
    assume(entry.type not in CLOSING_KINDS or entry.charges)  # else it names a reservation
    first = dataclasses.replace(entry, usage=None, reservation=None)
    second = dataclasses.replace(first, id=new_id())
    for one in (first, second, first):
        raw = encode(one, "/mcpbg/test")
        assert raw == orjson.dumps(
            json.loads(raw)
        )  # canonical orjson output, nothing spliced wrong
        event = parse(raw)
        assert event.id == one.id and abs(event.time.timestamp() - one.time) < 1e-5
        assert to_entry(event).charges == one.charges and to_entry(event).context == one.context


def good() -> dict[str, Any]:
    entry = LedgerEntry(
        new_id(),
        EntryType.METERED,
        1_764_442_477.0,
        Context(user="u"),
        (
            LedgerCharge(
                "spend",
                Unit.USD_MICROS,
                5,
                Window.DAY,
                "20251129",
                "mcpbg:v1:spend:user=u:20251129",
                1_764_464_400,  # the day's end plus an hour of grace
            ),
        ),
    )
    parsed: dict[str, Any] = json.loads(encode(entry, "/x"))
    return parsed


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda e: e.update(type="mcpbg.unknown.v1"), "type"),
        (lambda e: e.pop("id"), "id"),
        (lambda e: e.update(id="not-a-uuid"), "id"),
        (lambda e: e.update(specversion="0.3"), "specversion"),
        (lambda e: e["data"]["charges"][0].update(amount=1.5), "amount"),
        (lambda e: e["data"]["charges"][0].update(amount="5"), "amount"),
        (lambda e: e["data"]["charges"][0].update(amount=2**63), "amount"),
        (lambda e: e["data"]["charges"][0].update(unit="dollars"), "unit"),
        (lambda e: e["data"]["charges"][0].update(key="other:key"), "key"),
        (lambda e: e["data"].update(extra=1), "extra"),
    ],
)
def test_malformed_events_name_the_problem(mutate: Any, where: str) -> None:
    event = good()
    mutate(event)
    with pytest.raises(MalformedEventError) as info:
        parse(json.dumps(event))
    assert where in info.value.reason


def charged(**change: Any) -> dict[str, Any]:
    event = good()
    event["data"]["charges"][0].update(change)
    return event


@pytest.mark.parametrize(
    ("event", "problem"),
    [
        (charged(key=WATERMARK_KEY), "is not a counter key"),
        (charged(key=EPOCH_KEY), "is not a counter key"),
        (charged(key=f"{SEEN_PREFIX}:20251129"), "is not a counter key"),
        (charged(key="mcpbg:v1:_spend:user=u:20251129"), "is not a counter key"),
        (charged(key="mcpbg:v1:spend:user=u:20251129:x"), "is not a counter key"),
        (charged(key="mcpbg:v1:" + "a" * 2000), "longer than any counter key"),
        (charged(key="mcpbg:v1:calls:user=u:20251129"), "limit 'calls', not of 'spend'"),
        (charged(key="mcpbg:v1:spend:user=v:20251129"), "not the counter of this event's user"),
        (charged(key="mcpbg:v1:spend:tenant=t:20251129"), "not the counter of this event's tenant"),
        (charged(key="mcpbg:v1:spend:user=u:20251128"), "bucket '20251128', not in '20251129'"),
        (charged(key="mcpbg:v1:spend:user=u:2025112", bucket="2025112"), "not a day bucket"),
        (charged(window="month"), "not a month bucket"),
        (charged(expire_at=2**62), "not its bucket's end plus grace (1764464400)"),
        (charged(expire_at=1_764_464_399), "not its bucket's end plus grace"),
        (charged(amount=-5), "amount -5: the charges of metered events are positive"),
        (charged(amount=0), "amount 0"),
        (
            charged(key="mcpbg:v1:spend:user=u:20251130", bucket="20251130", expire_at=1764550800),
            "does not hold the event's time",
        ),
    ],
)
def test_charges_no_governor_writes_are_malformed(event: dict[str, Any], problem: str) -> None:
    """The ledger topic is input: schema-valid charges aimed at the wrong keys are refused."""
    with pytest.raises(MalformedEventError) as info:
        parse(json.dumps(event))
    assert "data.charges.0: " in info.value.reason and problem in info.value.reason


@pytest.mark.parametrize(
    ("kind", "reservation", "problem"),
    [
        (
            "settled",
            None,
            "data.reservation: a settled event without charges names its reservation",
        ),
        ("released", "DROP", "data.reservation: a released event without charges names its"),
        ("settled", "r1", "data.reservation: 'r1' is not a reserved event's id"),
        ("settled", "SELF", "data.reservation: an event cannot close itself"),
    ],
)
def test_a_zero_delta_close_names_its_reservation(
    kind: str, reservation: str | None, problem: str
) -> None:
    """A settlement of a zero delta (the estimate stood) has no charges: its link to the
    reservation it closes is all it says, so a bad one is refused naming the field."""
    event = good()
    event["type"] = f"mcpbg.{kind}.v1"
    event["data"]["charges"] = []
    event["data"]["reservation"] = new_id()
    assert parse(json.dumps(event)).data.charges == ()  # the governor's own shape
    if reservation == "DROP":
        del event["data"]["reservation"]
    else:
        event["data"]["reservation"] = event["id"] if reservation == "SELF" else reservation
    with pytest.raises(MalformedEventError) as info:
        parse(json.dumps(event))
    assert problem in info.value.reason, info.value.reason


def test_each_kind_has_its_sign() -> None:
    assert set(SIGNS) == set(EntryType)  # a new kind must say what its charges may be
    for kind, amount, ok in [
        (EntryType.RELEASED, -5, True),
        (EntryType.RELEASED, 5, False),
        (EntryType.SETTLED, -5, True),
        (EntryType.SETTLED, 5, True),
        (EntryType.ADMITTED, -1, False),
        (EntryType.RESERVED, -1, False),
    ]:
        event = charged(amount=amount)
        event["type"] = f"mcpbg.{kind.value}.v1"
        if ok:
            assert parse(json.dumps(event)).data.charges[0].amount == amount
        else:
            with pytest.raises(MalformedEventError, match="the charges of"):
                parse(json.dumps(event))
    twice = good()
    twice["data"]["charges"].append(twice["data"]["charges"][0])
    with pytest.raises(
        MalformedEventError, match=r"data\.charges\.1: limit 'spend' is charged twice"
    ):
        parse(json.dumps(twice))


def test_garbage_and_rejected_with_charges() -> None:
    for raw in (b"", b"{", b"[]", b"\xff\xfe", b"null"):
        with pytest.raises(MalformedEventError):
            parse(raw)
    event = good()
    event["type"] = "mcpbg.rejected.v1"
    with pytest.raises(MalformedEventError, match="no charges"):
        parse(json.dumps(event))


def test_schema_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == set(json_schemas()) and len(printed) == len(EntryType)
    assert main(["schema", "--type", "mcpbg.metered.v1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert list(one) == ["mcpbg.metered.v1"]
    assert "data" in one["mcpbg.metered.v1"]["properties"]
    assert main(["schema", "--type", "nope"]) == 2
    assert "unknown event type 'nope'" in capsys.readouterr().err
