"""Caches keyed by caller-chosen strings stay bounded in bytes, not only in entries.

A million distinct long names go through every cache a hostile caller (or a
hostile record on the ledger topic) can reach: key escaping, the worker's fast
decoder and the charge rules behind it, the governor's plans and the ledger's
encoded contexts. The memory they keep is measured with ``tracemalloc``
(what Python allocated and still holds), never timed.
"""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import UTC

import orjson

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    Scope,
    Unit,
    Window,
    keys,
    planning,
    provenance,
)
from mcp_budget_governor.events import encode
from mcp_budget_governor.ledger import EntryType, LedgerEntry, new_id
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream import fastdecode

MIB = 1 << 20
SPEND = Limit("spend", cap=10**12, window=Window.DAY, unit=Unit.USD_MICROS, scope=Scope.USER)


def held_after(work: Callable[[], None]) -> int:
    """Bytes still allocated once ``work`` is done (its garbage collected)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        work()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def names(n: int, length: int, tag: str) -> Iterator[str]:
    """``n`` distinct names of ``length`` characters."""
    pad = tag * length
    for i in range(n):
        yield f"{i:07d}{pad}"[:length]


def test_key_escaping_keeps_at_most_its_byte_budget() -> None:
    def flood() -> None:
        # A million names: long ones (hashed in keys) and ones just short enough to keep.
        for long, short in zip(names(500_000, 1_000, "L"), names(500_000, 190, "s"), strict=True):
            keys.escape(long)
            keys.escape(short)

    held = held_after(flood)
    cache = keys._ESCAPED
    assert 0 < cache.size <= cache.max_bytes == 8 * MIB
    # An entry-bounded cache would hold 65,536 of each (about 90 MiB of long names).
    assert held <= cache.max_bytes + 2 * MIB, held
    assert keys.escape("x" * 10**6) == keys.escape("x" * 10**6)  # long values: hashed, not kept


def records(n: int, length: int) -> Iterator[bytes]:
    """``n`` valid metered events, each for a distinct user with a ``length``-character id."""
    now = time.time()
    for i, user in enumerate(names(n, length, "u")):
        ctx = Context(user=user)
        slot = planning.slot(SPEND, ctx, now, UTC, i + 1, enforce=False)
        assert slot is not None
        entry = LedgerEntry(new_id(), EntryType.METERED, now, ctx, (slot.ledger_charge(),))
        yield encode(entry, "/caches")


def test_the_fast_decoder_and_the_charge_rules_keep_at_most_their_budgets() -> None:
    valid = list(records(30_000, 180))  # unhashed: the longest keys a cache may keep
    template = orjson.loads(valid[0])

    def flood() -> None:
        for offset, raw in enumerate(valid):
            assert fastdecode.decode(raw, offset) is not None
        # Hostile records: keys far longer than any counter's, a distinct one each.
        for offset, long in enumerate(names(30_000, 5_000, "k")):
            template["data"]["charges"][0]["key"] = f"mcpbg:v1:spend:user={long}:x"
            template["data"]["charges"][0]["limit"] = long[:64]
            assert fastdecode.decode(orjson.dumps(template), offset) is None

    held = held_after(flood)
    budgets = fastdecode._charges.max_bytes + provenance._SHAPES.max_bytes
    assert fastdecode._charges.size <= fastdecode._charges.max_bytes
    assert provenance._SHAPES.size <= provenance._SHAPES.max_bytes
    assert fastdecode._name_ok.cache_info().currsize <= 4096
    assert held <= budgets + keys._ESCAPED.max_bytes + 4 * MIB, held


def test_the_governor_and_the_ledger_encoder_keep_no_long_context() -> None:
    gov = Governor(Policy.of(SPEND), MemoryBackend(), ledger=MemoryLedger())

    async def calls() -> None:
        for user in names(20_000, 4_000, "c"):
            await gov.check(Context(user=user, tool="search"))
        gov.ledger.entries.clear()  # type: ignore[union-attr]  # the ledger, not a cache
        gov._outage.fallback = MemoryBackend()

    def flood() -> None:
        asyncio.run(calls())

    held = held_after(flood)
    assert gov._plans == {}  # long contexts are planned afresh
    # What is left: the backend's counters (one small hash each), not the ids.
    assert held <= 20_000 * 600 + 2 * MIB, held
