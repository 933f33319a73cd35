"""One bounds table at every door; sums checked before they are applied; a hostile
event dead-lettered whole while the rest of its partition is applied (issue 39).

The hostile events are schema-valid records a governor appended, then changed
(``testing/hostile.py``). They are refused by the schema when a number is out of
its range or a change names another counter than its context, and by the store
(before its first write, all or none) when a sum would leave the exact range or
take a counter's spend below zero.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

import orjson
import pytest

from mcp_budget_governor import Backend, Context, Governor, InvalidInputError, MemoryBackend, bounds
from mcp_budget_governor.counters import AppliedEvent
from mcp_budget_governor.errors import EventRefusedError
from mcp_budget_governor.events import MalformedEventError, parse
from mcp_budget_governor.money import MAX_AMOUNT
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.projector import DeadLetter, Projector, WatermarkBackend
from testing.hostile import ALICE, BOB, CASES, MALLORY, build, policy, spend_key

TOPIC = "ledger.bounds"


# -- the table ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "value", "problem"),
    [
        ("until", 10**30, "must be at most 253370764800 (9999-01-01T00:00:00Z)"),
        ("until", 0, "must be at least 1"),
        ("until", 1e300, "must be at most"),
        ("until", math.inf, "expected a whole number"),
        ("cap", -1, "must be at least 0"),
        ("cap", MAX_AMOUNT + 1, f"must be at most {MAX_AMOUNT}"),
        ("grant", 0, "must be at least 1"),
        ("amount", True, "expected a whole number"),
        ("time", -1, "must be at least 0"),
    ],
)
def test_every_number_out_of_its_range_is_one_line_naming_field_and_value(
    kind: str, value: Any, problem: str
) -> None:
    with pytest.raises(InvalidInputError) as info:
        bounds.check(kind, value, f"the {kind}")
    text = str(info.value)
    assert text.startswith(f"the {kind}: {problem}") and "\n" not in text
    assert f"(got {value!r})" in text


def test_in_range_numbers_pass_as_ints() -> None:
    assert bounds.check("until", 2_000_000_000.0) == 2_000_000_000
    assert bounds.check("cap", MAX_AMOUNT) == MAX_AMOUNT
    assert bounds.sum_problem("grant", MAX_AMOUNT - 1, 1) is None
    assert bounds.sum_problem("committed", 5, -6) == "committed: 5 + -6 would go below 0"


# -- the doors ------------------------------------------------------------------------


@pytest.mark.parametrize("until", [1e300, 10**30, 253_402_300_799])
async def test_set_cap_until_past_the_range_is_refused_at_the_door(until: Any) -> None:
    gov = Governor(policy(), MemoryBackend(), ledger=MemoryLedger())
    with pytest.raises(InvalidInputError, match=r"^until: must be at most 253370764800"):
        await gov.set_cap("calls", 5, until=until, user="alice")
    assert gov.ledger.entries == []  # type: ignore[union-attr]


def test_the_clis_latest_until_is_refused() -> None:
    """``--until 9999-12-31T23:59:59-12:00`` (year 10000 in UTC) never reaches a store."""
    from mcp_budget_governor import admin

    when = admin.parse_until(policy(), "9999-12-31T23:59:59-12:00")
    with pytest.raises(InvalidInputError, match=r"^until: must be at most"):
        admin.cap_change(policy(), "calls", {"user": "a"}, 5, until=when, now=0.0)


# -- the schema -------------------------------------------------------------------------


SCHEMA_CASES = ["cap_until", "grant_2_62", "grant_10_12", "grant_a_year", "other_user"]


@pytest.mark.parametrize("case", SCHEMA_CASES)
async def test_the_schema_refuses_changes_out_of_range_or_aimed_elsewhere(case: str) -> None:
    records, attack = await build(case)
    (raw,) = attack.raw
    with pytest.raises(MalformedEventError) as info:
        parse(raw)
    assert attack.reason in info.value.reason, info.value.reason
    for other in records:  # the honest ones all parse
        if other is not raw:
            parse(other)


def test_an_event_time_past_the_range_is_refused() -> None:
    from mcp_budget_governor.events import encode
    from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id

    raw = encode(LedgerEntry(new_id(), EntryType.ADMITTED, 1764442477.0, ALICE), "/t")
    doc = orjson.loads(raw)
    doc["time"] = "9999-06-01T00:00:00Z"
    with pytest.raises(MalformedEventError, match="time: must be at most 253370764800"):
        parse(orjson.dumps(doc))


# -- the projection: dead letter, once; the partition goes on ------------------------------


async def _spend(backend: Backend, ctx: Context) -> tuple[int, int]:
    state = await backend.state(spend_key(ctx))
    return state.committed, state.in_flight


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_hostile_event_is_dead_lettered_and_the_partition_applied(
    backend: Backend, case: str
) -> None:
    records, attack = await build(case)
    start = 2  # the attack follows two honest records
    letters: list[DeadLetter] = []
    assert isinstance(backend, WatermarkBackend)
    projector = Projector(backend, TOPIC, dlq=letters.append)
    batch = list(enumerate(records))
    result = await projector.apply_batch(0, batch)
    refused = [start + i for i in attack.refused]
    assert [d.offset for d in letters] == refused, [d.reason for d in letters]
    assert all(attack.reason in d.reason for d in letters), [d.reason for d in letters]
    assert all(d.raw == records[d.offset] for d in letters)
    assert result.dead == len(refused) and result.last_offset == len(records) - 1
    assert await projector.watermark(0) == len(records) - 1
    # Every other event of the partition is applied: the bystander and the honest spend.
    assert await _spend(backend, BOB) == (5_000, 0)
    assert await _spend(backend, ALICE) == (5_000, 0)
    committed, in_flight = await _spend(backend, MALLORY)
    assert 0 <= committed + in_flight <= MAX_AMOUNT and committed >= 0
    # Redelivered whole: nothing applied twice, no dead letter sent twice.
    again = await projector.apply_batch(0, batch)
    assert (again.applied, again.dead, len(letters)) == (0, 0, len(refused))
    assert await _spend(backend, BOB) == (5_000, 0)


async def test_a_refusal_writes_nothing_of_the_batch(backend: Backend) -> None:
    """All or none: the store checks every sum before its first write."""
    records, attack = await build("meter_max")
    assert isinstance(backend, WatermarkBackend)
    events = [_applied(parse(raw), offset) for offset, raw in enumerate(records)]
    with pytest.raises(EventRefusedError) as info:
        await backend.apply(f"{TOPIC}:0", events)
    assert info.value.offset == 2 + attack.refused[0]
    assert await _spend(backend, BOB) == (0, 0)
    assert await _spend(backend, MALLORY) == (0, 0)
    assert await backend.watermark(f"{TOPIC}:0") == -1


def _applied(event: Any, offset: int) -> AppliedEvent:
    from mcp_budget_governor.stream.projector import to_applied

    return to_applied(event, offset)


# -- grants add up within the exact range ----------------------------------------------


async def test_a_grant_past_the_exact_range_is_refused_at_the_door() -> None:
    gov = Governor(policy(), MemoryBackend())
    with pytest.raises(InvalidInputError) as info:
        await gov.grant("calls", MAX_AMOUNT, user="alice")
    assert str(info.value).startswith("amount: the counter's cap and grants (1000) plus")
    assert "\n" not in str(info.value)
    await gov.grant("calls", MAX_AMOUNT - 1_000, user="alice")
    with pytest.raises(InvalidInputError):
        await gov.grant("calls", 1, user="alice")
    assert (await gov.status(ALICE))["calls"]["remaining"] == MAX_AMOUNT


async def test_1030_grants_of_the_largest_amount_agree_on_every_backend(
    redis_url: str, postgres_url: str
) -> None:
    """Each grant past the exact range is refused with one line; after every step the
    memory, Redis and Postgres backends report the same remaining room."""
    from mcp_budget_governor import Limit, Policy, PostgresBackend, RedisBackend, Scope, Window

    pg = PostgresBackend.from_url(postgres_url, timeout=5.0)
    await pg.migrate()
    backends = [MemoryBackend(), RedisBackend.from_url(redis_url, timeout=5.0), pg]
    zero = Policy.of(Limit("calls", cap=0, window=Window.DAY, scope=Scope.USER))
    govs = [Governor(zero, b) for b in backends]
    user = f"u{id(govs)}"
    ctx = Context(user=user)
    refusals: set[str] = set()
    try:
        for step in range(1_030):
            outcomes = []
            for gov in govs:
                try:
                    await gov.grant("calls", MAX_AMOUNT, user=user)
                    outcomes.append("granted")
                except InvalidInputError as exc:
                    refusals.add(str(exc))  # one line: compared whole below
                    outcomes.append("refused")
                if step % 100 == 99:
                    await gov.check(ctx)  # some spend between the grants
            assert outcomes == ["granted" if step == 0 else "refused"] * 3, (step, outcomes)
            rows = [(await gov.status(ctx))["calls"] for gov in govs]
            for row in rows:
                row.pop("resets_in")  # read a moment apart
            assert rows[0] == rows[1] == rows[2], (step, rows)
            assert rows[0]["cap"] == MAX_AMOUNT
            assert rows[0]["remaining"] == MAX_AMOUNT - (step + 1) // 100
    finally:
        for gov in govs:
            await gov.aclose()
    assert refusals == {
        f"amount: the counter's cap and grants ({MAX_AMOUNT}) plus this one would leave the "
        f"exact range (at most {MAX_AMOUNT}) (got {MAX_AMOUNT})"
    }


async def test_a_store_refuses_grants_past_the_range_whole(backend: Backend) -> None:
    """The stores' own check, behind the door: a change batch that would take a grant past
    2**53 writes nothing of itself."""
    from mcp_budget_governor.caps import Change, ChangeKind
    from mcp_budget_governor.windows import Window, bucket_for

    bucket = bucket_for(Window.DAY, time.time())
    key = f"mcpbg:v1:calls:user=grantee:{bucket.label}"
    grant = Change(ChangeKind.GRANTED, "calls", key, "", MAX_AMOUNT, bucket.expire_at(0))
    writer: Any = backend.change  # type: ignore[attr-defined]
    await writer([grant])
    with pytest.raises(ValueError, match="would leave the exact range") as info:
        await writer([replace(grant, amount=1, key=key.replace("grantee", "other")), grant])
    assert "\n" not in str(info.value)
    assert (await backend.state(key)).grant == MAX_AMOUNT
    assert (await backend.state(key.replace("grantee", "other"))).grant == 0


class _Picky(MemoryBackend):
    """A store that fails (writing nothing) on any batch holding one offset, naming no event:
    the projector must find that event by applying one at a time."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    async def apply(self, partition: str, events: Any, **options: Any) -> int:
        if any(e.offset == self.bad for e in events):
            raise ValueError("numeric value out of range\nDETAIL: a second line")
        return await super().apply(partition, events, **options)


async def test_an_error_naming_no_event_is_narrowed_down_to_its_event() -> None:
    records, attack = await build("meter_max")
    honest = [r for r in records if r not in attack.raw]  # alice, bob, bob, alice
    letters: list[DeadLetter] = []
    backend = _Picky(1)  # bob's first spend
    projector = Projector(backend, TOPIC, dlq=letters.append)
    result = await projector.apply_batch(0, list(enumerate(honest)))
    reason = "ValueError: numeric value out of range"  # its first line
    assert [(d.offset, d.reason) for d in letters] == [(1, reason)]
    assert (result.dead, await projector.watermark(0)) == (1, len(honest) - 1)
    assert await _spend(backend, BOB) == (3_000, 0)
    assert await _spend(backend, ALICE) == (5_000, 0)


async def test_an_unreachable_store_is_retried_never_dead_lettered() -> None:
    class Down(MemoryBackend):
        async def apply(self, partition: str, events: Any, **options: Any) -> int:
            raise ConnectionError("refused")

    records, _ = await build("negative_recovered")
    letters: list[DeadLetter] = []
    projector = Projector(Down(), TOPIC, dlq=letters.append)
    with pytest.raises(ConnectionError):
        await projector.apply_batch(0, list(enumerate(records)))
    assert letters == []


async def test_the_file_projector_skips_a_refused_event_and_goes_on(tmp_path: Any) -> None:
    from mcp_budget_governor.producers.file_ledger import DEFAULT_PREFIX, FileProjector
    from mcp_budget_governor.producers.record_log import RecordLog

    records, attack = await build("meter_max")
    log = RecordLog(tmp_path, prefix=DEFAULT_PREFIX)
    log.append(records)
    log.close()
    backend = MemoryBackend()
    projector = FileProjector(tmp_path, backend)
    await projector.catch_up()
    assert projector.refused == len(attack.refused)
    assert await _spend(backend, BOB) == (5_000, 0)
    assert await _spend(backend, MALLORY) == (MAX_AMOUNT, 0)
