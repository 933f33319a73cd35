"""Caps per customer: value caps, plans, run-time caps, grants and resets (issue 11).

Every behaviour runs on both backends (the ``backend`` fixture); the ledger
path goes through the stream projection's own parser and ``apply``.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from mcp_budget_governor import Context, Governor, Limit, Plan, Policy, Scope, Unit, Window, usd
from mcp_budget_governor.caps import resolve
from mcp_budget_governor.counters import Backend
from mcp_budget_governor.errors import InvalidInputError, PolicyError
from mcp_budget_governor.events import encode, parse
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.projector import Projector


def policy() -> Policy:
    return Policy.of(
        Limit("tenant_calls", cap=3, window=Window.DAY, scope=Scope.TENANT, caps={"acme": 5}),
        Limit("burst", cap=100, window=Window.MINUTE, scope=Scope.USER),
        Limit(
            "per_tool",
            cap=10,
            window=Window.DAY,
            scope=(Scope.USER, Scope.TOOL),
            caps={"user=u_1,tool=search": 2},
        ),
        plans=[Plan("pro", caps={"burst": 4})],
        assignments={"user=u_pro": "pro"},
    )


async def admitted(gov: Governor, ctx: Context, tries: int) -> int:
    return sum([(await gov.check(ctx)).admitted for _ in range(tries)])


async def test_two_tenants_spend_exactly_their_own_caps(backend: Backend) -> None:
    gov = Governor(policy(), backend)
    assert await admitted(gov, Context(tenant="acme", user="a"), 9) == 5  # its value cap
    assert await admitted(gov, Context(tenant="beta", user="b"), 9) == 3  # the default
    assert await admitted(gov, Context(user="u_pro"), 9) == 4  # its plan
    ctx = Context(user="u_1", tool="search")
    assert await admitted(gov, ctx, 9) == 2  # a composite value cap


async def test_run_time_cap_grant_reset_written_directly(backend: Backend) -> None:
    gov = Governor(policy(), backend)
    beta = Context(tenant="beta", user="b")
    assert await admitted(gov, beta, 5) == 3
    await gov.set_cap("tenant_calls", 6, tenant="beta", reason="upgrade", actor="ops")
    assert await admitted(gov, beta, 5) == 3  # 6 now, 3 spent
    await gov.grant("tenant_calls", 2, tenant="beta", reason="goodwill")
    assert await admitted(gov, beta, 5) == 2
    assert await gov.usage("tenant_calls", beta) == 8  # a grant is no refund
    await gov.reset("tenant_calls", tenant="beta", reason="support")
    assert await admitted(gov, beta, 9) == 6  # the room is the cap again
    assert await gov.usage("tenant_calls", beta) == 14
    await gov.unset_cap("tenant_calls", tenant="beta")
    # Lowering below what is spent refuses the next call, nothing retroactive.
    assert await admitted(gov, beta, 2) == 0
    assert await gov.usage("tenant_calls", beta) == 14


async def test_run_time_plan_assignment_and_until(backend: Backend) -> None:
    clock = [time.time()]
    gov = Governor(policy(), backend)
    await gov.assign_plan("pro", user="u_7")
    assert await admitted(gov, Context(user="u_7"), 6) == 4
    await gov.set_cap("burst", 1, user="u_8", until=clock[0] + 3600)
    assert await admitted(gov, Context(user="u_8"), 3) == 1


async def test_ledger_changes_reach_every_replica_in_one_projection_step(
    backend: Backend,
) -> None:
    ledger = MemoryLedger()
    one = Governor(policy(), backend, ledger=ledger)
    two = Governor(policy(), backend, ledger=ledger)
    beta = Context(tenant="beta", user="b")
    projector = Projector(backend, "caps.test", dlq=lambda letter: None)  # type: ignore[arg-type]
    offset = 0

    async def project() -> None:
        nonlocal offset
        records = [(i, encode(e, "/t")) for i, e in enumerate(ledger.entries)][offset:]
        if records:
            await projector.apply_batch(0, records)
        offset = len(ledger.entries)

    assert await admitted(one, beta, 5) == 3
    await one.set_cap("tenant_calls", 5, tenant="beta", actor="ops", reason="trial")
    await one.grant("tenant_calls", 1, tenant="beta", reason="goodwill")
    assert await admitted(two, beta, 1) == 0  # not yet projected
    await project()  # one step: both replicas enforce cap 5 + grant 1
    assert await admitted(two, beta, 2) + await admitted(one, beta, 2) == 3
    await project()
    again = [(i, encode(e, "/t")) for i, e in enumerate(ledger.entries)]
    await projector.apply_batch(0, again)  # a redelivery changes nothing
    assert await admitted(one, beta, 1) == 0
    (granted,) = [e.change for e in ledger.entries if e.change and e.change.kind == "granted"]
    assert (await backend.state(granted.key)).grant == 1


def test_change_events_parse_and_carry_no_spend() -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), ledger=ledger)
    import asyncio

    asyncio.run(gov.grant("tenant_calls", 2, tenant="acme", reason="r", actor="me"))
    event = parse(encode(ledger.entries[0], "/t"))
    assert event.type == "mcpbg.granted.v1" and event.data.charges == ()
    assert event.data.change is not None and event.data.change.reason == "r"


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda g: g.set_cap("nope", 5, tenant="a"), "limit"),
        (lambda g: g.set_cap("tenant_calls", 5, user="a"), "scope"),
        (lambda g: g.set_cap("tenant_calls", -1, tenant="a"), "cap"),
        (lambda g: g.set_cap("tenant_calls", 1.5, tenant="a"), "cap"),
        (lambda g: g.set_cap("tenant_calls", 5, tenant="a", until=1.0), "until"),
        (lambda g: g.grant("tenant_calls", 0, tenant="a"), "amount"),
        (lambda g: g.assign_plan("gold", tenant="a"), "plan"),
    ],
)
async def test_bad_input_names_the_field_and_writes_nothing(call: object, field: str) -> None:
    ledger = MemoryLedger()
    gov = Governor(policy(), ledger=ledger)
    with pytest.raises(InvalidInputError) as err:
        await call(gov)  # type: ignore[operator]
    assert err.value.field == field
    assert ledger.entries == []


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Limit("a", cap=1, window=Window.DAY, caps={"x": 2}), "Limit('a').caps['x']"),
        (
            lambda: Limit("a", cap=1, window=Window.DAY, scope=Scope.USER, caps={"tenant=x": 2}),
            "Limit('a').caps['tenant=x']",
        ),
        (
            lambda: Limit("a", cap=1, window=Window.DAY, scope=Scope.USER, caps={"x": -2}),
            "Limit('a').caps['x']",
        ),
        (
            lambda: Policy.of(
                Limit("a", cap=1, window=Window.DAY, scope=Scope.USER),
                plans=[Plan("p", caps={"b": 1})],
            ),
            "Plan('p').caps",
        ),
        (
            lambda: Policy.of(
                Limit("a", cap=1, window=Window.DAY, scope=Scope.USER), assignments={"x": "p"}
            ),
            "Policy.assignments['x']",
        ),
    ],
)
def test_bad_policy_names_the_field(make: object, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        make()  # type: ignore[operator]
    assert err.value.field == field


def test_resolution_order() -> None:
    assert resolve(1, value_cap=2, runtime=None, plan="p", plan_caps={"p": 3}, now=0).cap == 2
    assert resolve(1, value_cap=None, runtime=None, plan="q", plan_caps={"p": 3}, now=0).cap == 1
    expired = resolve(1, value_cap=None, runtime=(9, 10), plan=None, plan_caps={}, now=10)
    assert expired.source == "default"


def test_usd_caps() -> None:
    lim = Limit(
        "spend",
        cap=usd(25),
        window=Window.DAY,
        unit=Unit.USD_MICROS,
        scope=Scope.TENANT,
        caps={"acme": usd(100)},
    )
    assert lim.value_caps == {"tenant=acme": 100_000_000}
    assert datetime.now(UTC) + timedelta(days=1) > datetime.now(UTC)
