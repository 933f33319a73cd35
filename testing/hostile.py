"""The hostile ledger events of issue 39, built from what a real Governor appends.

Each case is an honest ledger (two customers' spend, before and after) with
the attacker's event(s) in the middle: schema-valid records, changed the way
someone with write access to the ledger topic would change them. ``refused``
says which of the attacker's records the projection must dead-letter (a first
grant or meter of the largest amount is in range and applies; the next ones
are not).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    MemoryBackend,
    OnExceed,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.approval import Approval
from mcp_budget_governor.events import encode
from mcp_budget_governor.holds import Reservations
from mcp_budget_governor.ledger import LedgerEntry, new_id
from mcp_budget_governor.money import MAX_AMOUNT
from mcp_budget_governor.producers.memory_ledger import MemoryLedger

__all__ = ["CASES", "SOURCE", "Case", "build", "policy"]

SOURCE = "/mcpbg/hostile"
ALICE = Context(user="alice", tenant="acme")
BOB = Context(user="bob", tenant="bystander")
MALLORY = Context(user="mallory", tenant="acme")


def policy() -> Policy:
    return Policy.of(
        Limit("calls", cap=1_000, window=Window.DAY, scope=Scope.USER),
        Limit("spend", cap=usd(100), window=Window.DAY, scope=Scope.USER,
              unit=Unit.USD_MICROS, gated=False),
        Limit("asked", cap=1, window=Window.DAY, scope=Scope.USER, on_exceed=OnExceed.ASK),
    )  # fmt: skip


@dataclass(frozen=True)
class Case:
    """The attacker's records (``raw``) and which of them must be refused."""

    name: str
    raw: list[bytes]
    refused: list[int]
    reason: str


def _dumps(doc: dict[str, Any]) -> bytes:
    # json, not orjson: an attacker's numbers may not fit 64 bits
    return json.dumps(doc, separators=(",", ":")).encode()


def _doc(entry: LedgerEntry) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(encode(entry, SOURCE))
    return doc


def _again(doc: dict[str, Any]) -> bytes:
    """The same record under a new id (a new event, as a producer would write it)."""
    doc = dict(doc, id=new_id())
    return _dumps(doc)


async def build(case: str) -> tuple[list[bytes], Case]:
    """The whole ledger of ``case``: honest records, the attack, honest records."""
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=ledger)
    await gov.meter("spend", 1_000, ALICE)
    await gov.meter("spend", 2_000, BOB)
    honest_before = [encode(e, SOURCE) for e in ledger.entries]
    ledger.entries.clear()
    attack = await CASES[case](gov, ledger)
    await gov.meter("spend", 3_000, BOB)
    await gov.meter("spend", 4_000, ALICE)
    honest_after = [encode(e, SOURCE) for e in ledger.entries[-2:]]
    return [*honest_before, *attack.raw, *honest_after], attack


async def _cap_until(gov: Governor, ledger: MemoryLedger) -> Case:
    await gov.set_cap("calls", 5, user="alice")
    doc = _doc(ledger.entries[-1])
    doc["data"]["change"]["until"] = 10**30
    return Case("cap_set until=10**30", [_dumps(doc)], [0], "data.change.until")


async def _grant(gov: Governor, ledger: MemoryLedger, **change: Any) -> dict[str, Any]:
    await gov.grant("calls", 5, user="alice")
    doc = _doc(ledger.entries[-1])
    doc["data"]["change"].update(change)
    return doc


async def _grant_2_62(gov: Governor, ledger: MemoryLedger) -> Case:
    doc = await _grant(gov, ledger, until=2**62)
    return Case("granted until=2**62", [_dumps(doc)], [0], "data.change.until")


async def _grant_10_12(gov: Governor, ledger: MemoryLedger) -> Case:
    doc = await _grant(gov, ledger, until=10**12)
    return Case("granted until=10**12", [_dumps(doc)], [0], "data.change.until")


async def _grant_a_year(gov: Governor, ledger: MemoryLedger) -> Case:
    """In range, but a year past its day counter's end: the TTL is tied to the bucket."""
    doc = await _grant(gov, ledger)
    doc["data"]["change"]["until"] += 365 * 86_400
    return Case("granted until a year later", [_dumps(doc)], [0], "not its counter's expiry")


async def _grants_past(gov: Governor, ledger: MemoryLedger) -> Case:
    doc = await _grant(gov, ledger, amount=MAX_AMOUNT)
    raw = [_again(doc), _again(doc), _again(doc)]
    return Case("grants past the range", raw, [1, 2], "would leave the exact range")


async def _other_user(gov: Governor, ledger: MemoryLedger) -> Case:
    doc = await _grant(gov, ledger)
    doc["data"]["context"]["user"] = "mallory"
    return Case("change naming another user", [_dumps(doc)], [0], "not this event's")


async def _negative_settled(gov: Governor, ledger: MemoryLedger) -> Case:
    async with gov.reserved("spend", 5_000, MALLORY) as r:
        r.actual = 1_000
    reserved, settled = (_doc(e) for e in ledger.entries[-2:])
    settled["data"]["charges"][0]["amount"] = -MAX_AMOUNT
    raw = [_dumps(reserved), _dumps(settled)]
    return Case("negative settled", raw, [1], "is more than reservation")


async def _negative_recovered(gov: Governor, ledger: MemoryLedger) -> Case:
    await gov.meter("spend", 10, MALLORY)
    doc = _doc(ledger.entries[-1])
    doc["type"] = "mcpbg.recovered.v1"
    doc["data"]["charges"][0]["amount"] = -MAX_AMOUNT
    return Case("negative recovered", [_dumps(doc)], [0], "names no reservation")


async def _funded(gov: Governor, ledger: MemoryLedger) -> list[bytes]:
    """Mallory's honest spend, enough that no refund below takes it under zero: what
    refuses those is the reservation rule alone."""
    await gov.meter("spend", 10_000, MALLORY)
    return [encode(ledger.entries[-1], SOURCE)]


async def _settled(gov: Governor, ledger: MemoryLedger, ctx: Context) -> list[dict[str, Any]]:
    """A reservation of 5,000 settled at 1,000: its reserved and settled events."""
    async with gov.reserved("spend", 5_000, ctx) as r:
        r.actual = 1_000
    return [_doc(e) for e in ledger.entries[-2:]]


async def _settle_unreserved(gov: Governor, ledger: MemoryLedger) -> Case:
    raw = await _funded(gov, ledger)
    _, settled = await _settled(gov, ledger, MALLORY)
    settled["data"]["reservation"] = new_id()  # one no reserved event made
    raw.append(_dumps(settled))
    return Case("settled without a reservation", raw, [1], "not one the ledger holds")


async def _settle_over_estimate(gov: Governor, ledger: MemoryLedger) -> Case:
    raw = await _funded(gov, ledger)
    reserved, settled = await _settled(gov, ledger, MALLORY)
    settled["data"]["charges"][0]["amount"] = -6_000  # of a 5,000 estimate
    raw += [_dumps(reserved), _dumps(settled)]
    return Case("settled past its estimate", raw, [2], "is more than reservation")


async def _released_over_estimate(gov: Governor, ledger: MemoryLedger) -> Case:
    raw = await _funded(gov, ledger)
    async with gov.reserved("spend", 5_000, MALLORY) as r:
        r.release()
    reserved, released = (_doc(e) for e in ledger.entries[-2:])
    released["data"]["charges"][0]["amount"] = -5_001
    raw += [_dumps(reserved), _dumps(released)]
    return Case("released past its estimate", raw, [2], "is more than reservation")


async def _settled_twice(gov: Governor, ledger: MemoryLedger) -> Case:
    raw = await _funded(gov, ledger)
    reserved, settled = await _settled(gov, ledger, MALLORY)
    raw += [_dumps(reserved), _dumps(settled), _again(settled)]
    return Case("settled twice", raw, [3], "not one the ledger holds")


async def _recovered_twice(gov: Governor, ledger: MemoryLedger) -> Case:
    """A refund recovered under the reservation a settlement closed already."""
    raw = await _funded(gov, ledger)
    reserved, settled = await _settled(gov, ledger, MALLORY)
    recovered = dict(settled, id=new_id(), type="mcpbg.recovered.v1")
    raw += [_dumps(reserved), _dumps(settled), _dumps(recovered)]
    return Case("recovered after its settlement", raw, [3], "not one the ledger holds")


async def _settle_anothers(gov: Governor, ledger: MemoryLedger) -> Case:
    """Mallory's refund naming another tenant's open reservation; that one's own
    settlement, after, still applies."""
    raw = await _funded(gov, ledger)
    victim = Context(user="victim", tenant="other")
    reserved, settled = await _settled(gov, ledger, victim)
    _, mine = await _settled(gov, ledger, MALLORY)
    mine = dict(mine, id=new_id(), data=dict(mine["data"], reservation=reserved["id"]))
    raw += [_dumps(reserved), _dumps(mine), _dumps(settled)]
    return Case("settled on another's reservation", raw, [2], "holds no estimate")


async def _meter_max(gov: Governor, ledger: MemoryLedger) -> Case:
    await gov.meter("spend", 10, MALLORY)
    doc = _doc(ledger.entries[-1])
    doc["data"]["charges"][0]["amount"] = MAX_AMOUNT
    raw = [_again(doc), _again(doc), _again(doc)]
    return Case("three meter(MAX_AMOUNT)", raw, [1, 2], "would leave the exact range")


async def _honest_burst(gov: Governor, ledger: MemoryLedger) -> Case:
    """No attack: a Governor's own reservations, settled under, over and at their
    estimates, released, failed, cancelled, on one and on two limits, interleaved with
    spend. Every record applies: nothing of ours is a dead letter."""
    start = len(ledger.entries)
    eve = Context(user="eve", tenant="other")

    async def held(ctx: Context, estimate: int, actual: int | None = None) -> None:
        async with gov.reserved("spend", estimate, ctx) as r:
            if actual is not None:
                r.actual = actual

    await gov.meter("spend", 700, MALLORY)
    await held(MALLORY, 5_000, 1_000)  # settled under its estimate
    await held(eve, 1_000, 3_000)  # and over it
    await held(MALLORY, 2_000)  # the estimate stands: a close without charges
    await held(MALLORY, 2_000, 2_000)  # exact: likewise
    async with gov.reserved("spend", 2_000, eve) as r:
        r.release()
    try:
        async with gov.reserved("spend", 1_500, MALLORY):
            raise RuntimeError("the tool failed")
    except RuntimeError:
        pass
    entered = asyncio.Event()

    async def cancelled() -> None:
        async with gov.reserved("spend", 800, MALLORY) as r:
            r.actual = 100
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(cancelled())
    await entered.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    explicit = await gov.reserve("spend", 4_000, eve)
    await gov.meter("spend", 300, eve)
    await gov.settle(explicit, 500)
    await gov.settle(explicit, 10)  # settles once: nothing more
    async with Reservations(gov, {"spend": 3_000, "calls": 2}, MALLORY) as both:
        both.actual["spend"] = 1_200
    async with Reservations(gov, {"spend": 900, "calls": 1}, eve) as both:
        both.release()
    raw = [encode(e, SOURCE) for e in ledger.entries[start:]]
    return Case("a Governor's honest burst", raw, [], "")


async def _approval_reused(gov: Governor, ledger: MemoryLedger) -> Case:
    """The admission an approval allowed, appended again under a new id: its one-time
    id is spent already (the first admission's event marked it)."""
    assert (await gov.check(MALLORY)).admitted
    approval = Approval("asked", secrets.token_hex(16), int(time.time()) + 120)
    assert (await gov.check(MALLORY, approved=[approval])).admitted
    first, approved = (_doc(e) for e in ledger.entries[-2:])
    assert approved["data"]["decision"]["spent"][0]["once"] == approval.once
    raw = [_dumps(first), _dumps(approved), _again(approved)]
    return Case("an approval's admission appended twice", raw, [2], "spent already")


CASES: dict[str, Callable[[Governor, MemoryLedger], Any]] = {
    "cap_until": _cap_until,
    "grant_2_62": _grant_2_62,
    "grant_10_12": _grant_10_12,
    "grant_a_year": _grant_a_year,
    "grants_past": _grants_past,
    "other_user": _other_user,
    "negative_settled": _negative_settled,
    "negative_recovered": _negative_recovered,
    "meter_max": _meter_max,
    "settle_unreserved": _settle_unreserved,
    "settle_over_estimate": _settle_over_estimate,
    "released_over_estimate": _released_over_estimate,
    "settled_twice": _settled_twice,
    "recovered_twice": _recovered_twice,
    "settle_anothers": _settle_anothers,
    "honest_burst": _honest_burst,
    "approval_reused": _approval_reused,
}


def spend_key(ctx: Context, now: float | None = None) -> str:
    """The key of ``ctx``'s spend counter today (UTC)."""
    day = time.strftime("%Y%m%d", time.gmtime(time.time() if now is None else now))
    return f"mcpbg:v1:spend:user={ctx.user}:{day}"
