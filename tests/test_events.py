"""Ledger events: CloudEvents envelopes that round-trip, and clear errors for bad records."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_budget_governor import MAX_AMOUNT, Context, Unit, Window
from mcp_budget_governor.cli import main
from mcp_budget_governor.events import MalformedEventError, encode, json_schemas, parse, to_entry
from mcp_budget_governor.ledger import EntryType, LedgerCharge, LedgerEntry, TokenUsage, new_id
from mcp_budget_governor.limits import NAME_PATTERN

texts = st.one_of(st.none(), st.text(max_size=40))
charges = st.builds(
    LedgerCharge,
    limit=st.from_regex(NAME_PATTERN, fullmatch=True),
    unit=st.sampled_from(Unit),
    amount=st.integers(-MAX_AMOUNT, MAX_AMOUNT),
    window=st.sampled_from(Window),
    bucket=st.from_regex(r"[0-9T@A-Za-z/_]{1,40}", fullmatch=True),
    key=st.text(max_size=50).map(lambda t: "mcpbg:v1:" + t),
    expire_at=st.integers(1, 2**40),
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
    return LedgerEntry(
        id=new_id(),
        type=kind,
        time=draw(st.floats(0, 4e9)).__round__(6),
        context=Context(*(draw(texts) for _ in range(5))),
        charges=()
        if kind is EntryType.REJECTED
        # a recovery carries the charges it settles
        else tuple(draw(st.lists(charges, min_size=kind is EntryType.RECOVERED, max_size=4))),
        limit=draw(st.one_of(st.none(), st.just("burst"))),
        status=draw(st.sampled_from([200, 402, 429, 503])),
        over=tuple(draw(st.lists(st.just("shadow"), max_size=1))),
        usage=draw(usages),
        degraded=draw(st.booleans()),
        reservation=draw(st.one_of(st.none(), st.just(new_id()))),
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
                "mcpbg:v1:spend:global:20251129",
                1_764_500_000,
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
