"""The Projector on real Redis and on MemoryBackend: parse, dead-letter, apply once.

Records are built the way the hot path writes them (``events.encode`` of the
entries a Governor appends), so the in-flight amounts the governor wrote are
what the projection must move to committed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import orjson
import pytest

from mcp_budget_governor import (
    Backend,
    BackendUnavailableError,
    Context,
    Governor,
    Limit,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import LedgerEntry
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.projector import (
    DeadLetter,
    Projector,
    WatermarkBackend,
    dead_letter_topic,
)

TOPIC = "ledger.test"
SOURCE = "/mcpbg/test"


def policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=4, window=Window.MINUTE, scope=Scope.USER),
        Limit("tenant_calls", cap=1_000, window=Window.DAY, scope=Scope.TENANT),
        Limit("spend", cap=usd(5), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
    )


async def governed_entries(backend: Backend) -> list[LedgerEntry]:
    """Admissions, rejections, metered costs and a settled reservation, in flight."""
    ledger = MemoryLedger()
    gov = Governor(policy(), backend, ledger=ledger)
    for i in range(12):
        ctx = Context(user=f"u{i % 2}", tenant="acme")
        await gov.check(ctx)  # u0 and u1 pass 4 times a minute, then are refused
        await gov.meter("spend", 1_000 + i, ctx)
    async with gov.reserved("spend", 50_000, Context(user="u9", tenant="acme")) as r:
        r.actual = 20_000
    return ledger.entries


def totals(entries: Sequence[LedgerEntry]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for entry in entries:
        for charge in entry.charges:
            out[charge.key] += charge.amount
    return dict(out)


async def assert_projected(backend: Backend, expected: dict[str, int]) -> None:
    """Every counter: committed = the ledger's sum, nothing left in flight."""
    for key, total in expected.items():
        state = await backend.state(key)
        assert (key, state.committed, state.in_flight, state.pending) == (key, total, 0, {})


def float_amount(entry: LedgerEntry) -> bytes:
    doc = orjson.loads(encode(entry, SOURCE))
    doc["data"]["charges"][0]["amount"] = 1.5
    return orjson.dumps(doc)


def unknown_type(entry: LedgerEntry) -> bytes:
    doc = orjson.loads(encode(entry, SOURCE))
    doc["type"] = "mcpbg.exploded.v1"
    return orjson.dumps(doc)


def watermarked(backend: Backend) -> WatermarkBackend:
    assert isinstance(backend, WatermarkBackend)
    return backend


async def test_valid_records_applied_poison_dead_lettered_replay_harmless(
    backend: Backend,
) -> None:
    entries = await governed_entries(backend)
    charged = next(e for e in entries if e.charges)
    poison: dict[int, bytes | None] = {
        3: b"\x00\xffnot json at all",
        7: float_amount(charged),
        11: unknown_type(charged),
        12: None,  # a tombstone
    }
    records: list[tuple[int, bytes | None]] = []
    valid = iter(entries)
    for offset in range(len(entries) + len(poison)):
        records.append(
            (offset, poison[offset]) if offset in poison else (offset, encode(next(valid), SOURCE))
        )
    letters: list[DeadLetter] = []
    projector = Projector(watermarked(backend), TOPIC, dlq=letters.append)
    assert await projector.resume_offset(2) == 0

    result = await projector.apply_batch(2, records)

    assert (result.records, result.valid, result.applied, result.dead) == (
        len(records),
        len(entries),
        len(entries),
        len(poison),
    )
    assert result.last_offset == len(records) - 1
    assert [(d.topic, d.partition, d.offset, d.raw) for d in letters] == [
        (TOPIC, 2, offset, raw) for offset, raw in sorted(poison.items())
    ]
    reasons = {d.offset: d.reason for d in letters}
    assert "json" in reasons[3].lower()
    assert "amount" in reasons[7]
    assert "mcpbg.exploded.v1" in reasons[11] or "type" in reasons[11]
    assert "no value" in reasons[12]
    expected = totals(entries)
    await assert_projected(backend, expected)
    # The watermark is per topic and partition, and reading resumes after it.
    assert projector.partition_name(2) == f"{TOPIC}:2"
    assert await watermarked(backend).watermark(f"{TOPIC}:2") == len(records) - 1
    assert await projector.resume_offset(2) == len(records)
    assert await projector.resume_offset(0) == 0

    # Redelivery of the whole batch (a worker killed before its commit): no change.
    again = await projector.apply_batch(2, records)
    assert (again.valid, again.applied) == (len(entries), 0)
    await assert_projected(backend, expected)
    # Dead letters are at least once: a replayed poison record is reported
    # again, with the same partition and offset to recognise it by.
    assert [d.offset for d in letters[len(poison) :]] == sorted(poison)

    # A producer retry: the same event at a later offset counts once.
    late = len(records) + 5
    dup = await projector.apply_batch(2, [(late, encode(entries[-1], SOURCE))])
    assert (dup.valid, dup.applied, dup.dead) == (1, 0, 0)
    await assert_projected(backend, expected)
    assert await projector.resume_offset(2) == late + 1
    assert (projector.records, projector.applied, projector.dead) == (
        2 * len(records) + 1,
        len(entries),
        2 * len(poison),
    )


async def test_partial_redelivery_applies_only_the_new_tail(backend: Backend) -> None:
    """A batch overlapping the watermark (re-read after a crash) applies only what is new."""
    entries = await governed_entries(backend)
    records: list[tuple[int, bytes | None]] = [
        (i, encode(e, SOURCE)) for i, e in enumerate(entries)
    ]
    projector = Projector(watermarked(backend), TOPIC, dlq=lambda letter: None)
    half = len(records) // 2
    assert (await projector.apply_batch(0, records[:half])).applied == half
    result = await projector.apply_batch(0, records[half - 3 :])
    assert result.applied == len(records) - half
    await assert_projected(backend, totals(entries))


async def test_an_async_dead_letter_handler_runs_before_the_apply(backend: Backend) -> None:
    """A failing handler (Kafka down) leaves the counters and watermark untouched: retry is safe."""
    entries = await governed_entries(backend)
    records: list[tuple[int, bytes | None]] = [
        (0, encode(entries[0], SOURCE)),
        (1, b"{}"),
        (2, b""),
    ]
    before = {key: await backend.state(key) for key in totals(entries)}
    sent: list[DeadLetter] = []
    fail = True

    async def handler(letter: DeadLetter) -> None:
        if fail:
            raise BackendUnavailableError("dead-letter topic unreachable")
        sent.append(letter)

    projector = Projector(watermarked(backend), TOPIC, dlq=handler)
    with pytest.raises(BackendUnavailableError):
        await projector.apply_batch(1, records)
    assert await projector.resume_offset(1) == 0
    assert {key: await backend.state(key) for key in before} == before

    fail = False
    result = await projector.apply_batch(1, records)
    assert (result.applied, result.dead) == (1, 2)
    assert [(d.offset, d.raw) for d in sent] == [(1, b"{}"), (2, b"")]
    assert "type" in sent[0].reason  # the parser says what is missing
    assert sent[1].reason == "empty value"


async def test_offsets_must_ascend(backend: Backend) -> None:
    entries = await governed_entries(backend)
    projector = Projector(watermarked(backend), TOPIC, dlq=lambda letter: None)
    raw = encode(entries[0], SOURCE)
    with pytest.raises(ValueError, match="ascend"):
        await projector.apply_batch(0, [(5, raw), (5, raw)])
    assert await projector.apply_batch(0, []) == await projector.apply_batch(0, [])
    assert (await projector.apply_batch(0, [])).last_offset == -1


def test_dead_letter_round_trips_through_json_and_headers() -> None:
    letter = DeadLetter("t", 4, 17, "data.charges.0.amount: bad", b"\x00\xff{")
    assert DeadLetter.from_json(letter.to_json()) == letter
    doc = orjson.loads(letter.to_json())
    assert doc["raw"] == "AP97" and doc["offset"] == 17
    assert dict(letter.headers())["mcpbg-dlq-offset"] == b"17"
    tombstone = DeadLetter("t", 0, 1, "no value", None)
    assert DeadLetter.from_json(tombstone.to_json()) == tombstone
    assert dead_letter_topic("mcpbg.ledger") == "mcpbg.ledger.dlq"
