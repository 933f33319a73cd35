"""MemoryBackend, the Redis Lua scripts and the Postgres functions implement one counter model.

A hypothesis state machine drives two governors with the same policy and the
same clock, one on :class:`MemoryBackend` and one on a real Redis (or a real
Postgres: each test runs against both stores), through the
same random sequence of checks, meters, reservations (held open across other
operations, then settled, left standing or released) and usage reads, and
requires identical answers every step. The ledger variant also projects the
two in-memory ledgers into their backends (wholly or a prefix) and compares
every counter's committed and in-flight parts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import pytest
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mcp_budget_governor import (
    MAX_AMOUNT,
    Context,
    CounterOverflowError,
    Governor,
    InvalidInputError,
    Limit,
    LimitExceeded,
    MemoryBackend,
    OnExceed,
    Policy,
    PostgresBackend,
    RedisBackend,
    Reservation,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.counters import (
    AppliedCharge,
    AppliedEvent,
    Backend,
    ChargeResult,
    CounterOp,
)
from mcp_budget_governor.decision import Decision, MeterResult
from mcp_budget_governor.errors import EventRefusedError, MissingScopeError
from mcp_budget_governor.ledger import LedgerEntry
from mcp_budget_governor.planning import slot
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from testing.postgres import truncate_all

USERS = ("alice", "bob", "carol")
TENANTS = ("acme", "globex")
TOOLS = ("search", "fetch")

# Small caps so that every limit is reached within a few dozen steps. DAY, HOUR
# and MONTH only: the clock is fixed within an example, so no bucket rolls over.
POLICY = Policy.of(
    Limit("user_day", cap=5, window=Window.DAY, scope=Scope.USER),
    Limit("user_tool_hour", cap=2, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    Limit("tenant_month", cap=7, window=Window.MONTH, scope=Scope.TENANT),
    # Shadow mode, global scope: counts every admitted check, never refuses.
    Limit("shadow", cap=3, window=Window.HOUR, on_exceed=OnExceed.ALERT),
    # A spend breaker fed by meter(): sheds a tenant's checks (503) once spent.
    Limit(
        "tenant_spend",
        cap=60,
        window=Window.DAY,
        scope=Scope.TENANT,
        unit=Unit.USD_MICROS,
        gated=False,
        breaker=True,
    ),
    # A gated spend limit (402, no Retry-After) and a gated tokens limit (429).
    Limit("user_spend", cap=40, window=Window.DAY, scope=Scope.USER, unit=Unit.USD_MICROS),
    Limit("user_tokens", cap=300, window=Window.DAY, scope=Scope.USER, unit=Unit.TOKENS),
    # Metered only: check() never consults it.
    Limit(
        "tool_tokens", cap=100, window=Window.MONTH, scope=Scope.TOOL, unit=Unit.TOKENS, gated=False
    ),
    # The exact range's edge: the largest cap, filled to it and past it (meter_to_the_edge).
    Limit("edge", cap=MAX_AMOUNT, window=Window.DAY, scope=Scope.TENANT, unit=Unit.TOKENS),
)
LIMITS = tuple(lim.name for lim in POLICY)
TOKEN_LIMITS = tuple(lim.name for lim in POLICY if lim.unit is Unit.TOKENS)

#: Every context with all three fields set: together they reach every counter key.
FULL_CONTEXTS = tuple(
    Context(user=u, tenant=t, tool=x) for u in USERS for t in TENANTS for x in TOOLS
)

contexts = st.builds(
    Context,
    user=st.sampled_from((None, *USERS)),
    tenant=st.sampled_from((None, *TENANTS)),
    tool=st.sampled_from((None, *TOOLS)),
)
limits = st.sampled_from(LIMITS)
amounts = st.one_of(st.integers(0, 25), st.integers(0, 200))

SETTINGS = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)

Outcome = tuple[str, Any]


class BackendsAgree(RuleBasedStateMachine):
    """Two governors, MemoryBackend and a shared store (Redis or Postgres, its URL's
    scheme says), must answer every call alike (``red`` names the shared one)."""

    URL: ClassVar[str] = ""
    LEDGER: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        postgres = self.URL.startswith("postgresql:")
        if postgres:
            truncate_all(self.URL)
        else:
            sync = redis.Redis.from_url(self.URL)
            try:
                sync.flushdb()
            finally:
                sync.close()
        # Real time (Redis expires keys on its own clock), frozen for the example.
        self.now = time.time()
        clock: Callable[[], float] = lambda: self.now  # noqa: E731
        self.loop = asyncio.new_event_loop()
        self.mem_ledger = MemoryLedger() if self.LEDGER else None
        self.red_ledger = MemoryLedger() if self.LEDGER else None
        self.mem_backend = MemoryBackend()
        self.red_backend: Backend = (
            PostgresBackend.from_url(self.URL, timeout=5.0)
            if postgres
            else RedisBackend.from_url(self.URL, timeout=2.0)
        )
        self.mem = Governor(POLICY, self.mem_backend, ledger=self.mem_ledger, clock=clock)
        self.red = Governor(POLICY, self.red_backend, ledger=self.red_ledger, clock=clock)
        self.open: list[tuple[Reservation, Reservation]] = []
        self.turn = 0
        self.keys = sorted(
            {
                s.key
                for lim in POLICY
                for ctx in (Context(), *FULL_CONTEXTS)
                if (s := slot(lim, ctx, self.now, POLICY.tz, 0, enforce=False)) is not None
            }
        )

    # -- helpers ------------------------------------------------------------

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def outcome(self, call: Callable[[Governor], Awaitable[Any]], gov: Governor) -> Outcome:
        try:
            return ("ok", self.run(call(gov)))
        except LimitExceeded as exc:
            return ("LimitExceeded", exc.decision)
        except InvalidInputError as exc:
            return ("InvalidInputError", str(exc))
        except CounterOverflowError as exc:
            return ("CounterOverflowError", str(exc))

    def same(self, call: Callable[[Governor], Awaitable[Any]]) -> Any:
        mem = self.outcome(call, self.mem)
        red = self.outcome(call, self.red)
        assert mem == red, f"memory {mem!r} != redis {red!r}"
        return mem[1]

    def states(self, backend: Any, ledger: MemoryLedger | None) -> list[tuple[Any, ...]]:
        """Each key's (committed, in-flight, pending by ledger position)."""
        position = {e.id: i for i, e in enumerate(ledger.entries)} if ledger else {}
        out = []
        for key in self.keys:
            s = self.run(backend.state(key))
            pending = {position.get(k, k): v for k, v in s.pending.items()}
            out.append((key, s.committed, s.in_flight, pending))
        return out

    # -- the operations -----------------------------------------------------

    @rule(ctx=contexts, times=st.integers(1, 4))
    def check(self, ctx: Context, times: int) -> None:
        for _ in range(times):
            decision = self.same(lambda gov: gov.check(ctx))
            event(f"check: {decision.status} {decision.limit or ''} over={len(decision.over)}")

    @rule(limit=limits, amount=amounts, ctx=contexts)
    def meter(self, limit: str, amount: int, ctx: Context) -> None:
        self.same(lambda gov: gov.meter(limit, amount, ctx))

    @rule(
        limit=st.sampled_from(TOKEN_LIMITS),
        tokens=st.tuples(st.integers(0, 60), st.integers(0, 60)),
        ctx=contexts,
    )
    def meter_tokens(self, limit: str, tokens: tuple[int, int], ctx: Context) -> None:
        self.same(
            lambda gov: gov.meter_tokens(
                limit, "any-model", input_tokens=tokens[0], output_tokens=tokens[1], ctx=ctx
            )
        )

    @rule(limit=limits, ctx=contexts, offset=st.sampled_from((-1, 0, 1)))
    def meter_to_the_cap(self, limit: str, ctx: Context, offset: int) -> None:
        """Land a counter exactly on its cap (or one unit either side): the edge of fits()."""
        if slot(POLICY[limit], ctx, self.now, POLICY.tz, 0, enforce=False) is None:
            return
        used = self.same(lambda gov: gov.usage(limit, ctx))
        amount = POLICY[limit].cap - used + offset
        if amount >= 0:
            self.same(lambda gov: gov.meter(limit, amount, ctx))
        # The next caller: a zero-charge limit (spend, tokens, breaker) is spent at its cap.
        decision = self.same(lambda gov: gov.check(ctx))
        event(f"check after filling {limit}{offset:+d}: {decision.status} {decision.limit or ''}")

    @rule(ctx=contexts, offset=st.sampled_from((-2, -1, 0, 1)), settle=st.booleans())
    def meter_to_the_edge(self, ctx: Context, offset: int, settle: bool) -> None:
        """Fill the largest cap to the exact range's edge (or one unit either side):
        at the edge a check still fits or not exactly, past it the charge is refused
        with CounterOverflowError alike; a negative settlement takes it back."""
        if ctx.tenant is None:
            return
        used = self.same(lambda gov: gov.usage("edge", ctx))
        amount = MAX_AMOUNT - used + offset
        if 0 <= amount <= MAX_AMOUNT:
            outcome = self.same(lambda gov: gov.meter("edge", amount, ctx))
            event(f"meter to the edge{offset:+d}: {type(outcome).__name__}")
        decision = self.same(lambda gov: gov.check(ctx))
        event(f"check at the edge{offset:+d}: {decision.status} {decision.limit or ''}")
        if settle:
            self.same(lambda gov: self._settle_down(gov, ctx))

    async def _settle_down(self, gov: Governor, ctx: Context) -> int | None:
        async with gov.reserved("edge", 5, ctx) as r:
            r.actual = 0
        return await gov.usage("edge", ctx)

    @precondition(lambda self: len(self.open) < 4)
    @rule(limit=limits, estimate=st.integers(0, 40), ctx=contexts)
    def reserve(self, limit: str, estimate: int, ctx: Context) -> None:
        try:
            mem, red = self.mem, self.red
            pair = (mem.reserved(limit, estimate, ctx), red.reserved(limit, estimate, ctx))
        except MissingScopeError:  # a hold on no counter: refused by both, at once
            with pytest.raises(MissingScopeError):
                self.red.reserved(limit, estimate, ctx)
            event("reserve: the context keys no counter")
            return
        mem = self.outcome(lambda _: pair[0].__aenter__(), self.mem)
        red = self.outcome(lambda _: pair[1].__aenter__(), self.red)
        assert mem[0] == red[0], f"memory {mem!r} != redis {red!r}"
        assert pair[0].decision == pair[1].decision
        event(f"reserve: {mem[0]}")
        if mem[0] == "ok":
            self.open.append(pair)

    @precondition(lambda self: bool(self.open))
    @rule(
        index=st.integers(0, 3),
        how=st.sampled_from(("actual", "unset", "release", "raises")),
        actual=st.integers(0, 60),
    )
    def settle(self, index: int, how: str, actual: int) -> None:
        pair = self.open.pop(index % len(self.open))
        outcomes = []
        for r, gov in zip(pair, (self.mem, self.red), strict=True):
            if how == "actual":
                r.actual = actual
            elif how == "release":
                r.release()
            exc = RuntimeError("the work failed") if how == "raises" else None
            # A settlement past the exact range's edge (meter_to_the_edge) raises
            # CounterOverflowError: on both backends alike, like every other call.
            outcomes.append(
                self.outcome(
                    lambda _g, r=r, exc=exc: r.__aexit__(type(exc) if exc else None, exc, None),
                    gov,
                )
            )
        assert outcomes[0][0] == outcomes[1][0], f"memory {outcomes[0]!r} != shared {outcomes[1]!r}"

    @rule(limit=limits, ctx=contexts)
    def usage(self, limit: str, ctx: Context) -> None:
        self.same(lambda gov: gov.usage(limit, ctx))

    @rule()
    def counter_states(self) -> None:
        assert self.states(self.mem_backend, self.mem_ledger) == self.states(
            self.red_backend, self.red_ledger
        )

    @invariant()
    def usage_agrees_for_every_limit(self) -> None:
        # Through the governor, for the empty context (scoped limits refuse it
        # alike) and one full context, a different one each step.
        self.turn += 1
        ctx = FULL_CONTEXTS[self.turn % len(FULL_CONTEXTS)]
        calls = [(limit, c) for limit in LIMITS for c in (Context(), ctx)]

        async def every_usage(gov: Governor) -> list[Any]:
            results = await asyncio.gather(
                *(gov.usage(limit, c) for limit, c in calls), return_exceptions=True
            )
            return [r if isinstance(r, int) else (type(r).__name__, str(r)) for r in results]

        self.same(every_usage)

    @invariant()
    def every_counter_agrees(self) -> None:
        mem = self.run(self.mem_backend.usage(self.keys))
        red = self.run(self.red_backend.usage(self.keys))
        assert dict(zip(self.keys, mem, strict=True)) == dict(zip(self.keys, red, strict=True))

    def teardown(self) -> None:
        try:
            self.run(self.mem.aclose())
            self.run(self.red.aclose())
        finally:
            self.loop.close()


def normalized(ledger: MemoryLedger) -> list[LedgerEntry]:
    """Entries without their random ids (references become ledger positions)."""
    position = {e.id: str(i) for i, e in enumerate(ledger.entries)}
    return [
        dataclasses.replace(
            e, id="", reservation=None if e.reservation is None else position[e.reservation]
        )
        for e in ledger.entries
    ]


class LedgerBackendsAgree(BackendsAgree):
    """The same, in ledger mode: in-flight writes, then projection into committed."""

    LEDGER = True

    @property
    def ledgers(self) -> tuple[MemoryLedger, MemoryLedger]:
        assert self.mem_ledger is not None and self.red_ledger is not None
        return self.mem_ledger, self.red_ledger

    @invariant()
    def ledgers_agree(self) -> None:
        mem, red = self.ledgers
        assert normalized(mem) == normalized(red)

    @rule(fraction=st.floats(0, 1))
    def project_prefix(self, fraction: float) -> None:
        mem, red = self.ledgers
        stop = round(len(mem.entries) * fraction)
        applied = [
            self.run(backend.apply("memory:0", ledger.events(0, stop)))
            for backend, ledger in ((self.mem_backend, mem), (self.red_backend, red))
        ]
        assert applied[0] == applied[1]

    @rule()
    def project_all(self) -> None:
        mem, red = self.ledgers
        applied = (self.run(mem.project(self.mem_backend)), self.run(red.project(self.red_backend)))
        assert applied[0] == applied[1]
        for ctx in FULL_CONTEXTS[:3]:
            for limit in LIMITS:
                self.same(lambda gov, limit=limit, ctx=ctx: gov.usage(limit, ctx))
        mem_states = self.states(self.mem_backend, mem)
        assert mem_states == self.states(self.red_backend, red)
        # Conservation once projected: nothing is left in flight on either side.
        assert all(in_flight == 0 and not pending for _, _, in_flight, pending in mem_states)


def machine(base: type[BackendsAgree], url: str) -> type[BackendsAgree]:
    return type(base.__name__, (base,), {"URL": url})


@pytest.fixture(params=["redis", "postgres"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The shared store the memory model is held against: each test runs on both."""
    return str(request.getfixturevalue(f"{request.param}_url"))


def test_memory_and_shared_backends_agree(store_url: str) -> None:
    run_state_machine_as_test(machine(BackendsAgree, store_url), settings=SETTINGS)


def test_memory_and_shared_backends_agree_with_a_ledger(store_url: str) -> None:
    run_state_machine_as_test(machine(LedgerBackendsAgree, store_url), settings=SETTINGS)


EDGE_POLICY = Policy.of(
    Limit("spend", cap=MAX_AMOUNT, window=Window.DAY, unit=Unit.USD_MICROS),
    Limit("calls", cap=MAX_AMOUNT, window=Window.DAY),
)


async def edge_cases(backend: Backend) -> list[Any]:
    """The same edge cases on one backend: what each step answered, refusals included."""
    out: list[Any] = []

    async def step(coro: Awaitable[Any]) -> None:
        try:
            got = await coro
            if isinstance(got, Decision):
                got = got.status
            out.append(got.charged if isinstance(got, MeterResult) else got)
        except CounterOverflowError as exc:
            out.append(("overflow", exc.limit, exc.amount))
        except EventRefusedError as exc:
            out.append(("refused", exc.offset))

    gov = Governor(EDGE_POLICY, backend)
    now = time.time()
    spend, calls = (
        slot(EDGE_POLICY[name], Context(), now, EDGE_POLICY.tz, 0, enforce=False)
        for name in ("spend", "calls")
    )
    assert spend is not None and calls is not None
    # Spend one unit short of the largest cap: a check fits exactly (the sum equals
    # the cap); at the cap none does; a charge past the range is refused, writing nothing.
    await step(gov.meter("spend", MAX_AMOUNT - 1))
    await step(gov.check())
    await step(gov.meter("spend", 1))
    await step(gov.check())
    await step(gov.meter("spend", 1))
    await step(gov.usage("spend"))
    # A negative in-flight part (a settlement under an event id) brings the total back in.
    await step(backend.charge([CounterOp(spend.key, -2, 0, False, spend.expire_at)], event_id="s"))
    await step(gov.usage("spend"))
    # Calls charged inline to one short of the cap: the last check that fits, then none.
    await step(backend.charge([CounterOp(calls.key, MAX_AMOUNT - 2, 0, False, calls.expire_at)]))
    await step(gov.check())
    await step(gov.check())
    # The projection refuses an event that would commit past the range (naming it, for
    # the dead letters), writing nothing of the batch; the counter stays exact.
    events = [
        AppliedEvent(i, f"e{i}", now, (AppliedCharge(calls.key, MAX_AMOUNT, calls.expire_at),))
        for i in range(1000)
    ]
    await step(backend.apply("edge:0", events))
    await step(gov.check())
    await step(gov.meter("calls", 1))
    await step(gov.usage("calls"))
    await gov.aclose()
    return out


def test_every_backend_agrees_at_the_numeric_edge(redis_url: str, postgres_url: str) -> None:
    async def each() -> list[list[Any]]:
        return [
            await edge_cases(MemoryBackend()),
            await edge_cases(RedisBackend.from_url(redis_url, timeout=5.0)),
            await edge_cases(PostgresBackend.from_url(postgres_url, timeout=5.0)),
        ]

    mem, red, pg = asyncio.run(each())
    assert pg == mem
    assert mem == red
    assert mem == [
        MAX_AMOUNT - 1,
        200,
        1,
        402,
        ("overflow", "spend", 1),
        MAX_AMOUNT,
        ChargeResult(-1, (MAX_AMOUNT,)),
        MAX_AMOUNT - 2,
        ChargeResult(-1, (1,)),
        200,
        429,
        ("refused", 0),
        429,
        ("overflow", "calls", 1),
        MAX_AMOUNT,
    ]
