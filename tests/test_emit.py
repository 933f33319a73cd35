"""Emit-only metering (Recorder, emit) and the @governed decorator.

A Recorder appends the same metered events a Governor would, for the same
context and instant; projected, they count on the shared counters (memory and
a real Redis) like any other event.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

import pytest

from mcp_budget_governor import (
    MAX_AMOUNT,
    Backend,
    Context,
    Governor,
    GovernorError,
    InvalidInputError,
    Limit,
    LimitExceeded,
    MemoryBackend,
    MeterResult,
    Policy,
    PolicyError,
    PriceTable,
    Scope,
    Unit,
    UnknownModelError,
    Window,
    planning,
    usd,
)
from mcp_budget_governor.errors import CounterOverflowError, MissingScopeError
from mcp_budget_governor.events import MeteredEvent, encode, parse, to_entry
from mcp_budget_governor.integrations.decorator import governed
from mcp_budget_governor.ledger import EntryType, LedgerEntry
from mcp_budget_governor.producers.emit import Recorder, emit
from mcp_budget_governor.producers.memory_ledger import MemoryLedger

PRICES = PriceTable().with_price("m", 3, 15, cache_read_per_mtok="0.3")
WHO = Context(user="u_42", tenant="acme", tool="search", session="s1", agent="a1")


def policy(timezone: str | None = None) -> Policy:
    return Policy.of(
        Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER),
        Limit("daily", cap=1000, window=Window.DAY, scope=(Scope.TENANT, Scope.TOOL), gated=False),
        Limit(
            "tokens", cap=10**7, window=Window.HOUR, unit=Unit.TOKENS, scope=Scope.USER, gated=False
        ),
        Limit(
            "monthly",
            cap=usd(100),
            window=Window.MONTH,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
        Limit("per_session", cap=50, window=Window.SESSION, gated=False),
        Limit(
            "spend", cap=usd(2), window=Window.DAY, unit=Unit.USD_MICROS, breaker=True, gated=False
        ),
        timezone=timezone,
    )


def fixed(now: float) -> Callable[[], float]:
    return lambda: now


def without_id(entry: LedgerEntry) -> LedgerEntry:
    return replace(entry, id="-")


Meterer = Governor | Recorder


def charged(got: int | MeterResult) -> int:
    """The amount charged: what a Recorder returns, a Governor's MeterResult.charged."""
    return got.charged if isinstance(got, MeterResult) else got


async def every_kind_of_charge(m: Meterer, ctx: Context) -> list[int]:
    got: list[int | MeterResult] = [
        await m.meter("daily", 7, ctx),
        await m.meter("per_session", 1, ctx),
        await m.meter("spend", usd("0.125"), ctx),
        await m.meter("burst", 0, ctx),
        await m.meter_tokens("tokens", "m", input_tokens=1200, output_tokens=300, ctx=ctx),
        await m.meter_tokens(
            "monthly", "m", input_tokens=3200, output_tokens=850, cache_read_tokens=1000, ctx=ctx
        ),
        await m.meter_tokens("spend", "M", input_tokens=10, output_tokens=0, ctx=ctx),
    ]
    return [charged(g) for g in got]


# -- Recorder: the same events a Governor appends ---------------------------


@pytest.mark.parametrize("timezone", [None, "America/New_York", "Asia/Kolkata"])
@pytest.mark.parametrize(
    "now",
    [
        1764442477.0,  # an ordinary afternoon
        1767225599.0,  # 2025-12-31T23:59:59Z: the last second of a UTC day, month and year
        1767243600.0,  # 2026-01-01T05:00:00Z: midnight in New York
    ],
)
async def test_recorder_appends_what_the_governor_would(now: float, timezone: str | None) -> None:
    pol = policy(timezone)
    recorded, governed_ = MemoryLedger(), MemoryLedger()
    rec = Recorder(pol, recorded, prices=PRICES, clock=fixed(now))
    gov = Governor(pol, MemoryBackend(), ledger=governed_, prices=PRICES, clock=fixed(now))

    amounts = await every_kind_of_charge(rec, WHO)
    assert amounts == await every_kind_of_charge(gov, WHO)
    assert amounts[4] == 1500  # tokens counted on a TOKENS limit
    assert amounts[5] == PRICES.cost_micros(
        "m", input_tokens=3200, output_tokens=850, cache_read_tokens=1000
    )
    assert [without_id(e) for e in recorded.entries] == [without_id(e) for e in governed_.entries]

    for entry in recorded.entries:
        assert entry.type is EntryType.METERED
        assert entry.time == now
        assert entry.context == WHO
        for charge in entry.charges:
            # The bucket, key and expiry planning.slot gives for this limit at the event time.
            s = planning.slot(pol[charge.limit], WHO, now, pol.tz, charge.amount, enforce=False)
            assert s is not None
            assert charge == s.ledger_charge()
        # Every entry is a valid CloudEvent and reads back as itself.
        event = parse(encode(entry, "/mcpbg/test"))
        assert isinstance(event, MeteredEvent)
        assert to_entry(event) == entry

    usage = [e.usage for e in recorded.entries]
    assert usage[:4] == [None] * 4
    assert usage[4] is not None and usage[4].price_version is None  # TOKENS: not priced
    assert usage[5] is not None and usage[5].price_version == PRICES.version
    assert (usage[5].model, usage[5].cache_read_tokens) == ("m", 1000)
    # A zero charge is an event without charges, as from the Governor.
    assert recorded.entries[3].charges == ()


async def test_event_ids_are_unique_uuid7() -> None:
    ledger = MemoryLedger()
    rec = Recorder(policy(), ledger)
    for i in range(50):
        await rec.meter("daily", i, WHO)
    ids = [e.id for e in ledger.entries]
    assert len(set(ids)) == 50
    assert {uuid.UUID(i).version for i in ids} == {7}
    assert ids == sorted(ids)


async def test_a_context_without_the_scope_is_not_charged() -> None:
    """A Recorder emits nothing for it (a tool wrapper's emit never fails the tool); a
    Governor's meter() raises, as mcp-budget-governor 0.1.0's did (a cost counted nowhere
    is a bug at the call site, not a silent zero)."""
    ledger = MemoryLedger()
    rec = Recorder(policy(), ledger, prices=PRICES)
    gov_ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=gov_ledger, prices=PRICES)
    no_tenant = Context(user="u_42", tool="search")
    with pytest.raises(MissingScopeError, match="does not carry tenant"):
        await gov.meter("daily", 5, no_tenant)
    assert await rec.meter("daily", 5, no_tenant) == 0
    assert await rec.meter_tokens("monthly", "m", input_tokens=9, output_tokens=9) == 0
    assert ledger.entries == [] and gov_ledger.entries == []


async def test_emit_is_a_one_shot_recorder() -> None:
    now = 1764442477.0
    a, b = MemoryLedger(), MemoryLedger()
    assert await emit(a, policy(), "spend", 250, WHO, clock=fixed(now)) == 250
    await Recorder(policy(), b, clock=fixed(now)).meter("spend", 250, WHO)
    assert [without_id(e) for e in a.entries] == [without_id(e) for e in b.entries]


async def test_recorder_closes_its_ledger() -> None:
    closed: list[bool] = []

    class Ledger(MemoryLedger):
        async def aclose(self) -> None:
            closed.append(True)

    async with Recorder(policy(), Ledger()) as rec:
        await rec.meter("spend", 1)
    assert closed == [True]


def test_recorder_rejects_what_is_not_a_policy_or_a_ledger() -> None:
    with pytest.raises(InvalidInputError, match="ledger"):
        Recorder(policy(), object())  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="policy"):
        Recorder([Limit("x", cap=1, window=Window.DAY)], MemoryLedger())  # type: ignore[arg-type]


# -- projection: emitted spend counts on the shared counters ----------------


async def test_projected_recorder_events_are_seen_and_trip_the_breaker(backend: Backend) -> None:
    now = time.time()
    ledger = MemoryLedger()
    rec = Recorder(policy(), ledger, prices=PRICES, clock=fixed(now))
    reader = Governor(policy(), backend, clock=fixed(now))

    await rec.meter("spend", usd("1.5"), Context(user="batch"))
    tokens_cost = await rec.meter_tokens(
        "spend", "m", input_tokens=100_000, output_tokens=20_000, ctx=Context(user="worker")
    )
    await rec.meter("daily", 12, WHO)
    await rec.meter("daily", 30, WHO)
    assert tokens_cost == usd("0.6")
    total = usd("1.5") + tokens_cost

    # Emit-only: nothing reaches the counters before the projection does.
    assert await reader.usage("spend") == 0
    assert (await reader.check(Context(user="early"))).admitted

    assert await ledger.project(backend) == 4
    assert await reader.usage("spend") == total
    assert await reader.usage("daily", WHO) == 42
    key = ledger.entries[0].charges[0].key
    state = await backend.state(key)
    assert (state.committed, state.in_flight, state.pending) == (total, 0, {})

    # Spend is past the breaker's cap: the next caller is shed, whoever it is.
    decision = await reader.check(Context(user="next"))
    assert (decision.admitted, decision.status, decision.limit) == (False, 503, "spend")

    # Projecting again changes nothing.
    assert await ledger.project(backend) == 0
    assert await reader.usage("spend") == total


# -- validation: the Governor's errors, nothing appended --------------------

Call = Callable[[Meterer], Awaitable[int]]

INVALID: dict[str, Call] = {
    "negative amount": lambda m: m.meter("spend", -1),
    "bool amount": lambda m: m.meter("spend", True),
    "float amount": lambda m: m.meter("spend", 1.5),  # type: ignore[arg-type]
    "amount too large": lambda m: m.meter("spend", MAX_AMOUNT + 1),
    "unknown limit": lambda m: m.meter("nope", 1),
    "unknown model": lambda m: m.meter_tokens("spend", "gpt-9", input_tokens=1, output_tokens=1),
    "unknown model, tokens limit": lambda m: m.meter_tokens(
        "nope", "m", input_tokens=1, output_tokens=1
    ),
    "negative tokens": lambda m: m.meter_tokens("spend", "m", input_tokens=-1, output_tokens=1),
    "cache above input": lambda m: m.meter_tokens(
        "spend", "m", input_tokens=10, output_tokens=1, cache_read_tokens=20
    ),
    "tokens on a CALLS limit": lambda m: m.meter_tokens(
        "burst", "m", input_tokens=1, output_tokens=1
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
@pytest.mark.parametrize("prices", [PRICES, None], ids=["prices", "no-prices"])
async def test_invalid_input_raises_like_the_governor(case: str, prices: PriceTable | None) -> None:
    call = INVALID[case]
    rec_ledger, gov_ledger = MemoryLedger(), MemoryLedger()
    rec = Recorder(policy(), rec_ledger, prices=prices)
    gov = Governor(policy(), MemoryBackend(), ledger=gov_ledger, prices=prices)
    with pytest.raises(GovernorError) as from_gov:
        await call(gov)
    with pytest.raises(GovernorError) as from_rec:
        await call(rec)
    assert type(from_rec.value) is type(from_gov.value)
    assert str(from_rec.value) == str(from_gov.value)
    assert rec_ledger.entries == gov_ledger.entries == []


async def test_the_specific_errors() -> None:
    rec = Recorder(policy(), MemoryLedger(), prices=PRICES)
    with pytest.raises(InvalidInputError, match="amount: must not be negative"):
        await rec.meter("spend", -1)
    with pytest.raises(PolicyError, match="no such limit"):
        await rec.meter("nope", 1)
    with pytest.raises(UnknownModelError):
        await rec.meter_tokens("spend", "gpt-9", input_tokens=1, output_tokens=1)
    with pytest.raises(GovernorError, match="needs a price table"):
        await Recorder(policy(), MemoryLedger()).meter_tokens(
            "spend", "m", input_tokens=1, output_tokens=1
        )


# -- @governed with a Governor ----------------------------------------------


def by_user(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Context:
    return Context(user=kwargs["user"])


async def test_governed_checks_runs_and_meters(backend: Backend) -> None:
    ledger = MemoryLedger()
    # One instant: "burst" is a minute's, and its count is read after the calls.
    gov = Governor(policy(), backend, ledger=ledger, clock=fixed(time.time()))
    ran: list[str] = []

    @governed(gov, limit="spend", cost=usd("0.25"), context=by_user)
    async def search(query: str, *, user: str) -> str:
        ran.append(query)
        return query.upper()

    assert await search("a", user="u1") == "A"
    assert await search("b", user="u1") == "B"
    with pytest.raises(LimitExceeded) as refused:
        await search("c", user="u1")  # burst: 2 a minute per user
    assert (refused.value.decision.status, refused.value.decision.limit) == (429, "burst")
    assert ran == ["a", "b"]  # the refused call never ran...
    assert await gov.usage("spend") == usd("0.5")  # ...and was not charged
    assert await gov.usage("burst", Context(user="u1")) == 2

    kinds = [e.type for e in ledger.entries]
    assert kinds == [
        EntryType.ADMITTED,
        EntryType.METERED,
        EntryType.ADMITTED,
        EntryType.METERED,
        EntryType.REJECTED,
    ]
    assert {e.context for e in ledger.entries} == {Context(user="u1", tool="search")}


async def test_cost_callable_receives_the_result_and_a_breaker_sheds_the_next_call(
    backend: Backend,
) -> None:
    gov = Governor(policy(), backend)
    seen: list[object] = []
    results: list[dict[str, int]] = []

    def cost_of(result: dict[str, int]) -> int:
        seen.append(result)
        return result["cost"]

    @governed(gov, limit="spend", cost=cost_of, context=by_user)
    async def model_call(cost: int, *, user: str) -> dict[str, int]:
        results.append({"cost": cost})
        return results[-1]

    await model_call(usd("1.5"), user="u1")
    await model_call(usd("1.5"), user="u2")  # crosses the cap: completes and is charged
    assert len(seen) == 2 and all(s is r for s, r in zip(seen, results, strict=True))
    assert await gov.usage("spend") == usd(3)
    with pytest.raises(LimitExceeded) as shed:
        await model_call(1, user="u3")
    assert (shed.value.decision.status, shed.value.decision.limit) == (503, "spend")
    assert len(results) == 2


async def test_a_governor_without_limit_only_checks() -> None:
    gov = Governor(policy(), MemoryBackend(), clock=fixed(time.time()))  # one minute's burst

    @governed(gov, context=Context(user="u1"))
    async def ping() -> str:
        return "pong"

    assert [await ping(), await ping()] == ["pong", "pong"]
    with pytest.raises(LimitExceeded):
        await ping()
    assert await gov.usage("spend") == 0


async def test_tool_name_defaults_to_the_function_name() -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), MemoryBackend(), ledger=ledger)

    @governed(gov, limit="daily", cost=1, context=Context(tenant="acme"))
    async def fetch() -> None:
        return None

    @governed(gov, limit="daily", cost=1, context=Context(tenant="acme"), tool="web_fetch")
    async def fetch2() -> None:
        return None

    @governed(gov, limit="daily", cost=1, context=Context(tenant="acme", tool="from_ctx"))
    async def fetch3() -> None:
        return None

    for fn in (fetch, fetch2, fetch3):
        await fn()
    tools = [e.context.tool for e in ledger.entries if e.type is EntryType.METERED]
    assert tools == ["fetch", "web_fetch", "from_ctx"]
    # The tool feeds tool-scoped limits: a (tenant, tool) counter each.
    for tool in tools:
        assert await gov.usage("daily", Context(tenant="acme", tool=tool)) == 1


async def test_a_failing_call_keeps_its_admission_and_pays_a_fixed_cost_only() -> None:
    gov = Governor(policy(), MemoryBackend(), clock=fixed(time.time()))  # burst read later

    @governed(gov, limit="spend", cost=100, context=Context(user="u1"))
    async def fixed_cost() -> int:
        raise RuntimeError("tool failed")

    @governed(gov, limit="spend", cost=lambda r: 10**6, context=Context(user="u2"))
    async def priced_by_result() -> int:
        raise RuntimeError("tool failed")

    with pytest.raises(RuntimeError, match="tool failed"):
        await fixed_cost()
    assert await gov.usage("spend") == 100  # a fixed cost is charged anyway
    with pytest.raises(RuntimeError, match="tool failed"):
        await priced_by_result()
    assert await gov.usage("spend") == 100  # no result, nothing to price
    # The admissions stand: failing calls use the call quota.
    assert await gov.usage("burst", Context(user="u1")) == 1
    assert await gov.usage("burst", Context(user="u2")) == 1


def blocking(gov: Governor, started: asyncio.Event) -> Callable[[], Awaitable[None]]:
    """A governed tool with a fixed price that starts, then waits until cancelled."""

    @governed(gov, limit="spend", cost=100, context=Context(user="u1"))
    async def slow() -> None:
        started.set()
        await asyncio.Event().wait()

    return slow


async def cancel_once_started(gov: Governor) -> asyncio.Task[Any]:
    """The slow governed call, cancelled once it has started; its CancelledError raised."""
    started = asyncio.Event()
    task = asyncio.create_task(blocking(gov, started)())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return task


async def test_a_cancelled_call_pays_its_fixed_price(backend: Backend) -> None:
    # One instant for check and read: the burst counter is a minute bucket, and a run
    # that crossed a minute boundary read the next minute's (empty) counter.
    now = time.time()
    gov = Governor(policy(), backend, clock=lambda: now)
    task = await cancel_once_started(gov)
    assert task.cancelled()  # the cancellation propagated, after the charge
    assert await gov.usage("spend") == 100
    assert await gov.usage("burst", Context(user="u1")) == 1


async def test_a_timed_out_call_pays_and_still_times_out(backend: Backend) -> None:
    gov = Governor(policy(), backend)
    started = asyncio.Event()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await blocking(gov, started)()
    assert started.is_set()
    assert await gov.usage("spend") == 100


async def test_a_call_cancelled_by_an_anyio_scope_pays_to_the_end(backend: Backend) -> None:
    """As the MCP SDK cancels a request: an anyio scope, which cancels again at every
    await inside it. The charge (a Redis round trip) still completes, shielded."""
    import anyio

    gov = Governor(policy(), backend)
    started = asyncio.Event()
    with anyio.CancelScope() as scope:

        async def cancel_once_started() -> None:
            await started.wait()
            scope.cancel()

        watcher = asyncio.ensure_future(cancel_once_started())
        await blocking(gov, started)()
    await watcher
    assert scope.cancelled_caught
    assert await gov.usage("spend") == 100


async def test_a_cancelled_call_whose_charge_fails_is_still_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    edge = Policy.of(
        Limit("spend", cap=MAX_AMOUNT, window=Window.DAY, unit=Unit.USD_MICROS, gated=False)
    )
    gov = Governor(edge, MetersAfter())
    await gov.meter("spend", MAX_AMOUNT)  # no room left in the exact range
    await cancel_once_started(gov)
    assert "tool 'slow': charging the cancelled call failed" in caplog.text
    assert "CounterOverflowError" in caplog.text


async def test_a_price_that_would_leave_the_exact_range_refuses_before_the_call() -> None:
    edge = Policy.of(
        Limit("spend", cap=MAX_AMOUNT, window=Window.DAY, unit=Unit.USD_MICROS, gated=False)
    )
    gov = Governor(edge, MemoryBackend())  # the price charged with the admission
    await gov.meter("spend", MAX_AMOUNT)
    started = asyncio.Event()
    with pytest.raises(CounterOverflowError):
        await blocking(gov, started)()
    assert not started.is_set()  # the tool never ran: nothing to pay
    assert await gov.usage("spend") == MAX_AMOUNT


class MetersAfter(MemoryBackend):
    """A backend that cannot charge a price with the admission (as Postgres):
    the integrations meter the fixed price after the call, the path these tests hold."""

    prices_at_admission = False


class SlowCharges:
    """A backend whose charges take a while (as over a network): time to cancel again."""

    # No write-now path (RedisBackend.charge_sent): every charge, the fixed price
    # included, goes through the slow, awaited charge() below, after the call
    # (not with the admission, whose cancellation other tests hold).
    charge_sent = None
    prices_at_admission = False

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.charging = asyncio.Event()

    async def charge(self, ops: Any, **kw: Any) -> Any:
        if any(op.amount > 1 for op in ops):  # the fixed price, not the admission
            self.charging.set()
            await asyncio.sleep(0.05)
        return await self.inner.charge(ops, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_second_cancellation_during_the_charge_does_not_abandon_it(
    backend: Backend,
) -> None:
    slow = SlowCharges(backend)
    gov = Governor(policy(), cast(Backend, slow))
    started = asyncio.Event()
    task = asyncio.create_task(blocking(gov, started)())
    await started.wait()
    task.cancel()
    await asyncio.wait_for(slow.charging.wait(), 30)
    task.cancel()  # again, while the fixed price is being charged
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await gov.usage("spend") == 100


async def test_a_bad_cost_from_the_callable_is_logged_and_the_result_returned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gov = Governor(policy(), MemoryBackend())

    @governed(gov, limit="spend", cost=lambda r: r)
    async def returns(value: object) -> object:
        return value

    def broken(result: object) -> int:
        raise KeyError("usage")

    @governed(gov, limit="spend", cost=broken, tool="lookup")
    async def raises_in_cost() -> str:
        return "found"

    for bad in (-5, 0.5, True, 2**53):
        assert await returns(bad) == bad
    assert caplog.text.count("tool 'returns': its cost callback failed") == 4
    assert "amount for 'spend'" in caplog.text
    assert await raises_in_cost() == "found"
    assert "tool 'lookup': its cost callback failed" in caplog.text and "'usage'" in caplog.text
    assert await gov.usage("spend") == 0  # no fixed price: the admission only
    assert await returns(7) == 7
    assert await gov.usage("spend") == 7


async def test_the_wrapper_keeps_the_signature_and_name() -> None:
    gov = Governor(policy(), MemoryBackend())

    async def tool(query: str, limit: int = 10) -> list[str]:
        """Search."""
        return [query] * limit

    wrapped = governed(gov)(tool)
    assert wrapped.__name__ == "tool" and wrapped.__doc__ == "Search."
    assert inspect.signature(wrapped) == inspect.signature(tool)
    assert inspect.iscoroutinefunction(wrapped)
    assert await wrapped("q", limit=2) == ["q", "q"]


async def test_async_callable_objects_are_accepted() -> None:
    gov = Governor(policy(), MemoryBackend())

    class Tool:
        async def __call__(self, x: int) -> int:
            return x + 1

    assert await governed(gov, limit="spend", cost=1)(Tool())(1) == 2
    assert await gov.usage("spend") == 1


# -- @governed with a Recorder ----------------------------------------------


async def test_governed_with_a_recorder_only_emits_metered_events() -> None:
    now = 1764442477.0
    ledger = MemoryLedger()
    rec = Recorder(policy(), ledger, clock=fixed(now))
    ran = 0

    @governed(rec, limit="spend", cost=len, context=by_user)
    async def export(*, user: str) -> str:
        nonlocal ran
        ran += 1
        return "x" * ran

    # burst would refuse a Governor's third call: a Recorder never checks.
    for _ in range(4):
        await export(user="u1")
    assert ran == 4
    assert [e.type for e in ledger.entries] == [EntryType.METERED] * 4
    assert [e.charges[0].amount for e in ledger.entries] == [1, 2, 3, 4]
    assert {e.context for e in ledger.entries} == {Context(user="u1", tool="export")}
    s = planning.slot(policy()["spend"], Context(user="u1"), now, policy().tz, 1, enforce=False)
    assert s is not None and {e.charges[0].key for e in ledger.entries} == {s.key}


# -- misuse fails when decorating ------------------------------------------


def test_sync_functions_are_refused_when_decorated() -> None:
    gov = Governor(policy(), MemoryBackend())

    def sync_tool() -> int:
        return 1

    with pytest.raises(TypeError, match=r"async functions only.*sync_tool"):
        governed(gov)(sync_tool)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cost": 1}, TypeError, "limit= and cost= together"),
        ({"limit": "spend"}, TypeError, "limit= and cost= together"),
        ({"limit": "nope", "cost": 1}, PolicyError, "no such limit"),
        ({"limit": "spend", "cost": -1}, InvalidInputError, "cost: must not be negative"),
        ({"limit": "spend", "cost": 1.5}, InvalidInputError, "cost: expected an integer"),
        ({"context": {"user": "u"}}, TypeError, "context= must be"),
        ({"tool": 42}, InvalidInputError, "Context.tool: expected a string"),
    ],
)
def test_misuse_fails_when_decorating(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    gov = Governor(policy(), MemoryBackend())
    with pytest.raises(error, match=match):
        governed(gov, **kwargs)


def test_a_recorder_needs_a_limit_and_a_governor_is_required() -> None:
    with pytest.raises(TypeError, match="Recorder only meters"):
        governed(Recorder(policy(), MemoryLedger()))
    with pytest.raises(TypeError, match="Governor or a Recorder"):
        governed(MemoryBackend())  # type: ignore[arg-type]


async def test_a_context_callable_must_return_a_context() -> None:
    gov = Governor(policy(), MemoryBackend())
    ran = False

    @governed(gov, context=lambda args, kwargs: {"user": "u"})  # type: ignore[arg-type,return-value]
    async def tool() -> None:
        nonlocal ran
        ran = True

    with pytest.raises(TypeError, match="returned dict, not a Context"):
        await tool()
    assert not ran
