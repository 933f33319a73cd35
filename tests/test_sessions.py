"""Session budgets across forks: a session and its forks spend one budget.

``Context(session="fork-7", session_root="fix-4821")`` keys every
``Scope.SESSION`` counter on the root; the ledger records the session and its
root; session counters expire a stated idle time (``SESSION_TTL_SECONDS``)
after their last write, on MemoryBackend and on a real Redis.
"""

from __future__ import annotations

import time

import orjson
import pytest
import redis

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.events import MalformedEventError, encode, parse
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.fastdecode import decode
from mcp_budget_governor.stream.projector import to_applied
from mcp_budget_governor.windows import SESSION_TTL_SECONDS

SESSION_BUDGET = Limit(
    "session_spend", cap=usd(1), window=Window.SESSION, unit=Unit.USD_MICROS, gated=True
)
ROOT = Context(user="ana", session="fix-4821")
FORKS = (
    Context(user="ana", session="fork-7", session_root="fix-4821"),
    Context(user="ana", session="fork-8", session_root="fix-4821"),
)


async def test_a_root_session_and_two_forks_spend_one_session_budget(backend: Backend) -> None:
    gov = Governor(Policy.of(SESSION_BUDGET), backend)
    # $0.30 from each of the three: $0.90 of the one $1 budget.
    for ctx in (ROOT, *FORKS):
        await gov.meter("session_spend", usd("0.30"), ctx)
    for ctx in (ROOT, *FORKS):
        assert await gov.usage("session_spend", ctx) == usd("0.90")
    assert (await gov.check(FORKS[1])).admitted  # $0.10 left
    await gov.meter("session_spend", usd("0.10"), FORKS[0])
    for ctx in (ROOT, *FORKS):
        decision = await gov.check(ctx)
        assert not decision.admitted and decision.limit == "session_spend"
    # Another session, even one named like a fork, has its own budget.
    assert (await gov.check(Context(user="ana", session="fork-7"))).admitted


async def test_the_ledger_records_the_session_and_its_root() -> None:
    ledger = MemoryLedger()
    gov = Governor(Policy.of(SESSION_BUDGET), MemoryBackend(), ledger=ledger)
    await gov.meter("session_spend", usd("0.25"), FORKS[0])
    (entry,) = ledger.entries
    raw = encode(entry, "test")
    event = parse(raw)
    assert event.data.context.session == "fork-7"
    assert event.data.context.session_root == "fix-4821"
    fast = decode(raw, 3)
    assert fast is not None  # the producers' own shape takes the fast path
    assert fast.event == to_applied(event, 3)
    # Without a root, the event reads exactly as before (no session_root field).
    await gov.meter("session_spend", usd("0.25"), ROOT)
    assert b"session_root" not in encode(ledger.entries[1], "test")


def _record(entry_raw: bytes, **context: str | None) -> bytes:
    event = orjson.loads(entry_raw)
    event["data"]["context"].update(context)
    return orjson.dumps(event)


async def test_a_topic_record_claiming_another_root_or_a_root_without_a_fork_is_refused() -> None:
    ledger = MemoryLedger()
    gov = Governor(Policy.of(SESSION_BUDGET), MemoryBackend(), ledger=ledger)
    await gov.meter("session_spend", usd("0.25"), FORKS[0])
    raw = encode(ledger.entries[0], "test")
    other_root = _record(raw, session_root="someone-else")
    with pytest.raises(MalformedEventError, match="session"):
        parse(other_root)
    assert decode(other_root, 0) is None
    # The fork's own name is not the counter's session either: the key is the root's.
    no_root = _record(raw, session_root=None)
    with pytest.raises(MalformedEventError, match="session"):
        parse(no_root)
    assert decode(no_root, 0) is None
    orphan = _record(raw, session=None)
    with pytest.raises(MalformedEventError, match="session_root"):
        parse(orphan)
    assert decode(orphan, 0) is None


def test_a_root_needs_a_session() -> None:
    with pytest.raises(InvalidInputError, match=r"Context\.session_root"):
        Context(user="ana", session_root="fix-4821")


async def test_session_counters_expire_after_a_day_idle_in_memory() -> None:
    now = [1_764_442_477.0]
    backend = MemoryBackend(clock=lambda: now[0])
    gov = Governor(Policy.of(SESSION_BUDGET), backend, clock=lambda: now[0])
    await gov.meter("session_spend", usd("0.40"), FORKS[0])
    # Each write restarts the idle clock: spend a day apart less a minute lives on.
    now[0] += SESSION_TTL_SECONDS - 60
    await gov.meter("session_spend", usd("0.40"), FORKS[1])
    now[0] += SESSION_TTL_SECONDS - 60
    assert await gov.usage("session_spend", ROOT) == usd("0.80")
    # A full idle day after the last write (plus the minute a plan is reused): gone.
    now[0] += 120
    assert await gov.usage("session_spend", ROOT) == 0


async def test_a_session_counter_on_redis_expires_a_day_after_its_last_write(
    redis_url: str,
) -> None:
    from mcp_budget_governor import RedisBackend

    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    gov = Governor(Policy.of(SESSION_BUDGET), backend)
    try:
        await gov.meter("session_spend", usd("0.40"), FORKS[0])
        client = redis.Redis.from_url(redis_url)
        try:
            keys = list(client.keys("mcpbg:v1:session_spend:*"))
            assert len(keys) == 1 and b"fix-4821" in keys[0] and b"fork" not in keys[0]
            expires = client.expiretime(keys[0])
        finally:
            client.close()
        now = time.time()
        # The idle expiry, give or take the minute a check's plan is reused.
        assert now + SESSION_TTL_SECONDS - 61 <= expires <= now + SESSION_TTL_SECONDS + 1
    finally:
        await gov.aclose()
