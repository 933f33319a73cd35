"""Code written against mcp-budget-governor 0.1.0 (the reference package) runs on ours.

``reference_readme_script`` uses only the reference's documented public API (its
README and its ``__all__``), in its README's own style, and runs on both
backends. Every other test pins one difference that the README section
"Migrating from mcp-budget-governor 0.1.0" lists, in the same order, so a
change that silently breaks a migrating user, or makes that section wrong,
fails here.
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import redis.asyncio as aioredis

import mcp_budget_governor
from mcp_budget_governor import (
    BUILTIN_AS_OF,
    AccumulateResult,
    Backend,
    BackendUnavailable,
    BudgetExceeded,
    BudgetGovernorError,
    ConsumeResult,
    Context,
    Decision,
    FailMode,
    Governor,
    Limit,
    LimitExceeded,
    MemoryBackend,
    MeterResult,
    ModelPrice,
    Policy,
    PriceTable,
    RedisBackend,
    Reservation,
    Scope,
    Unit,
    UnknownModel,
    Window,
    __version__,
    usd,
)
from mcp_budget_governor.errors import (
    BudgetUnavailable,
    InvalidInputError,
    MissingScopeError,
    PolicyError,
)
from mcp_budget_governor.pricing import MicroPrice
from testing.buckets import room
from testing.services import free_port

# The reference package's __all__ (0.1.0), plus RedisBackend, which it exposes lazily.
REFERENCE_ALL = (
    "BUILTIN_AS_OF",
    "AccumulateResult",
    "Backend",
    "BackendUnavailable",
    "BudgetExceeded",
    "BudgetGovernorError",
    "ConsumeResult",
    "Context",
    "Decision",
    "FailMode",
    "Governor",
    "Limit",
    "LimitExceeded",
    "MemoryBackend",
    "MeterResult",
    "ModelPrice",
    "Policy",
    "PriceTable",
    "Reservation",
    "Scope",
    "Unit",
    "UnknownModel",
    "Window",
    "__version__",
    "usd",
    "RedisBackend",
)


def http_answer(exc: Any) -> tuple[int, str, int]:
    """What a web handler written for the reference renders from a refusal."""
    return exc.status_code, exc.limit_name, exc.retry_after


async def reference_readme_script(backend: Any) -> None:
    """The reference README's examples and public API, with nothing of ours in it.

    Amounts stay clear of "exactly at the cap", where the two packages
    deliberately differ (see test_a_limit_is_exhausted_once_its_total_reaches_the_cap).
    """
    policy = Policy.of(
        Limit("per_user_calls", cap=5, window=Window.DAY, scope=Scope.USER),
        Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER, fail_mode=FailMode.OPEN),
        Limit(
            "global_spend",
            cap=usd(1),
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            breaker=True,
            gated=False,
        ),
    )
    prices = PriceTable.builtin().with_price("claude-opus-5", 4, 20)
    governor = Governor(policy, backend, prices=prices)
    ctx = Context(user="u_42")

    # admit or reject
    (await governor.check(Context(user="u_42"))).raise_for_status()
    decision = await governor.check(ctx, amount=3)
    assert decision.allowed
    assert decision.remaining["per_user_calls"] == 1
    assert decision.remaining["burst"] == 26

    # one call left: a call counting as two is refused whole, and charges nothing
    decision = await governor.check(ctx, amount=2)
    assert not decision.allowed
    assert decision.retry_after > 0
    try:
        decision.raise_for_status()
    except LimitExceeded as exc:  # 429: you are over your share
        answer = http_answer(exc)
    assert answer == (429, "per_user_calls", decision.retry_after)
    (await governor.check(ctx)).raise_for_status()  # the last call still fits
    try:
        (await governor.check(ctx)).raise_for_status()
    except BudgetGovernorError:
        pass
    else:
        raise AssertionError("the quota is spent")

    # charge what it cost: metered, always recorded
    result = await governor.meter("global_spend", usd(0.25))
    assert isinstance(result, MeterResult)
    assert (result.within, result.total, result.crossed) == (True, usd(0.25), False)
    result = await governor.meter_tokens(
        "global_spend",
        "claude-opus-5",  # charge what it cost
        input_tokens=3_200,
        output_tokens=850,
    )
    assert result.total == usd(0.25) + 3_200 * 4 + 850 * 20
    try:
        await governor.meter_tokens("global_spend", "gpt-typo", input_tokens=1, output_tokens=1)
    except UnknownModel:
        pass
    else:
        raise AssertionError("an unknown model raises instead of pricing at zero")

    # reserve and settle
    async with governor.reserved("global_spend", usd(0.05), ctx) as r:
        r.actual = usd(0.02)  # settles to the real number on exit
    spent = usd(0.25) + 29_800 + usd(0.02)
    assert (await governor.status())["global_spend"]["total"] == spent

    reservation = await governor.reserve("global_spend", usd(0.10), ctx)
    assert isinstance(reservation, Reservation)
    assert (reservation.limit_name, reservation.amount, reservation.context) == (
        "global_spend",
        usd(0.10),
        ctx,
    )
    assert not reservation.settled
    assert not await governor.is_tripped("global_spend")
    settled = await governor.settle(reservation, usd(0.80))
    assert (settled.within, settled.total, settled.crossed) == (False, spent + usd(0.80), True)
    assert reservation.settled
    again = await governor.settle(reservation, usd(0.80))  # settling twice is a no-op
    assert again == MeterResult(within=True, total=0, crossed=False)

    # the ceiling is crossed: shed expensive work at the edge
    assert await governor.is_tripped("global_spend")
    try:
        await governor.reserve("global_spend", usd(0.01), ctx)
    except BudgetExceeded as exc:  # 503: the service is shedding load
        answer = http_answer(exc)
    assert answer[:2] == (503, "global_spend")

    usage = await governor.status(ctx)
    assert set(usage) == {"per_user_calls", "burst", "global_spend"}
    assert usage["global_spend"]["exceeded"] is True
    assert usage["global_spend"]["remaining"] == 0
    assert usage["global_spend"]["cap"] == usd(1)
    assert usage["per_user_calls"]["total"] == 5
    assert usage["per_user_calls"]["remaining"] == 0
    assert usage["burst"]["resets_in"] <= 60

    await governor.close()


async def test_a_script_written_for_the_reference_package_runs_unchanged(
    backend: Backend,
) -> None:
    await room(60, needed=10)  # the script reads "burst" (a minute's) remaining after 4 calls
    await reference_readme_script(backend)


def test_every_public_name_of_the_reference_package_is_importable() -> None:
    missing = [name for name in REFERENCE_ALL if not hasattr(mcp_budget_governor, name)]
    assert missing == []
    assert set(REFERENCE_ALL) - {"RedisBackend"} <= set(mcp_budget_governor.__all__)
    assert isinstance(__version__, str) and __version__[0].isdigit()
    from mcp_budget_governor.backends import base, memory, redis
    from mcp_budget_governor.pricing import BUILTIN_AS_OF as as_of

    # The reference's module paths name our classes, never a copy.
    assert memory.MemoryBackend is MemoryBackend and redis.RedisBackend is RedisBackend
    assert (base.ConsumeResult, base.AccumulateResult) == (ConsumeResult, AccumulateResult)
    assert as_of == BUILTIN_AS_OF
    assert issubclass(RedisBackend, object) and isinstance(MemoryBackend(), Backend)
    assert Decision(admitted=True).allowed and not Decision(admitted=False).allowed


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    assert (
        mcp_budget_governor.__version__ == version(mcp_budget_governor.DISTRIBUTION) != "0+unknown"
    )


async def test_close_is_aclose(backend: Backend) -> None:
    closed: list[str] = []

    class Watching(MemoryBackend):
        async def aclose(self) -> None:
            closed.append("backend")

    gov = Governor(Policy.of(Limit("calls", cap=1, window=Window.DAY)), Watching())
    await gov.close()
    assert closed == ["backend"]
    assert isinstance(Governor(Policy.of(Limit("calls", cap=1, window=Window.DAY))).backend,
                      MemoryBackend)  # fmt: skip


# -- The differences, in the order the README's migration section lists them --


def quota_and_breaker(backend: Backend) -> Governor:
    return Governor(
        Policy.of(
            Limit("per_user_calls", cap=1, window=Window.DAY, scope=Scope.USER),
            Limit(
                "user_spend", cap=usd(1), window=Window.DAY, scope=Scope.USER, unit=Unit.USD_MICROS
            ),
            Limit(
                "global_spend",
                cap=usd(5),
                window=Window.DAY,
                unit=Unit.USD_MICROS,
                breaker=True,
                gated=False,
            ),
        ),
        backend,
    )


async def test_except_limit_exceeded_catches_every_refusal_budget_exceeded_the_breakers(
    backend: Backend,
) -> None:
    """1. The reference's hierarchy: BudgetExceeded (a breaker, 503) is a LimitExceeded,
    the base of every refusal; a quota refusal is not a BudgetExceeded."""
    assert issubclass(BudgetExceeded, LimitExceeded)
    assert not issubclass(LimitExceeded, BudgetExceeded)
    assert issubclass(BudgetUnavailable, LimitExceeded)
    assert not issubclass(BudgetUnavailable, BudgetExceeded)
    gov = quota_and_breaker(backend)
    u1, u2 = Context(user="u1"), Context(user="u2")
    assert (await gov.check(u1)).allowed
    refusals: list[LimitExceeded] = []
    with pytest.raises(LimitExceeded) as quota:
        (await gov.check(u1)).raise_for_status()
    refusals.append(quota.value)
    assert type(quota.value) is LimitExceeded and quota.value.status_code == 429
    with pytest.raises(LimitExceeded) as unnamed:  # a per-user limit, nobody named: 403
        await gov.identified(Context(tool="search"))
    refusals.append(unnamed.value)
    assert unnamed.value.status_code == 403

    await gov.meter("global_spend", usd(5))
    with pytest.raises(BudgetExceeded) as breaker:
        (await gov.check(u2)).raise_for_status()
    refusals.append(breaker.value)
    assert type(breaker.value) is BudgetExceeded and breaker.value.status_code == 503
    with pytest.raises(BudgetExceeded) as reserve:
        await gov.reserve("global_spend", 1, u2)
    refusals.append(reserve.value)
    assert type(reserve.value) is BudgetExceeded
    # Whichever raise site builds the refusal, the decision picks the class.
    assert type(LimitExceeded(quota.value.decision)) is LimitExceeded
    assert type(LimitExceeded(breaker.value.decision)) is BudgetExceeded

    def answer(exc: Exception) -> str:
        # A handler chain in the reference's order: the breaker first, then the rest.
        try:
            raise exc
        except BudgetExceeded:
            return "503 breaker"
        except LimitExceeded as other:
            return str(other.status_code)

    assert [answer(e) for e in refusals] == ["429", "403", "503 breaker", "503 breaker"]
    # The reference's constructors, and its problem documents (RFC 9457).
    by_hand = BudgetExceeded("global_spend", retry_after=30, total=6, cap=5)
    assert by_hand.status_code == 503 and by_hand.retry_after == 30
    detail = by_hand.to_problem_detail("/tools/x")
    assert detail["type"].endswith("budget-exceeded") and detail["cap"] == 5
    assert detail["instance"] == "/tools/x" and detail["status"] == 503
    assert LimitExceeded("calls", retry_after=1).to_problem_detail()["title"] == "Limit exceeded"


async def test_unreachable_fail_closed_counters_refuse_with_a_decision_not_an_exception() -> None:
    """2. check() returns a 503 decision; raise_for_status() raises a BackendUnavailable."""
    dead = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    gov = Governor(
        Policy.of(Limit("spend", cap=usd(5), window=Window.DAY, unit=Unit.USD_MICROS,
                        breaker=True, gated=False, fail_mode=FailMode.CLOSED)),
        dead,
    )  # fmt: skip
    decision = await gov.check(Context(user="u1"))
    assert not decision.allowed and decision.status == 503 and decision.degraded
    with pytest.raises(BackendUnavailable) as exc:
        decision.raise_for_status()
    assert isinstance(exc.value, LimitExceeded) and isinstance(exc.value, BudgetUnavailable)
    assert not isinstance(exc.value, BudgetExceeded)  # not the breaker's
    assert exc.value.limit_name == "spend" and exc.value.retry_after is not None
    # The read-only calls raise, as the reference's do for a fail-closed limit.
    with pytest.raises(BackendUnavailable):
        await gov.is_tripped("spend")
    with pytest.raises(BackendUnavailable):
        await gov.status()
    await gov.close()


async def test_budget_governor_error_is_also_the_base_of_input_errors(backend: Backend) -> None:
    """3. ``except BudgetGovernorError`` catches bad input too, not only refusals."""
    gov = quota_and_breaker(backend)
    with pytest.raises(BudgetGovernorError):
        await gov.meter("per_user_calls", -1, Context(user="u1"))
    assert issubclass(InvalidInputError, BudgetGovernorError)


async def test_unknown_limits_and_missing_scopes(backend: Backend) -> None:
    """4. An unknown limit raises PolicyError (a ValueError, and a KeyError); a context
    lacking the scope of the limit meter(), reserve(), is_tripped() or usage() names
    raises MissingScopeError (an InvalidInputError, and a KeyError); check() skips it."""
    gov = quota_and_breaker(backend)
    with pytest.raises(PolicyError, match="no such limit") as unknown:
        await gov.meter("nope", 1)
    assert isinstance(unknown.value, ValueError) and isinstance(unknown.value, KeyError)
    assert "no limit named 'nope'" in str(unknown.value)

    nobody = Context()
    gov.prices = PriceTable.of(m=(1, 1))
    for call in (
        gov.meter("user_spend", 100, nobody),
        gov.meter_tokens("user_spend", "m", input_tokens=1, ctx=nobody),
        gov.reserve("user_spend", 100, nobody),
        gov.is_tripped("user_spend", nobody),
        gov.usage("user_spend", nobody),
    ):
        with pytest.raises(MissingScopeError, match="does not carry user") as missing:
            await call
        assert isinstance(missing.value, KeyError) and isinstance(missing.value, ValueError)
    # Several names: charged where the context keys one, the others skipped.
    got = await gov.meter(("user_spend", "global_spend"), 100, nobody)
    assert (got.charged, got.limit) == (100, "global_spend")
    assert (await gov.check(nobody)).allowed
    assert await gov.status(nobody) == {
        "global_spend": {
            "total": 100, "cap": usd(5), "remaining": usd(5) - 100, "exceeded": False,
            "resets_in": (await gov.status(nobody))["global_spend"]["resets_in"],
        }
    }  # fmt: skip


async def test_unknown_model_is_a_lookup_error_not_a_key_error() -> None:
    """5. UnknownModel is our UnknownModelError: a LookupError, not a KeyError."""
    assert issubclass(UnknownModel, LookupError) and not issubclass(UnknownModel, KeyError)
    with pytest.raises(UnknownModel):
        PriceTable().cost_micros("gpt-typo", input_tokens=1, output_tokens=1)


async def test_decision_limit_is_a_name(backend: Backend) -> None:
    """6. Decision.limit is the limit's name; policy[name] gives the Limit."""
    gov = quota_and_breaker(backend)
    u1 = Context(user="u1")
    await gov.check(u1)
    refused = await gov.check(u1)
    assert refused.limit == "per_user_calls"
    assert gov.policy[refused.limit].cap == 1


async def test_retry_after_is_none_when_admitted_and_on_a_402(backend: Backend) -> None:
    """7. No retry_after on an admission nor on a spend refusal (402); resets_at says when."""
    gov = quota_and_breaker(backend)
    u1 = Context(user="u1")
    admitted = await gov.check(u1)
    assert admitted.allowed and admitted.retry_after is None
    u2 = Context(user="u2")
    await gov.meter("user_spend", usd(1), u2)
    spent = await gov.check(u2)
    assert (spent.status, spent.limit, spent.retry_after) == (402, "user_spend", None)
    assert spent.resets_at is not None and spent.resets_at > datetime.now(UTC)
    with pytest.raises(LimitExceeded) as exc:
        spent.raise_for_status()
    assert exc.value.status_code == 402 and exc.value.retry_after is None


async def test_remaining_covers_every_limit_check_reads(backend: Backend) -> None:
    """8. remaining includes the spend limits and breakers check() reads, and after a
    refusal every limit read (nothing was charged), not only those before the refusing one."""
    gov = quota_and_breaker(backend)
    u1 = Context(user="u1")
    await gov.meter(("user_spend", "global_spend"), usd(0.25), u1)
    admitted = await gov.check(u1)
    assert admitted.remaining == {
        "per_user_calls": 0,
        "user_spend": usd(0.75),
        "global_spend": usd(5) - usd(0.25),
    }
    refused = await gov.check(u1)
    assert refused.remaining == {
        "per_user_calls": 0,
        "user_spend": usd(0.75),
        "global_spend": usd(4.75),
    }


async def test_check_reads_a_gated_false_breaker(backend: Backend) -> None:
    """9. A tripped breaker sheds every check() with 503, even with gated=False
    (the reference's check() ignores it; only is_tripped() sees it)."""
    gov = quota_and_breaker(backend)
    await gov.meter("global_spend", usd(6))
    shed = await gov.check(Context(user="someone-new"))
    assert (shed.allowed, shed.status, shed.limit) == (False, 503, "global_spend")
    assert shed.retry_after is not None and shed.retry_after > 0


async def test_a_limit_is_exhausted_once_its_total_reaches_the_cap(backend: Backend) -> None:
    """10. At exactly the cap: within False, crossed True, is_tripped and exceeded True
    (the reference: only past the cap). A check there is refused in both."""
    gov = quota_and_breaker(backend)
    first = await gov.meter("global_spend", usd(2))
    assert (first.within, first.crossed) == (True, False)
    at_cap = await gov.meter("global_spend", usd(3))
    assert (at_cap.within, at_cap.total, at_cap.crossed) == (False, usd(5), True)
    past = await gov.meter("global_spend", 1)
    assert (past.within, past.crossed) == (False, False)  # crossed once per window
    assert await gov.is_tripped("global_spend")
    assert (await gov.status())["global_spend"]["exceeded"] is True


async def test_check_amount_counts_calls_and_reads_spend(backend: Backend) -> None:
    """11. check(amount=N) charges N on gated CALLS limits; gated spend and token limits
    are read, not charged N (reference: every gated limit is charged N)."""
    gov = Governor(
        Policy.of(
            Limit("calls", cap=10, window=Window.DAY),
            Limit("spend", cap=usd(1), window=Window.DAY, unit=Unit.USD_MICROS),
        ),
        backend,
    )
    decision = await gov.check(amount=4)
    assert decision.remaining == {"calls": 6, "spend": usd(1)}
    assert await gov.usage("calls") == 4 and await gov.usage("spend") == 0
    assert not (await gov.check(amount=7)).allowed
    for bad in (-1, "2", True, 2.0):
        with pytest.raises(InvalidInputError, match="amount"):
            await gov.check(amount=bad)  # type: ignore[arg-type]
    assert await gov.usage("calls") == 4


async def test_keys_moved_under_v1_so_counters_start_fresh(redis_url: str) -> None:
    """12. Counters live at mcpbg:v1:... (hashes); the reference's mcpbg:<limit>:... strings
    are never read, so a switch starts every counter at zero."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    today = time.strftime("%Y%m%d", time.gmtime())
    old_key = f"mcpbg:per_user_calls:user=u_42:{today}"
    await client.set(old_key, 2_000)  # the reference's counter, at its cap
    gov = Governor(
        Policy.of(Limit("per_user_calls", cap=2_000, window=Window.DAY, scope=Scope.USER)),
        RedisBackend.from_url(redis_url),
    )
    decision = await gov.check(Context(user="u_42"))
    assert decision.allowed and decision.remaining == {"per_user_calls": 1_999}
    # (mcpbg:v1:_... keys are the governor's own markers, not counters)
    keys = {k for k in await client.keys("mcpbg:*") if not k.startswith("mcpbg:v1:_")}
    assert keys == {old_key, f"mcpbg:v1:per_user_calls:user=u_42:{today}"}
    await gov.close()
    await client.aclose()


async def test_the_context_parameter_is_named_ctx(backend: Backend) -> None:
    """13. Positional contexts work as in the reference; the keyword is ctx=, not context=."""
    gov = quota_and_breaker(backend)
    u1 = Context(user="u1")
    assert (await gov.check(u1)).allowed
    assert (await gov.meter("user_spend", 5, ctx=u1)).charged == 5
    with pytest.raises(TypeError):
        await gov.check(context=u1)  # type: ignore[call-arg]


def test_scope_global_and_governor_options() -> None:
    """14. Scope.GLOBAL is leaving the scope out; Governor(local_fallback=False) turns off
    every limit's local counter; a clock may return an aware datetime."""
    assert Limit("spend", cap=1, window=Window.DAY).scope is Scope.GLOBAL
    assert Limit("s", cap=1, window=Window.DAY, scope=(Scope.GLOBAL, Scope.USER)).scopes == (
        Scope.USER,
    )
    assert Scope.GLOBAL not in list(Scope)
    policy = Policy.of(Limit("calls", cap=1, window=Window.DAY))
    gov = Governor(policy, local_fallback=False)
    assert gov.policy["calls"].local_fallback is False and policy["calls"].local_fallback
    memory = MemoryBackend()
    moment = datetime(2025, 11, 29, 18, 54, 37, tzinfo=UTC)
    gov = Governor(policy, memory, clock=lambda: moment)
    asyncio.run(gov.check())
    # The backend follows the governor's clock: the past day's counter is live.
    assert memory.keys() == ["mcpbg:v1:calls:global:20251129"]


async def test_integrations_refuse_an_unnamed_caller_when_a_limit_counts_per_user(
    backend: Backend,
) -> None:
    """15. The middlewares pass callers through Governor.identified: with a per-user limit,
    a caller without a user id is refused (403) unless Policy(anonymous="shared");
    check() itself still skips the limits the context cannot key. @governed takes the
    reference's identify=/cost_of=/meter_limit= as well as context=/cost=/limit=."""
    gov = quota_and_breaker(backend)
    with pytest.raises(LimitExceeded) as exc:
        await gov.identified(Context(tool="search"))
    assert exc.value.status_code == 403 and type(exc.value) is LimitExceeded
    assert (await gov.check(Context(tool="search"))).allowed

    from mcp_budget_governor.integrations.decorator import governed

    with pytest.raises(ValueError, match="together"):
        governed(gov, meter_limit="user_spend")

    @governed(
        gov, meter_limit="user_spend", cost_of=lambda r: None, identify=lambda u: Context(user=u)
    )
    async def free(user: str) -> str:
        return "nothing to pay"

    assert await free("u_8") == "nothing to pay"
    assert await gov.usage("user_spend", Context(user="u_8")) == 0  # None charges nothing

    @governed(gov, limit="user_spend", cost=len, context=lambda args, kwargs: Context(user=args[0]))
    async def search(user: str) -> str:
        return "four"

    assert await search("u_7") == "four"
    assert await gov.usage("user_spend", Context(user="u_7")) == 4


def test_model_prices_are_dollars_per_million_tokens() -> None:
    """16. ModelPrice takes USD per million tokens (the reference: micros);
    ModelPrice.from_dollars gives the reference's integer micros (MicroPrice), which a
    table takes as the same price; PriceTable.of/cost/price_for/prices as in the reference."""
    table = PriceTable({"m": ModelPrice(5, 25)})
    assert table.cost_micros("m", input_tokens=1_000_000, output_tokens=0) == usd(5)
    assert table.price_of("m").output_per_mtok == 25
    micro = ModelPrice.from_dollars(5, 25)
    assert (micro.input_per_mtok, micro.output_per_mtok) == (5_000_000, 25_000_000)
    assert micro == MicroPrice(5_000_000, 25_000_000) and micro.model_price() == ModelPrice(5, 25)
    assert PriceTable({"m": micro}).price_of("m") == ModelPrice(5, 25)
    assert ModelPrice.from_dollars("0.0000001", 1).input_per_mtok == 1  # rounded up, never down
    with pytest.raises(InvalidInputError, match="input_per_mtok"):
        MicroPrice(0.5, 1)  # type: ignore[arg-type]
    by_of = PriceTable.of(m=(5, 25))
    assert by_of.cost("m", output_tokens=1_000_000) == usd(25) and by_of.cost("m") == 0
    assert by_of.price_for("m") == table.price_of("m") and list(by_of.prices) == ["m"]


def test_builtin_as_of_is_the_date_of_the_builtin_prices() -> None:
    """17. BUILTIN_AS_OF is an ISO date (the day the builtin table took its prices for),
    also PriceTable.as_of; a table built by hand has none."""
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", BUILTIN_AS_OF)
    assert PriceTable.builtin().as_of == BUILTIN_AS_OF
    assert PriceTable.builtin().with_price("mine", 1, 2).as_of == BUILTIN_AS_OF
    assert PriceTable().as_of is None
    # An unknown model's error says which data lacks it, and its date.
    builtin = PriceTable.builtin()
    with pytest.raises(UnknownModel, match=f"{builtin.version} prices as of {BUILTIN_AS_OF}"):
        builtin.price_of("no-such-model")
    with pytest.raises(UnknownModel) as info:
        PriceTable().with_price("mine", 1, 2).price_of("no-such-model")
    assert "as of" not in str(info.value)


async def test_a_backend_written_to_the_reference_protocol_serves_our_governor() -> None:
    """18. A backend of the reference's protocol (consume/accumulate/release/peek/close) is
    adapted, not ours; ConsumeResult and AccumulateResult are the reference's results.
    500 concurrent checks against a cap of 50 admit exactly 50 on a dict of its own."""

    class DictBackend:
        def __init__(self) -> None:
            self.values: dict[str, int] = {}
            self.closed = False

        async def consume(self, key: str, amount: int, cap: int, ttl: int) -> ConsumeResult:
            await asyncio.sleep(0)  # a store's round trip: callers interleave here
            total = self.values.get(key, 0)
            if total + amount > cap:
                return ConsumeResult(allowed=False, total=total, remaining=max(cap - total, 0))
            self.values[key] = total + amount
            return ConsumeResult(allowed=True, total=total + amount, remaining=cap - total - amount)

        async def accumulate(self, key: str, amount: int, cap: int, ttl: int) -> AccumulateResult:
            before = self.values.get(key, 0)
            self.values[key] = before + amount
            total = before + amount
            return AccumulateResult(within=total <= cap, total=total, crossed=before <= cap < total)

        async def release(self, key: str, amount: int) -> None:
            if key in self.values:
                self.values[key] = max(self.values[key] - amount, 0)

        async def peek(self, key: str) -> int:
            return self.values.get(key, 0)

        async def close(self) -> None:
            self.closed = True

    mine = DictBackend()
    assert not isinstance(mine, Backend)
    gov = Governor(
        Policy.of(
            Limit("per_user", cap=1_000, window=Window.DAY, scope=Scope.USER),
            Limit("calls", cap=50, window=Window.DAY),
            Limit("spend", cap=usd(1), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
        ),
        mine,
    )
    decisions = await asyncio.gather(*(gov.check(Context(user=f"u{i % 7}")) for i in range(500)))
    assert sum(d.allowed for d in decisions) == 50
    (calls_key,) = [k for k in mine.values if ":calls:" in k]
    assert mine.values[calls_key] == 50
    # The refused checks gave back what they took on the per-user limit first.
    assert sum(v for k, v in mine.values.items() if ":per_user:" in k) == 50
    assert (await gov.meter("spend", usd(0.4))).total == usd(0.4)
    assert (await gov.status())["spend"]["total"] == usd(0.4)
    await gov.close()
    assert mine.closed


# -- status() is read only -----------------------------------------------------


async def test_status_and_is_tripped_write_nothing_and_append_nothing(backend: Backend) -> None:
    from mcp_budget_governor.producers.memory_ledger import MemoryLedger

    ledger = MemoryLedger()
    gov = Governor(quota_and_breaker(backend).policy, backend, ledger=ledger)
    u1 = Context(user="u1")
    await gov.meter("global_spend", usd(1), u1)
    await gov.check(u1)
    entries = list(ledger.entries)
    keys = await backend.counter_keys(100)
    states = [await backend.state(k) for k in keys]
    assert set(await gov.status(u1)) == {"per_user_calls", "user_spend", "global_spend"}
    assert not await gov.is_tripped("global_spend")
    assert (await gov.status(Context(user="u9")))["per_user_calls"]["total"] == 0
    assert ledger.entries == entries
    assert await backend.counter_keys(100) == keys
    assert [await backend.state(k) for k in keys] == states


async def test_status_of_a_session_window_has_no_reset_time(backend: Backend) -> None:
    gov = Governor(Policy.of(Limit("per_session", cap=9, window=Window.SESSION)), backend)
    s1 = Context(session="s1")
    await gov.check(s1)
    assert await gov.status(s1) == {
        "per_session": {"total": 1, "cap": 9, "remaining": 8, "exceeded": False, "resets_in": None}
    }
    assert await gov.status() == {}  # no session: the limit does not apply


# -- what else the compatible API added --------------------------------------


async def test_a_full_ledger_refuses_with_budget_unavailable(backend: Backend) -> None:
    from mcp_budget_governor.producers.memory_ledger import MemoryLedger

    class Full(MemoryLedger):
        accepting = False

    gov = Governor(Policy.of(Limit("calls", cap=5, window=Window.DAY)), backend, ledger=Full())
    decision = await gov.check()
    assert (decision.allowed, decision.status, decision.reason) == (
        False,
        503,
        "ledger_unavailable",
    )
    with pytest.raises(BudgetUnavailable):
        decision.raise_for_status()
    assert await gov.usage("calls") == 0


async def test_local_fallback_answers_remaining_meter_and_reads_while_redis_is_down() -> None:
    dead = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    gov = Governor(
        Policy.of(
            Limit("calls", cap=2, window=Window.DAY, scope=Scope.USER),
            Limit("spend", cap=100, window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
            Limit("blind", cap=100, window=Window.DAY, gated=False, local_fallback=False),
        ),
        dead,
    )
    u1 = Context(user="u1")
    first = await gov.check(u1)
    assert first.degraded and first.remaining == {"calls": 1}
    await gov.check(u1)
    refused = await gov.check(u1)
    assert (refused.allowed, refused.degraded, refused.remaining) == (False, True, {"calls": 0})

    spent = await gov.meter("spend", 100)
    assert (spent.degraded, spent.total, spent.within, spent.crossed) == (True, 100, False, True)
    blind = await gov.meter("blind", 100)
    assert (blind.degraded, blind.total, blind.within, blind.charged) == (True, 0, True, 100)
    assert await gov.is_tripped("spend")  # the local counter answers
    assert not await gov.is_tripped("blind")  # nothing answers: not evidence of a breach
    assert set(await gov.status(u1)) == {"calls", "spend"}
    await gov.close()
