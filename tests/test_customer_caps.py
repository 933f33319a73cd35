"""Caps per customer: value caps, plans, run-time caps, grants and resets (issue 11).

Every behaviour runs on every backend (the ``backend`` fixture, Redis Cluster
included: ``EVERY_BACKEND``); the ledger path goes through the stream projection's
own parser and ``apply``. The cluster is never wiped, so a test on a backend names
its limits, projector and plan-assigned customers with its own ``tag``.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from mcp_budget_governor import Context, Governor, Limit, Plan, Policy, Scope, Unit, Window, usd
from mcp_budget_governor.caps import resolve
from mcp_budget_governor.counters import Backend
from mcp_budget_governor.errors import InvalidInputError, PolicyError
from mcp_budget_governor.events import encode, parse
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.projector import Projector
from testing.buckets import room

#: Every test on a backend runs on these (the conftest ``backend`` fixture's kinds).
EVERY_BACKEND = pytest.mark.parametrize(
    "backend", ["memory", "redis", "postgres", "cluster"], indirect=True
)


def policy(tag: str = "") -> Policy:
    """The suite's policy; ``tag`` ends each limit's name and the policy-assigned user's."""
    return Policy.of(
        Limit(f"tenant_calls{tag}", cap=3, window=Window.DAY, scope=Scope.TENANT, caps={"acme": 5}),
        Limit(f"burst{tag}", cap=100, window=Window.MINUTE, scope=Scope.USER),
        Limit(
            f"per_tool{tag}",
            cap=10,
            window=Window.DAY,
            scope=(Scope.USER, Scope.TOOL),
            caps={"user=u_1,tool=search": 2},
        ),
        plans=[Plan("pro", caps={f"burst{tag}": 4}), Plan("team", caps={f"burst{tag}": 6})],
        assignments={f"user=u_pro{tag}": "pro"},
    )


@pytest.fixture
def tag() -> str:
    """This test's names' suffix: nothing another test (or run) wrote is under them."""
    return uuid.uuid4().hex[:8]


async def admitted(gov: Governor, ctx: Context, tries: int) -> int:
    return sum([(await gov.check(ctx)).admitted for _ in range(tries)])


@EVERY_BACKEND
async def test_two_tenants_spend_exactly_their_own_caps(backend: Backend, tag: str) -> None:
    gov = Governor(policy(tag), backend)
    await room(60, needed=15)  # u_pro's plan caps "burst", a minute's: one bucket
    assert await admitted(gov, Context(tenant="acme", user="a"), 9) == 5  # its value cap
    assert await admitted(gov, Context(tenant="beta", user="b"), 9) == 3  # the default
    assert await admitted(gov, Context(user=f"u_pro{tag}"), 9) == 4  # its plan
    ctx = Context(user="u_1", tool="search")
    assert await admitted(gov, ctx, 9) == 2  # a composite value cap


@EVERY_BACKEND
async def test_run_time_cap_grant_reset_written_directly(backend: Backend, tag: str) -> None:
    gov, calls = Governor(policy(tag), backend), f"tenant_calls{tag}"
    beta = Context(tenant="beta", user="b")
    assert await admitted(gov, beta, 5) == 3
    await gov.set_cap(calls, 6, tenant="beta", reason="upgrade", actor="ops")
    assert await admitted(gov, beta, 5) == 3  # 6 now, 3 spent
    await gov.grant(calls, 2, tenant="beta", reason="goodwill")
    assert await admitted(gov, beta, 5) == 2
    assert await gov.usage(calls, beta) == 8  # a grant is no refund
    await gov.reset(calls, tenant="beta", reason="support")
    assert await admitted(gov, beta, 9) == 6  # the room is the cap again
    assert await gov.usage(calls, beta) == 14
    await gov.unset_cap(calls, tenant="beta")
    # Lowering below what is spent refuses the next call, nothing retroactive.
    assert await admitted(gov, beta, 2) == 0
    assert await gov.usage(calls, beta) == 14


@EVERY_BACKEND
async def test_run_time_plan_assignment_and_until(backend: Backend, tag: str) -> None:
    clock = [time.time()]
    gov = Governor(policy(tag), backend)
    u7, u8, u_pro = (Context(user=f"{u}{tag}") for u in ("u_7", "u_8", "u_pro"))
    await room(60, needed=15)  # every count below is of "burst", a minute's: one bucket
    await gov.assign_plan("pro", user=u7.user)
    assert await admitted(gov, u7, 6) == 4
    await gov.set_cap(f"burst{tag}", 1, user=u8.user or "", until=clock[0] + 3600)
    assert await admitted(gov, u8, 3) == 1
    await gov.assign_plan("team", user=u_pro.user)  # the run-time assignment wins
    assert await admitted(gov, u_pro, 9) == 6
    await gov.assign_plan(None, user=u_pro.user)  # back to the policy's: pro
    assert await admitted(gov, u_pro, 1) == 0


@EVERY_BACKEND
async def test_ledger_changes_reach_every_replica_in_one_projection_step(
    backend: Backend, tag: str
) -> None:
    ledger = MemoryLedger()
    one = Governor(policy(tag), backend, ledger=ledger)
    two = Governor(policy(tag), backend, ledger=ledger)
    beta, calls = Context(tenant="beta", user="b"), f"tenant_calls{tag}"
    projector = Projector(backend, f"caps.{tag}", dlq=lambda letter: None)  # type: ignore[arg-type]
    offset = 0

    async def project() -> None:
        nonlocal offset
        records = [(i, encode(e, "/t")) for i, e in enumerate(ledger.entries)][offset:]
        if records:
            await projector.apply_batch(0, records)
        offset = len(ledger.entries)

    assert await admitted(one, beta, 5) == 3
    await one.set_cap(calls, 5, tenant="beta", actor="ops", reason="trial")
    await one.grant(calls, 1, tenant="beta", reason="goodwill")
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


# -- the policy file ------------------------------------------------------------

POLICY_TOML = """
[[limits]]
name = "tenant_spend"
cap_usd = "25.00"
window = "day"
scope = "tenant"
caps = { acme = "100.00" }

[[limits]]
name = "tenant_calls"
cap = 3
window = "day"
scope = "tenant"

[[limits]]
name = "burst"
cap = 30
window = "minute"
scope = ["user", "tool"]
caps = { "user=u_42,tool=search" = 60 }

[plans.pro]
tenant_spend = "250.00"
tenant_calls = 6

[assign]
beta = "pro"
"""


def test_policy_file_caps_plans_and_assignments() -> None:
    from mcp_budget_governor.policy_file import loads

    p = loads(POLICY_TOML)
    assert p["tenant_spend"].value_caps == {"tenant=acme": usd(100)}
    assert p["burst"].value_caps == {"user=u_42,tool=search": 60}
    assert p.plan("pro").caps == {"tenant_calls": 6, "tenant_spend": usd(250)}
    assert p.assignments == {"tenant=beta": "pro"}


@pytest.mark.parametrize(
    ("old", "new", "line", "field"),
    [
        ('acme = "100.00"', "acme = 100.5", 7, "limits[0].caps.acme"),
        ('acme = "100.00"', 'acme = "-1"', 7, "limits[0].caps.acme"),
        ('acme = "100.00"', '"tool=x" = "1"', 7, "limits[0].caps.tool=x"),
        ("tenant_calls = 6", "tenant_calls = 1.5", 24, "plans.pro.tenant_calls"),
        ("tenant_calls = 6", "nope = 6", 24, "plans.pro.nope"),
        ('beta = "pro"', 'beta = "gold"', 27, "assign.beta"),
    ],
)
def test_policy_file_errors_name_line_and_field(old: str, new: str, line: int, field: str) -> None:
    from mcp_budget_governor.policy_file import PolicyFileError, loads

    with pytest.raises(PolicyFileError) as err:
        loads(POLICY_TOML.replace(old, new), source="p.toml")
    assert (err.value.line, err.value.field) == (line, field)


# -- the CLI ---------------------------------------------------------------------


def _cli(*argv: str) -> int:
    from mcp_budget_governor.cli import main

    return main(list(argv))


@pytest.fixture
def policy_file(tmp_path: pytest.TempPathFactory) -> str:
    path = tmp_path / "policy.toml"  # type: ignore[operator]
    path.write_text(POLICY_TOML)
    return str(path)


async def test_cli_changes_are_enforced_and_listed(
    redis_url: str, policy_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio
    import json

    from mcp_budget_governor.projections.counters.redis import RedisBackend

    common = ("--policy", policy_file, "--redis-url", redis_url)

    def cli(*argv: str) -> int:
        return _cli(
            *argv[:1],
            *(argv[1:2] if argv[0] in ("caps", "plans") else ()),
            *common,
            *argv[(2 if argv[0] in ("caps", "plans") else 1) :],
        )

    until = (datetime.now(UTC) + timedelta(days=2)).date().isoformat()
    args = ("--tenant", "gamma", "--cap", "5", "--until", until, "--reason", "trial")
    assert await asyncio.to_thread(cli, "caps", "set", "tenant_calls", *args) == 0
    assert await asyncio.to_thread(cli, "plans", "assign", "--tenant", "delta", "pro") == 0
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    gov = Governor(Policy.from_file(policy_file), backend)
    assert await admitted(gov, Context(tenant="gamma"), 9) == 5
    assert await admitted(gov, Context(tenant="delta"), 9) == 6
    assert (
        await asyncio.to_thread(
            cli,
            "grant",
            "tenant_calls",
            "--tenant",
            "gamma",
            "--amount",
            "2",
            "--reason",
            "goodwill",
        )
        == 0
    )
    assert await admitted(gov, Context(tenant="gamma"), 9) == 2
    assert await asyncio.to_thread(cli, "reset", "tenant_calls", "--tenant", "delta") == 0
    assert await admitted(gov, Context(tenant="delta"), 9) == 6
    assert await gov.usage("tenant_calls", Context(tenant="delta")) == 12  # spend kept
    capsys.readouterr()
    assert await asyncio.to_thread(cli, "caps", "list", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    kinds = sorted((r["kind"], r["scope"]) for r in rows)
    assert kinds == [
        ("cap", "tenant=gamma"),
        ("grant", "tenant=delta"),
        ("grant", "tenant=gamma"),
        ("plan", "tenant=delta"),
    ]
    assert [r["reason"] for r in rows if r["kind"] == "cap"] == ["trial"]
    await gov.aclose()


#: Year 10000 in UTC: past the bounds table's last time.
LAST_UNTIL = "9999-12-31T23:59:59-12:00"


@pytest.mark.parametrize(
    "argv",
    [
        ("caps", "set", "nope", "--tenant", "a", "--cap", "5"),
        ("caps", "set", "tenant_calls", "--user", "a", "--cap", "5"),
        ("caps", "set", "tenant_calls", "--tenant", "a", "--cap", "-5"),
        ("caps", "set", "tenant_calls", "--tenant", "a", "--cap", "2.5"),
        ("caps", "set", "tenant_spend", "--tenant", "a", "--cap-usd", "1.0000001"),
        ("caps", "set", "tenant_spend", "--tenant", "a", "--cap", "5"),
        ("caps", "set", "tenant_calls", "--tenant", "a", "--cap", "5", "--until", "2001-01-01"),
        ("caps", "set", "tenant_calls", "--tenant", "a", "--cap", "5", "--until", LAST_UNTIL),
        ("grant", "tenant_spend", "--tenant", "a", "--usd", "-5"),
        ("grant", "tenant_calls", "--tenant", "a", "--amount", "0"),
        ("plans", "assign", "--tenant", "a", "gold"),
    ],
)
def test_cli_bad_input_exits_2_and_writes_nothing(
    redis_url: str, policy_file: str, argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    import redis

    split = 2 if argv[0] in ("caps", "plans") else 1
    code = _cli(*argv[:split], "--policy", policy_file, "--redis-url", redis_url, *argv[split:])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    client = redis.Redis.from_url(redis_url)
    assert client.keys("mcpbg:v1:*") == []
    client.close()


@EVERY_BACKEND
async def test_budgets_report_shows_the_effective_limit_and_its_source(
    backend: Backend, tag: str
) -> None:
    from mcp_budget_governor.projections.budgets import budget_report, table_rows

    gov, calls = Governor(policy(tag), backend), f"tenant_calls{tag}"
    await room(60, needed=15)  # the report lists this minute's "burst" row for u_pro
    for ctx in (Context(tenant="acme"), Context(tenant="beta"), Context(user=f"u_pro{tag}")):
        await gov.check(ctx)
    await gov.set_cap(calls, 7, tenant="beta", until=time.time() + 3600, reason="r")
    await gov.grant(calls, 2, tenant="beta")
    report = await budget_report(gov.policy, backend)
    rows = {(r["name"], tuple(r["scope_values"].values())): r for r in report.as_json()["rows"]}
    acme, beta = rows[(calls, ("acme",))], rows[(calls, ("beta",))]
    assert (acme["limit"], acme["limit_source"], acme["default_limit"]) == (5, "value", 3)
    assert (beta["limit"], beta["grant"], beta["remaining"]) == (7, 2, 8)
    assert beta["limit_source"].startswith("run-time until 20")
    assert rows[(f"burst{tag}", (f"u_pro{tag}",))]["limit_source"] == "plan:pro"
    assert any("grant 2" in cell for row in table_rows(report) for cell in row)


def _golden_caps() -> list[dict[str, object]]:
    import json
    from pathlib import Path

    path = Path(__file__).parent / "golden" / "vectors.json"
    cases: list[dict[str, object]] = json.loads(path.read_text())["caps"]
    return cases


@EVERY_BACKEND
@pytest.mark.parametrize("case", _golden_caps(), ids=lambda c: str(c["source"]))
async def test_every_backend_resolves_caps_as_the_golden_vectors(
    backend: Backend, tag: str, case: dict[str, object]
) -> None:
    """The Lua copy (lua/charge.lua effective_cap; on the cluster the client-side rule plus
    the script's grant), Postgres and the memory backend against caps.resolve."""
    import runpy
    from pathlib import Path

    from mcp_budget_governor.caps import PLANS_KEY, CapRef, Change, ChangeKind
    from mcp_budget_governor.counters import CounterOp

    golden = runpy.run_path(str(Path(__file__).parent / "golden" / "generate.py"))
    CAP_DEFAULT, CAP_PLANS = golden["CAP_DEFAULT"], golden["CAP_PLANS"]

    now = time.time()
    user, tenant = f"user=u_42{tag}", f"tenant=acme{tag}"  # the vectors' u_42 and acme
    limit, field = f"t{tag}", f"{tenant},{user}"
    caps_hash, key = f"mcpbg:v1:_caps:{limit}", f"mcpbg:v1:{limit}:{field}:20991231"
    expire = int(now) + 86_400
    changes = []
    runtime = case["runtime"]
    if isinstance(runtime, list):
        until = int(now) + runtime[1] if runtime[1] else 0
        changes.append(Change(ChangeKind.CAP_SET, limit, caps_hash, field, runtime[0], until))
    assigned = case["assigned"]
    assert isinstance(assigned, dict)
    tagged = {"user=u_42": user, "tenant=acme": tenant}
    for f, plan in assigned.items():
        changes.append(Change(ChangeKind.PLAN_ASSIGNED, limit, PLANS_KEY, tagged[f], plan=plan))
    if case["grant"]:
        changes.append(Change(ChangeKind.GRANTED, limit, key, "", int(case["grant"]), expire))  # type: ignore[call-overload]
    if changes:
        await backend.change(changes)  # type: ignore[attr-defined]
    value_cap = case["value_cap"]
    ref = CapRef(
        caps_hash,
        field,
        value_cap if isinstance(value_cap, int) else None,
        (user, tenant),
        case["file_plan"] if isinstance(case["file_plan"], str) else None,
        tuple((str(n), int(c)) for n, c in CAP_PLANS),  # type: ignore[call-overload]
    )
    result = await backend.charge([CounterOp(key, 0, CAP_DEFAULT, True, expire, ref)])
    assert result.caps == (case["room"],)


async def test_grants_resets_and_caps_are_no_spend_for_costs_and_focus(tmp_path: Path) -> None:
    """The cost queries and the FOCUS export count the same with and without the changes."""
    from mcp_budget_governor import PriceTable
    from mcp_budget_governor.producers.file_ledger import FileLedger
    from mcp_budget_governor.projections import costs, focus_export
    from mcp_budget_governor.projections.ledger_view import open_ledger

    rules = Policy.of(
        Limit("spend", cap=usd(25), window=Window.DAY, unit=Unit.USD_MICROS, scope=Scope.TENANT),
        Limit("calls", cap=100, window=Window.DAY, scope=Scope.TENANT),
    )
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    options = focus_export.ExportOptions(start, start + timedelta(hours=2))

    async def ledger_of(folder: Path, changes: bool) -> tuple[Any, ...]:
        ledger = FileLedger(folder, fsync="always")
        gov = Governor(rules, ledger=ledger, prices=PriceTable.builtin())
        ctx = Context(tenant="acme", user="u1", tool="search")
        for _ in range(3):
            await gov.check(ctx)
            await gov.meter("spend", usd("0.25"), ctx)
            if changes:
                await gov.grant("spend", usd(1), tenant="acme", reason="goodwill")
                await gov.reset("calls", tenant="acme", reason="support")
                await gov.set_cap("spend", usd(50), tenant="acme", reason="upgrade")
                await gov.assign_plan(None, tenant="acme")
        await gov.aclose()
        con = open_ledger(None, folder)
        flt = costs.Filter()
        report = costs.summary(con, flt)
        out = folder / "focus.csv"
        result = focus_export.export_focus(con, out, options)
        lines = out.read_text().splitlines()
        return report.rows, result.rows, len(lines)

    plain = await ledger_of(tmp_path / "plain", False)
    changed = await ledger_of(tmp_path / "changed", True)
    assert plain[1:] == changed[1:]  # FOCUS: the same rows
    spent = [r[-1] for r in plain[0]], [r[-1] for r in changed[0]]
    assert spent[0] == spent[1] == [usd("0.75")]
    assert [r[2:] for r in plain[0]] == [r[2:] for r in changed[0]]  # after the times


async def test_cli_change_through_the_file_ledger_waits_for_the_projection(
    redis_url: str, policy_file: str, tmp_path: Path
) -> None:
    import asyncio

    from mcp_budget_governor.producers.file_ledger import FileProjector
    from mcp_budget_governor.projections.counters.redis import RedisBackend

    ledger = tmp_path / "ledger"
    argv = ["caps", "set", "--policy", policy_file, "--redis-url", redis_url]
    argv += ["--ledger-dir", str(ledger), "tenant_calls", "--tenant", "eta", "--cap", "1"]
    assert await asyncio.to_thread(_cli, *argv) == 0
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    gov = Governor(Policy.from_file(policy_file), backend)
    assert (await backend.overrides()) == ({}, {})  # only in the ledger so far
    assert await FileProjector(ledger, backend).catch_up() == 1
    assert await admitted(gov, Context(tenant="eta"), 3) == 1
    await gov.aclose()


def test_file_ledger_replay_restores_run_time_changes_after_flushall(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mcpbg replay` (the file ledger through the DuckDB path, as the archive) restores
    caps, plans, grants and resets in ledger order, and a second replay changes nothing
    (on Redis and on Postgres)."""
    import asyncio

    from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
    from testing.stores import backend_for, store_args, wipe

    beta = Context(tenant="beta", user="u_9")

    async def write() -> None:
        gov = Governor(policy(), ledger=FileLedger(tmp_path, fsync="always"))
        for _ in range(2):
            await gov.check(beta)
        await gov.set_cap("tenant_calls", 9, tenant="acme", reason="r")
        await gov.set_cap("tenant_calls", 4, tenant="beta", reason="upgrade")
        await gov.assign_plan("pro", user="u_9", reason="sold")
        await gov.grant("tenant_calls", 2, tenant="beta", reason="goodwill")
        await gov.grant("tenant_calls", 1, tenant="beta", reason="more")
        await gov.aclose()

    asyncio.run(write())

    async def read() -> tuple[Any, ...]:
        backend = backend_for(store_url)
        keys = await backend.counter_keys(100, match="mcpbg:v1:tenant_calls:tenant=beta:*")
        states = [await backend.state(k) for k in keys]
        caps, plans = await backend.overrides()
        await backend.aclose()
        return caps, plans, [(s.committed, s.grant) for s in states]

    def state() -> tuple[Any, ...]:
        return asyncio.run(read())

    async def project() -> None:  # the live path: what replay must reproduce
        backend = backend_for(store_url)
        await FileProjector(tmp_path, backend).catch_up()
        await backend.aclose()

    asyncio.run(project())
    live = state()
    assert live[0] and live[1] and live[2] == [(2, 3)]
    wipe(store_url)
    argv = ("replay", "--source", "file", "--ledger-dir", str(tmp_path), *store_args(store_url))
    assert _cli(*argv) == 0
    out = capsys.readouterr().out
    assert "5 run-time changes" in out and "restored" in out, out
    assert state() == live
    assert _cli(*argv) == 0  # again, onto the restored state: grants not doubled
    assert state() == live

    async def enforced() -> tuple[int, int]:
        gov = Governor(policy(), backend_for(store_url))
        n = await admitted(gov, Context(tenant="beta", user="u_8"), 9)
        burst = (await gov.status(beta))["burst"]["cap"]
        await gov.aclose()
        return n, burst

    assert asyncio.run(enforced()) == (5, 4)  # cap 4 + grants 3 - spent 2; u_9 on pro


@EVERY_BACKEND
async def test_status_and_is_tripped_read_the_effective_caps(backend: Backend, tag: str) -> None:
    gov, calls = Governor(policy(tag), backend), f"tenant_calls{tag}"
    acme, beta, pro = Context(tenant="acme"), Context(tenant="beta"), Context(user=f"u_pro{tag}")
    assert (await gov.status(acme))[calls]["cap"] == 5  # its value cap
    assert (await gov.status(pro))[f"burst{tag}"]["cap"] == 4  # its plan
    await gov.set_cap(calls, 6, tenant="beta")
    await gov.grant(calls, 2, tenant="beta")
    row = (await gov.status(beta))[calls]
    assert (row["cap"], row["remaining"], row["exceeded"]) == (8, 8, False)
    assert await admitted(gov, beta, 9) == 8
    assert await gov.is_tripped(calls, beta)
    assert not await gov.is_tripped(calls, acme)
    assert await admitted(gov, acme, 4) == 4
    assert not await gov.is_tripped(calls, acme)  # 4 of its 5
    assert (await gov.status(acme))[calls]["remaining"] == 1


class Outage:
    """A backend that can be switched off: every call then raises as an unreachable one."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.down = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                from mcp_budget_governor.errors import BackendUnavailableError

                raise BackendUnavailableError("switched off")
            return await attr(*args, **kwargs)

        return call


@EVERY_BACKEND
async def test_the_fail_open_fallback_keeps_the_effective_caps(backend: Backend, tag: str) -> None:
    from mcp_budget_governor import FailMode

    calls = f"calls{tag}"
    pol = Policy.of(
        Limit(calls, cap=2, window=Window.DAY, scope=Scope.TENANT, fail_mode=FailMode.OPEN)
    )
    outage = Outage(backend)
    gov = Governor(pol, outage, retry_interval=3600)  # type: ignore[arg-type]
    beta = Context(tenant="beta")
    await gov.set_cap(calls, 4, tenant="beta")
    assert (await gov.check(beta)).admitted  # the effective cap (4) seen once
    outage.down = True
    # The per-replica fallback counts from zero, against 4, not the default 2.
    assert await admitted(gov, beta, 6) == 4
    row = (await gov.status(beta))[calls]
    assert (row["cap"], row["total"]) == (4, 4)
