"""Sample ledger entries and the CloudEvents the Python ledger makes of them.

Every entry is produced by the real :class:`~mcp_budget_governor.Governor` (a fixed
clock, a memory backend, a capturing ledger), so its charges, buckets, keys and
expiries are the ones a governor writes; only the random ids are replaced by fixed
UUIDv7s, so the file is the same on every run. Each vector holds the entry in the
TypeScript field names (``ts/src/ledger/types.ts``), the exact event line
:func:`mcp_budget_governor.events.encode` writes, and the Kafka record key
(:func:`~mcp_budget_governor.ledger.partition_key`). ``events.schema.json`` beside it
is what ``mcpbg schema`` prints. The TypeScript suite (``ts/test/ledgerEvents.test.ts``)
checks its encoder against them; ``tests/test_conformance_events.py`` fails when the
committed files are stale.

    .venv/bin/python conformance/events.py            # rewrite both files
    .venv/bin/python conformance/events.py --check    # exit 1 if either is stale
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from mcp_budget_governor import (
    BudgetExceeded,
    Context,
    Governor,
    Limit,
    MemoryBackend,
    OnExceed,
    Plan,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.approval import Approval
from mcp_budget_governor.events import encode, json_schemas, parse, type_name
from mcp_budget_governor.holds import Reservations
from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id, partition_key
from mcp_budget_governor.producers.memory_ledger import MemoryLedger

HERE = Path(__file__).resolve().parent
EVENTS = HERE / "events.json"
SCHEMA = HERE / "events.schema.json"
SOURCE = "/mcpbg/conformance"
#: 2025-11-29T18:54:37Z plus 1/128 s: a fraction whose microseconds end in exactly .5,
#: so the encoders must round half to even alike (7812.5 -> 7812).
T0 = 1764442477.0078125

HOSTILE = (
    "a:b",  # the key separator
    "user=x,tool=y",  # the composite-scope syntax
    'q"u\\o\nte\t\u0001\u001f\u007f',  # JSON escapes and control characters
    "caf\u00e9 \u65e5\u672c \U0001f600 \u2028",  # non-ASCII, astral, a line separator
    "%3A%25",  # what an escaped value looks like
)


def _policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER),
        Limit("tenant_day", cap=1000, window=Window.DAY, scope=Scope.TENANT),
        Limit("tool_calls", cap=50, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
        Limit("shadow", cap=1, window=Window.HOUR, scope=Scope.USER, on_exceed=OnExceed.ALERT),
        Limit("askme", cap=3, window=Window.MONTH, scope=Scope.TENANT, on_exceed=OnExceed.ASK),
        Limit(
            "spend",
            cap=usd(5),
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
        Limit("tokens", cap=1_000_000, window=Window.WEEK, unit=Unit.TOKENS, scope=Scope.USER),
        Limit("session_calls", cap=100, window=Window.SESSION, scope=Scope.SESSION),
        timezone="Europe/Paris",
        plans=[Plan("pro", {"tenant_day": 5000})],
    )


async def _entries() -> list[LedgerEntry]:
    clock = [T0]
    ledger = MemoryLedger()
    gov = Governor(_policy(), MemoryBackend(clock=lambda: clock[0]), ledger=ledger,
                   clock=lambda: clock[0])  # fmt: skip

    def tick(seconds: float = 1.25) -> None:
        clock[0] += seconds

    alice = Context(user="alice", tenant="acme", tool="search", agent="bot-1")
    await gov.check(alice)  # admitted
    tick()
    await gov.check(alice)  # admitted, the shadow limit over
    tick()
    await gov.check(alice)  # rejected by burst
    tick(60)
    await gov.check(alice, approved=["askme"])  # admitted past askme, approved
    tick()
    await gov.meter("spend", usd("0.125"), alice)
    tick()
    await gov.meter_tokens(
        "tokens", "gpt-4o", input_tokens=1200, output_tokens=345, cache_read_tokens=7,
        cache_write_tokens=3, ctx=alice,
    )  # fmt: skip
    tick()
    async with gov.reserved("spend", usd(1), alice) as r:  # reserved, then settled
        r.actual = usd("0.25")
    tick()
    async with gov.reserved("spend", usd(2), alice) as r:  # reserved, then released
        r.release()  # the work never ran
    tick()
    async with gov.reserved("spend", usd("0.5"), alice):  # reserved, the estimate stands:
        pass  # settled with no charges, naming its reservation
    tick()
    forked = Context(user="bob", session="fork-7", session_root="root-1", tool="fetch")
    await gov.check(forked)
    anon_tenant = Context(tenant="solo")
    await gov.meter("spend", 1, anon_tenant)
    tick()
    for value in HOSTILE:
        await gov.check(Context(user=value, tenant=value, tool=value, session=value))
        tick(0.001)
    with_tool_only = Context(tool="search")
    with contextlib.suppress(BudgetExceeded):
        await gov.check(with_tool_only)  # anonymous, and charged by no limit
    tick()
    # Run-time changes (ledger events, projected like charges).
    await gov.set_cap(
        "burst", 7, until=T0 + 86_400, reason="incident 42", actor="ops", user="alice"
    )
    await gov.unset_cap("burst", user="alice", actor="ops")
    await gov.assign_plan("pro", tenant="acme", reason="upgrade", actor="billing")
    await gov.assign_plan(None, user=HOSTILE[2], actor="billing")
    await gov.grant("spend", usd(3), tenant="acme", reason="goodwill", actor="support")
    await gov.reset("burst", user=HOSTILE[0], actor="support")
    tick()
    # A hard cap on two limits (the integrations' estimates): one reserved event with
    # both charges, one settled event naming it with the one non-zero delta.
    async with Reservations(gov, {"spend": usd(1), "tokens": 5000}, alice) as held:
        tick()
        held.actual["spend"] = usd("0.375")
    tick(60)
    # A one-time approval spent with the admission: its event names it (data.decision.spent).
    await gov.check(alice, approved=[Approval("askme", "5e" * 16, 4_102_444_800)])
    assert ledger.entries[-1].approved and ledger.entries[-1].type is EntryType.ADMITTED
    entries = list(ledger.entries)
    # A recovered event (``mcpbg reconcile --fix``) carries a lost event's charges; and
    # a degraded admission (Redis down, OPEN fallback): built from the entries above.
    first = entries[0]
    entries.append(dataclasses.replace(first, type=EntryType.RECOVERED))
    entries.append(dataclasses.replace(first, id=new_id(), degraded=True))
    return entries


def _fixed_ids(entries: list[LedgerEntry]) -> list[LedgerEntry]:
    """Replace each random UUIDv7 by a fixed one of the same millisecond (the recovered
    event keeps the id of the event it stands for); reservations follow their ids."""
    mapping: dict[str, str] = {}
    for i, e in enumerate(entries):
        if e.id not in mapping:
            ms = int(e.time * 1000)
            digits = f"{ms:012x}7{i:03x}8{i:015x}"
            mapping[e.id] = (
                f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"
            )
    out = []
    for e in entries:
        reservation = None if e.reservation is None else mapping.get(e.reservation, e.reservation)
        out.append(dataclasses.replace(e, id=mapping[e.id], reservation=reservation))
    return out


def to_ts(entry: LedgerEntry) -> dict[str, Any]:
    """An entry in the field names of the TypeScript ``LedgerEntry`` (camelCase)."""
    c = entry.context
    usage = entry.usage
    change = entry.change
    return {
        "id": entry.id,
        "type": entry.type.value,
        "time": entry.time,
        "context": {
            "user": c.user,
            "tenant": c.tenant,
            "tool": c.tool,
            "session": c.session,
            "agent": c.agent,
            "sessionRoot": c.session_root,
        },
        "charges": [
            {
                "limit": ch.limit,
                "unit": ch.unit.value,
                "amount": ch.amount,
                "window": ch.window.value,
                "bucket": ch.bucket,
                "key": ch.key,
                "expireAt": ch.expire_at,
            }
            for ch in entry.charges
        ],
        "limit": entry.limit,
        "status": entry.status,
        "over": list(entry.over),
        "usage": None
        if usage is None
        else {
            "model": usage.model,
            "inputTokens": usage.input_tokens,
            "outputTokens": usage.output_tokens,
            "cacheReadTokens": usage.cache_read_tokens,
            "cacheWriteTokens": usage.cache_write_tokens,
            "priceVersion": usage.price_version,
        },
        "degraded": entry.degraded,
        "reservation": entry.reservation,
        "change": None
        if change is None
        else {
            "kind": change.kind.value,
            "limit": change.limit,
            "key": change.key,
            "field": change.field,
            "amount": change.amount,
            "until": change.until,
            "plan": change.plan,
            "actor": change.actor,
            "reason": change.reason,
        },
        "approved": list(entry.approved),
        "spent": [
            {"limit": str(a), "once": a.once, "until": a.until}
            for a in entry.approved
            if isinstance(a, Approval)
        ],
    }


def vectors() -> dict[str, Any]:
    entries = _fixed_ids(asyncio.run(_entries()))
    out = []
    for entry in entries:
        raw = encode(entry, SOURCE)
        parse(raw)  # every sample is a valid event (the schema and the provenance rules)
        out.append(
            {
                "entry": to_ts(entry),
                "type": type_name(entry.type),
                "key": partition_key(entry.context.tenant, entry.context.user).decode(),
                "event": raw.decode(),
            }
        )
    covered = {v["type"] for v in out}
    missing = {type_name(k) for k in EntryType} - covered
    assert not missing, f"no sample of {sorted(missing)}"
    return {
        "comment": "Generated by conformance/events.py from the Python implementation; "
        "do not edit. event: the exact line the Python ledger writes (source "
        f"{SOURCE!r}); key: the Kafka record key.",
        "source": SOURCE,
        "vectors": out,
    }


def render() -> tuple[str, str]:
    """(events.json, events.schema.json) as they should be committed."""
    events = json.dumps(vectors(), indent=1, ensure_ascii=False) + "\n"
    schema = json.dumps(json_schemas(), indent=2, sort_keys=True) + "\n"  # as `mcpbg schema`
    return events, schema


def main(argv: list[str]) -> int:
    events, schema = render()
    if "--check" in argv:
        stale = [p.name for p, text in ((EVENTS, events), (SCHEMA, schema))
                 if not p.exists() or p.read_text(encoding="utf-8") != text]  # fmt: skip
        if stale:
            print(f"stale: {', '.join(stale)}; run .venv/bin/python conformance/events.py",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 0
    EVENTS.write_text(events, encoding="utf-8")
    SCHEMA.write_text(schema, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
