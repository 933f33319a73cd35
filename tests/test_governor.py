"""The governor's semantics, run on MemoryBackend and on a real Redis alike."""

from __future__ import annotations

import itertools
import time

import pytest

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    LimitExceeded,
    NoPriceTableError,
    OnExceed,
    Policy,
    PolicyError,
    PriceTable,
    Scope,
    Unit,
    UnknownModelError,
    Window,
    usd,
)
from mcp_budget_governor.keys import counter_key

U42 = Context(user="u_42", tenant="acme", tool="search", session="s1", agent="a1")


def gov_of(backend: Backend, *limits: Limit, **kw: object) -> Governor:
    return Governor(Policy.of(*limits), backend, **kw)  # type: ignore[arg-type]


async def test_admits_up_to_cap_then_refuses_with_429(backend: Backend) -> None:
    # One instant (Redis expires keys on its own clock: near it): one minute's bucket.
    now = time.time()
    burst = Limit("burst", cap=3, window=Window.MINUTE, scope=Scope.USER)
    gov = gov_of(backend, burst, clock=lambda: now)
    results = [await gov.check(U42) for _ in range(5)]
    assert [d.admitted for d in results] == [True, True, True, False, False]
    refusal = results[3]
    assert refusal.status == 429
    assert refusal.limit == "burst"
    assert refusal.reason == "budget_exceeded:user/minute"
    assert refusal.retry_after is not None and 1 <= refusal.retry_after <= 60
    assert refusal.headers == {"Retry-After": str(refusal.retry_after)}
    assert await gov.usage("burst", U42) == 3
    with pytest.raises(LimitExceeded) as info:
        refusal.raise_for_status()
    assert info.value.decision is refusal
    assert results[0].raise_for_status() is results[0]


async def test_scopes_count_separately_and_missing_scope_is_skipped(backend: Backend) -> None:
    gov = gov_of(
        backend,
        Limit("per_user_tool", cap=1, window=Window.DAY, scope=(Scope.TOOL, Scope.USER)),
        Limit("per_tenant", cap=100, window=Window.DAY, scope=Scope.TENANT),
    )
    assert (await gov.check(Context(user="a", tool="x"))).admitted
    assert (await gov.check(Context(user="a", tool="y"))).admitted
    assert (await gov.check(Context(user="b", tool="x"))).admitted
    assert not (await gov.check(Context(user="a", tool="x"))).admitted
    # No user: the per-user-tool limit does not apply; no tenant: neither does per_tenant.
    for _ in range(3):
        assert (await gov.check(Context(tool="x"))).admitted
    assert await gov.usage("per_user_tool", Context(user="a", tool="x")) == 1
    with pytest.raises(InvalidInputError, match="does not carry tenant"):
        await gov.usage("per_tenant", Context(user="a"))


@pytest.mark.parametrize("position", [0, 1, 2])
async def test_refusal_charges_nothing_wherever_the_refusing_limit_stands(
    backend: Backend, position: int
) -> None:
    limits = [
        Limit("day", cap=1000, window=Window.DAY, scope=Scope.USER),
        Limit("hour", cap=1000, window=Window.HOUR, scope=Scope.USER),
        Limit("month", cap=1000, window=Window.MONTH, scope=Scope.USER),
    ]
    tight = limits[position]
    limits[position] = Limit(tight.name, cap=2, window=tight.window, scope=Scope.USER)
    now = time.time()
    gov = gov_of(backend, *limits, clock=lambda: now)  # one instant: one "hour" bucket
    for _ in range(2):
        assert (await gov.check(U42)).admitted
    before = {lim.name: await gov.usage(lim.name, U42) for lim in limits}
    for _ in range(5):
        d = await gov.check(U42)
        assert not d.admitted and d.limit == tight.name
    after = {lim.name: await gov.usage(lim.name, U42) for lim in limits}
    assert before == after == {"day": 2, "hour": 2, "month": 2}


async def test_spend_limit_refuses_with_402_and_no_retry_after(backend: Backend) -> None:
    gov = gov_of(
        backend,
        Limit("spend", cap=usd(1), window=Window.DAY, scope=Scope.USER, unit=Unit.USD_MICROS),
    )
    assert (await gov.check(U42)).admitted  # a spend limit reads at check, charges nothing
    assert await gov.usage("spend", U42) == 0
    assert (await gov.meter("spend", usd(0.6), U42)).charged == usd(0.6)
    assert (await gov.check(U42)).admitted
    await gov.meter("spend", usd(0.6), U42)  # completed call: charged past the cap
    assert await gov.usage("spend", U42) == usd(1.2)
    d = await gov.check(U42)
    assert (d.admitted, d.status, d.retry_after) == (False, 402, None)
    assert d.resets_at is not None and d.resets_at.timestamp() > time.time()
    assert d.headers == {}


async def test_breaker_sheds_next_caller_after_completed_call_crosses_cap(backend: Backend) -> None:
    gov = gov_of(
        backend,
        Limit("calls", cap=100, window=Window.DAY, scope=Scope.USER),
        Limit(
            "global_spend",
            cap=usd(1),
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            breaker=True,
            gated=False,
        ),
    )
    assert (await gov.check(U42)).admitted
    await gov.meter("global_spend", usd(0.99))
    assert (await gov.check(Context(user="other"))).admitted
    await gov.meter("global_spend", usd(0.5))  # the call that crosses the line completes
    assert await gov.usage("global_spend") == usd(1.49)
    for who in ("u_42", "other", "third"):
        d = await gov.check(Context(user=who))
        assert (d.admitted, d.status, d.limit) == (False, 503, "global_spend")
        assert d.retry_after is not None and d.retry_after >= 1
    # shed calls were not charged to the per-user limit either
    assert await gov.usage("calls", Context(user="third")) == 0


async def test_status_override(backend: Backend) -> None:
    gov = gov_of(backend, Limit("q", cap=0, window=Window.DAY, status=403))
    assert (await gov.check()).status == 403


async def test_shadow_mode_admits_and_reports(backend: Backend) -> None:
    gov = gov_of(
        backend,
        Limit("new_cap", cap=2, window=Window.DAY, scope=Scope.USER, on_exceed=OnExceed.ALERT),
        Limit("real", cap=10, window=Window.DAY, scope=Scope.USER),
    )
    decisions = [await gov.check(U42) for _ in range(4)]
    assert all(d.admitted for d in decisions)
    assert [d.over for d in decisions] == [(), (), ("new_cap",), ("new_cap",)]
    assert await gov.usage("new_cap", U42) == 4  # counted, never refusing


async def test_meter_validates_amounts_and_limit_names(backend: Backend) -> None:
    gov = gov_of(backend, Limit("spend", cap=10, window=Window.DAY, unit=Unit.USD_MICROS))
    for bad in (-1, 1.5, True, "3", 2**53):
        with pytest.raises(InvalidInputError) as info:
            await gov.meter("spend", bad)  # type: ignore[arg-type]
        assert info.value.field == "amount" and info.value.value == bad
    with pytest.raises(PolicyError, match="no such limit"):
        await gov.meter("nope", 1)
    assert await gov.usage("spend") == 0


async def test_meter_tokens_prices_and_counts(backend: Backend) -> None:
    prices = PriceTable().with_price("m", 3, 15, cache_read_per_mtok="0.3")
    gov = gov_of(
        backend,
        Limit("spend", cap=usd(10), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
        Limit("tokens", cap=10**9, window=Window.DAY, unit=Unit.TOKENS, gated=False),
        Limit("calls", cap=10, window=Window.DAY),
        prices=prices,
    )
    cost = (await gov.meter_tokens("spend", "m", input_tokens=3_200, output_tokens=850)).charged
    assert cost == 3_200 * 3 + 850 * 15 == await gov.usage("spend")
    cached = await gov.meter_tokens(
        "spend", "m", input_tokens=1_000, output_tokens=0, cache_read_tokens=1_000
    )
    assert cached.charged == 300  # cache reads at their own price, not also at the input price
    assert (await gov.meter_tokens("tokens", "m", input_tokens=10, output_tokens=5)).charged == 15
    with pytest.raises(UnknownModelError, match="gpt-typo"):
        await gov.meter_tokens("spend", "gpt-typo", input_tokens=1, output_tokens=1)
    with pytest.raises(InvalidInputError, match="CALLS"):
        await gov.meter_tokens("calls", "m", input_tokens=1, output_tokens=1)
    with pytest.raises(InvalidInputError, match="output_tokens"):
        await gov.meter_tokens("spend", "m", input_tokens=1, output_tokens=-1)
    with pytest.raises(UnknownModelError):  # the model first, then the CALLS unit
        await gov.meter_tokens("calls", "gpt-typo", input_tokens=1, output_tokens=1)
    no_prices = gov_of(
        backend,
        Limit("s", cap=1, window=Window.DAY, unit=Unit.USD_MICROS),
        Limit("c", cap=1, window=Window.DAY),
        Limit("t", cap=9, window=Window.DAY, unit=Unit.TOKENS, gated=False),
    )
    for name in ("s", "c"):  # a RuntimeError, as in mcp-budget-governor 0.1.0
        with pytest.raises(NoPriceTableError, match="price table"):
            await no_prices.meter_tokens(name, "m", input_tokens=1, output_tokens=1)
    assert issubclass(NoPriceTableError, RuntimeError)
    # Counting tokens needs no price.
    assert (await no_prices.meter_tokens("t", "m", input_tokens=1, output_tokens=1)).charged == 2


async def test_reserve_settle_release(backend: Backend) -> None:
    gov = gov_of(
        backend, Limit("spend", cap=usd(1), window=Window.DAY, unit=Unit.USD_MICROS, gated=False)
    )
    async with gov.reserved("spend", usd(0.4), U42) as r:
        assert await gov.usage("spend") == usd(0.4)
        r.actual = usd(0.1)
    assert await gov.usage("spend") == usd(0.1)
    # a reservation that does not fit is refused and charges nothing
    async with gov.reserved("spend", usd(0.8)):
        with pytest.raises(LimitExceeded) as info:
            async with gov.reserved("spend", usd(0.2)):
                pytest.fail("entered a reservation past the cap")
        assert info.value.decision.status == 402
        assert await gov.usage("spend") == usd(0.9)
    assert await gov.usage("spend") == usd(0.9)  # actual unset: the estimate stands
    async with gov.reserved("spend", usd(0.05)) as r:
        r.release()
    assert await gov.usage("spend") == usd(0.9)
    # settling past the estimate is always recorded, even beyond the cap
    async with gov.reserved("spend", usd(0.05)) as r:
        r.actual = usd(0.5)
    assert await gov.usage("spend") == usd(1.4)
    with pytest.raises(InvalidInputError, match="estimate"):
        gov.reserved("spend", -5)


async def test_reservation_estimate_stands_when_work_raises(backend: Backend) -> None:
    gov = gov_of(backend, Limit("spend", cap=100, window=Window.DAY, unit=Unit.USD_MICROS))
    with pytest.raises(RuntimeError):
        async with gov.reserved("spend", 30):
            raise RuntimeError("model call failed midway")
    assert await gov.usage("spend") == 30


async def test_session_window_counts_per_session(backend: Backend) -> None:
    gov = gov_of(backend, Limit("per_session", cap=2, window=Window.SESSION))
    ctx_a, ctx_b = Context(session="a"), Context(session="b")
    assert [(await gov.check(ctx_a)).admitted for _ in range(3)] == [True, True, False]
    assert (await gov.check(ctx_b)).admitted
    refusal = await gov.check(ctx_a)
    assert refusal.retry_after is None and refusal.resets_at is None
    assert (await gov.check(Context())).admitted  # no session: not applicable


async def test_next_window_is_a_fresh_counter(backend: Backend) -> None:
    # Real time: Redis expires keys on its own clock, so the governor's must be close to it.
    now = [time.time()]
    gov = gov_of(
        backend, Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER), clock=lambda: now[0]
    )
    base = now[0] - now[0] % 60 + 1
    now[0] = base
    assert [(await gov.check(U42)).admitted for _ in range(3)] == [True, True, False]
    assert (await gov.check(U42)).retry_after == 59
    now[0] = base + 60
    assert (await gov.check(U42)).admitted
    assert await gov.usage("burst", U42) == 1


def test_keys_for_distinct_contexts_differ() -> None:
    from mcp_budget_governor.keys import escape, scope_segment

    a = scope_segment((Scope.TENANT, Scope.USER), ("a,user=b", "c"))
    b = scope_segment((Scope.TENANT, Scope.USER), ("a", "b,user=c"))
    assert a != b
    assert counter_key("l", a, "x") != counter_key("l", b, "x")
    assert escape("{x}") == "%7Bx%7D"


async def test_empty_policy_admits_everything(backend: Backend) -> None:
    gov = gov_of(backend)
    assert all([(await gov.check(U42)).admitted for _ in range(3)])
    assert list(itertools.islice(gov.policy, 1)) == []
