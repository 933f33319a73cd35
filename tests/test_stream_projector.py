"""The Projector on real Redis and on MemoryBackend: parse, dead-letter, apply once.

Records are built the way the hot path writes them (``events.encode`` of the
entries a Governor appends), so the in-flight amounts the governor wrote are
what the projection must move to committed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

import orjson
import pytest

from mcp_budget_governor import (
    Backend,
    BackendUnavailableError,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, CounterOp
from mcp_budget_governor.errors import EpochMissingError
from mcp_budget_governor.events import encode
from mcp_budget_governor.keys import (
    EPOCH_KEY,
    EPOCH_VALUE,
    INTERNAL_PREFIX,
    SEEN_PREFIX,
    WATERMARK_KEY,
)
from mcp_budget_governor.ledger import LedgerEntry, new_id
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
    # A dead letter is sent once: the watermark went through it with the batch,
    # so neither this projector nor a restarted one sends it again.
    assert len(letters) == len(poison)
    restarted = Projector(watermarked(backend), TOPIC, dlq=letters.append)
    assert (await restarted.apply_batch(2, records)).dead == 0 and len(letters) == len(poison)

    # A producer retry: the same event at a later offset counts once.
    late = len(records) + 5
    dup = await projector.apply_batch(2, [(late, encode(entries[-1], SOURCE))])
    assert (dup.valid, dup.applied, dup.dead) == (1, 0, 0)
    await assert_projected(backend, expected)
    assert await projector.resume_offset(2) == late + 1
    assert (projector.records, projector.applied, projector.dead) == (
        2 * len(records) + 1,
        len(entries),
        len(poison),
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


def hostile(entry: LedgerEntry, **change: object) -> bytes:
    """``entry`` with its first charge changed: schema-valid, but no governor's."""
    doc = orjson.loads(encode(entry, SOURCE))
    doc["id"] = new_id()
    doc["data"]["charges"][0].update(change)
    return orjson.dumps(doc)


async def internal_keys(backend: Backend) -> dict[str, object]:
    """The projection's own keys as Redis holds them (type and value), or {} in memory."""
    if not isinstance(backend, RedisBackend):
        return {}
    client = backend.client
    out: dict[str, object] = {}
    async for raw in client.scan_iter(match=f"{INTERNAL_PREFIX}*"):
        kind = (await client.type(raw)).decode()
        value: object = {
            "string": client.get,
            "hash": client.hgetall,
            "set": client.smembers,
        }[kind](raw)
        out[raw.decode()] = (kind, await value)  # type: ignore[misc]
    return out


async def test_hostile_charges_are_dead_lettered_and_the_rest_of_the_batch_applied(
    backend: Backend,
) -> None:
    """One bad event among good ones: it alone is dead-lettered, nothing of it is written."""
    entries = await governed_entries(backend)
    await backend.mark_ready("test")  # type: ignore[attr-defined]
    charged = next(e for e in entries if e.charges and e.charges[0].limit == "spend")
    day = time.strftime("%Y%m%d", time.gmtime(charged.time))
    bad = {
        "internal": hostile(charged, key="mcpbg:v1:_spend:global:" + charged.charges[0].bucket),
        "watermark": hostile(charged, key=WATERMARK_KEY),
        "epoch": hostile(charged, key=EPOCH_KEY),
        "seen": hostile(charged, key=f"{SEEN_PREFIX}:{day}"),
        "expiry": hostile(charged, expire_at=2**62),
        "negative": hostile(charged, amount=-(10**9)),
        "other limit": hostile(charged, key=charged.charges[0].key.replace(":spend:", ":burst:")),
    }
    records: list[tuple[int, bytes | None]] = []
    offsets: dict[int, str] = {}
    good = iter(entries)
    for offset in range(len(entries) + len(bad)):
        if offset % 3 == 1 and len(offsets) < len(bad):
            offsets[offset] = list(bad)[len(offsets)]
            records.append((offset, bad[offsets[offset]]))
        else:
            records.append((offset, encode(next(good), SOURCE)))
    before = await internal_keys(backend)
    letters: list[DeadLetter] = []
    projector = Projector(watermarked(backend), TOPIC, dlq=letters.append, require_epoch=True)
    result = await projector.apply_batch(0, records)
    assert (result.applied, result.dead) == (len(entries), len(bad))
    assert [d.offset for d in letters] == sorted(offsets)
    assert all("data.charges.0" in d.reason for d in letters), [d.reason for d in letters]
    await assert_projected(backend, totals(entries))
    after = await internal_keys(backend)
    if isinstance(backend, RedisBackend):
        # The watermark reached the batch's end; the marker is intact; the seen sets
        # hold the valid events' ids and nothing else.
        assert after.pop(WATERMARK_KEY) == (
            "hash",
            {f"{TOPIC}:0".encode(): str(len(records) - 1).encode()},
        )
        assert after.pop(EPOCH_KEY) == before.pop(EPOCH_KEY) == ("string", b"test")
        seen: set[bytes] = set()
        for key in [k for k in after if k.startswith(SEEN_PREFIX)]:
            kind, ids = after.pop(key)  # type: ignore[misc]
            assert kind == "set"
            seen |= ids
        assert seen == {e.id.encode() for e in entries}
        assert after == {}, after


async def test_the_watermark_passes_trailing_dead_letters_so_they_are_sent_once(
    backend: Backend,
) -> None:
    entries = await governed_entries(backend)
    records: list[tuple[int, bytes | None]] = [(0, encode(entries[0], SOURCE)), (1, b"{}")]
    letters: list[DeadLetter] = []
    projector = Projector(watermarked(backend), TOPIC, dlq=letters.append)
    await projector.apply_batch(0, records)
    assert await projector.resume_offset(0) == 2  # past the dead letter, not just the event
    only_poison: list[tuple[int, bytes | None]] = [(2, None), (3, b"x")]
    assert (await projector.apply_batch(0, only_poison)).dead == 2
    assert await projector.resume_offset(0) == 4
    # Redelivered (a consumer that read before it was aligned), or read by a restarted
    # worker: nothing is sent again.
    again = Projector(watermarked(backend), TOPIC, dlq=letters.append)
    assert (await again.apply_batch(0, [*records, *only_poison])).dead == 0
    assert [d.offset for d in letters] == [1, 2, 3]


async def test_a_retry_after_a_failed_apply_does_not_resend_its_dead_letters(
    backend: Backend,
) -> None:
    entries = await governed_entries(backend)
    records: list[tuple[int, bytes | None]] = [(0, b"{}"), (1, encode(entries[0], SOURCE))]
    letters: list[DeadLetter] = []
    projector = Projector(watermarked(backend), TOPIC, dlq=letters.append, require_epoch=True)
    with pytest.raises(EpochMissingError):  # no epoch marker: the apply refuses
        await projector.apply_batch(0, records)
    await backend.mark_ready("rebuilt")  # type: ignore[attr-defined]
    result = await projector.apply_batch(0, records)
    assert (result.applied, result.dead, len(letters)) == (1, 0, 1)


@pytest.mark.parametrize(
    "key",
    [
        WATERMARK_KEY,
        EPOCH_KEY,
        f"{SEEN_PREFIX}:20261129",
        "mcpbg:v1:_spend:global:20261129",
        "mcpbg:v1:spend:global",
        "mcpbg:v2:spend:global:20261129",
        "other:key",
    ],
)
async def test_the_apply_script_refuses_a_batch_with_a_key_of_no_counter_shape(
    redis_url: str, key: str
) -> None:
    """Defence in depth: even unvalidated, such a key makes the script write nothing."""
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    try:
        await backend.client.flushdb()
        good = AppliedCharge("mcpbg:v1:spend:user=u:20261129", 5, int(time.time()) + 3600)
        events = [
            AppliedEvent(0, new_id(), time.time(), (good,)),
            AppliedEvent(1, new_id(), time.time(), (AppliedCharge(key, 5, good.expire_at),)),
        ]
        with pytest.raises(ValueError, match="refused the batch"):
            await backend.apply("t:0", events)
        assert await backend.client.keys("*") == []
        assert await backend.apply("t:0", events[:1]) == 1  # the counter shape passes
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("value", "whole"),
    [
        (b"test", True),
        (b"01938f5e-0000-7000-8000-000000000000", True),
        (b"a" * 64, True),
        (b"a" * 65, False),
        (b"", False),
        (b"_x", False),
        (b"has space", False),
        (b"\xff", False),
        ("hash", False),
        ("set", False),
    ],
)
async def test_the_epoch_guard_checks_the_markers_type_and_value(
    redis_url: str, value: bytes | str, whole: bool
) -> None:
    """A marker that merely exists (a hash a stray write made, a wrong value) is no epoch."""
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    try:
        client = backend.client
        await client.delete(EPOCH_KEY)
        if value == "hash":
            await client.hset(EPOCH_KEY, "c", "1")
        elif value == "set":
            await client.sadd(EPOCH_KEY, "x")
        else:
            await client.set(EPOCH_KEY, value)
        assert (
            isinstance(value, str)
            or (EPOCH_VALUE.fullmatch(value.decode(errors="replace")) is not None) is whole
        )  # the Python rule ...
        assert await backend.has_epoch() is whole  # ... the client's check ...
        event = AppliedEvent(9, new_id(), time.time(), ())
        if whole:  # ... and the apply script's agree
            assert await backend.apply("epoch:0", [event], require_epoch=True) == 1
        else:
            with pytest.raises(EpochMissingError):
                await backend.apply("epoch:0", [event], require_epoch=True)
        with pytest.raises(InvalidInputError, match="epoch"):
            await backend.mark_ready("not an epoch")
        # ... and so does the hot path's charge script.
        hot = RedisBackend.from_url(redis_url, timeout=2.0, require_epoch=True)
        op = CounterOp("mcpbg:v1:calls:global:20261129", 1, 10, True, int(time.time()) + 60)
        try:
            if whole:
                assert (await hot.charge([op], event_id=new_id())).admitted
            else:
                with pytest.raises(BackendUnavailableError):
                    await hot.charge([op], event_id=new_id())
        finally:
            await hot.client.delete(op.key)
            await hot.aclose()
    finally:
        await backend.client.delete(EPOCH_KEY)
        await backend.aclose()
