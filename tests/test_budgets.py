"""``mcpbg budgets`` agrees with ``Governor.usage()`` on every row, on Redis and in memory.

Also: ``keys.parse_key`` inverts ``counter_key`` for hostile ids, the key
listing is bounded and skips internal keys, and the command's table, JSON and
exit codes.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from mcp_budget_governor import (
    Backend,
    Context,
    FailMode,
    Governor,
    Limit,
    MemoryBackend,
    OnExceed,
    Policy,
    PriceTable,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.cli import main as mcpbg
from mcp_budget_governor.cli.budgets import print_report
from mcp_budget_governor.keys import (
    EPOCH_KEY,
    MAX_VALUE_CHARS,
    ParsedKey,
    counter_key,
    escape,
    key_pattern,
    parse_key,
    pattern_regex,
    scope_segment,
)
from mcp_budget_governor.planning import slot
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.projections import budgets
from mcp_budget_governor.projections.budgets import (
    BudgetReport,
    budget_report,
    format_amount,
    period,
    table_rows,
)
from mcp_budget_governor.windows import UTC, Bucket, bucket_for
from testing.buckets import room

PRICES = PriceTable().with_price("m-1", "3.00", "15.00")
LONG_ID = "x" * (MAX_VALUE_CHARS + 10)  # its key holds a hash, not the id

POLICY = Policy.of(
    Limit("per_user_calls", cap=20, window=Window.DAY, scope=Scope.USER),
    Limit("burst", cap=3, window=Window.MINUTE, scope=Scope.USER),
    Limit("per_tool", cap=2, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    Limit("tenant_tokens", cap=10_000, unit=Unit.TOKENS, window=Window.MONTH, scope=Scope.TENANT),
    Limit("user_spend", cap=usd(1), unit=Unit.USD_MICROS, window=Window.DAY, scope=Scope.USER),
    Limit("per_session", cap=5, window=Window.SESSION),
    Limit("tenant_trial", cap=2, window=Window.DAY, scope=Scope.TENANT, on_exceed=OnExceed.ALERT),
    Limit(
        "global_spend",
        cap=usd("0.05"),
        unit=Unit.USD_MICROS,
        window=Window.DAY,
        breaker=True,
        gated=False,
        fail_mode=FailMode.CLOSED,
    ),
    timezone="Europe/Paris",
)

CONTEXTS = [
    Context(user="alice", tenant="acme", tool="search", session="s1"),
    Context(user="alice", tenant="acme", tool="fetch", session="s1"),
    Context(user="bob:1,tool=x", tenant="acme", tool="search", session="s2"),
    Context(user="ü [bold]", tenant="initech", tool="search"),
    Context(user=LONG_ID, tenant="initech", tool="fetch"),
    Context(user="", tenant="initech", tool="search"),  # the anonymous bucket
]


async def activity(gov: Governor) -> None:
    """Checks up to refusals, token and dollar metering, a breaker trip."""
    for ctx in CONTEXTS:
        for _ in range(4):  # burst cap 3, per_tool cap 2: refusals happen
            await gov.check(ctx)
    await gov.meter_tokens("tenant_tokens", "m-1", input_tokens=4_000, output_tokens=1_500,
                           ctx=CONTEXTS[0])  # fmt: skip
    await gov.meter_tokens("user_spend", "m-1", input_tokens=10_000, output_tokens=2_000,
                           ctx=CONTEXTS[2])  # fmt: skip
    await gov.meter("global_spend", usd("0.06"), CONTEXTS[3])  # past the cap: trips the breaker
    assert (await gov.check(Context(user="dave"))).status == 503  # shed, charging nothing


async def assert_agrees(gov: Governor, report: BudgetReport, *more: Context) -> None:
    """Every row's spent is what Governor.usage answers for its limit and context."""
    assert report.rows
    by_key = {}
    for ctx in [*CONTEXTS, *more, Context()]:
        for limit in POLICY:
            s = slot(limit, ctx, report.at, POLICY.tz, 0, enforce=False)
            if s is not None:
                by_key[s.key] = ctx
    for row in report.rows:
        ctx = by_key[row.key]
        assert await gov.usage(row.name, ctx) == row.spent, row
        assert row.remaining == max(0, row.cap - row.spent)


def clocked(backend: Backend, now: float, ledger: MemoryLedger | None = None) -> Governor:
    return Governor(POLICY, backend, prices=PRICES, clock=lambda: now, ledger=ledger)


async def test_every_active_counter_agrees_with_usage(backend: Backend) -> None:
    now = time.time()  # Redis expires keys on its own clock: stay near it
    gov = clocked(backend, now)
    await activity(gov)
    report = await budget_report(POLICY, backend, now=now)
    await assert_agrees(gov, report)
    assert not report.truncated
    # Every counter that holds something has its row, and each global limit one.
    expected = set()
    for ctx in CONTEXTS:
        for limit in POLICY:
            s = slot(limit, ctx, now, POLICY.tz, 0, enforce=False)
            if s is not None and (await backend.usage([s.key]))[0] > 0:
                expected.add(s.key)
    expected |= {
        s.key for lim in POLICY if (s := slot(lim, Context(), now, POLICY.tz, 0, enforce=False))
    }
    assert {row.key for row in report.rows} == expected
    rows = {(row.name, row.who): row for row in report.rows}
    assert rows["burst", "alice"].spent == 3 and rows["burst", "alice"].exceeded
    assert rows["per_tool", "user=alice tool=search"].spent == 2
    assert rows["tenant_tokens", "acme"].spent == 5_500
    assert rows["user_spend", "bob:1,tool=x"].spent == usd("0.06")  # 10k in, 2k out at $3/$15
    assert rows["global_spend", "*"].spent == usd("0.06") and rows["global_spend", "*"].exceeded
    assert rows["tenant_trial", "initech"].spent == 6 and rows["tenant_trial", "initech"].exceeded
    assert rows["per_session", "s1"].spent == 3
    assert rows["burst", '""'].spent == 2  # the anonymous user, shown as ""
    hashed = [row for row in report.rows if any(row.hashed)]
    assert hashed and all("(hashed)" in row.who for row in hashed)
    assert not rows["per_user_calls", "alice"].exceeded
    assert report.exceeded


async def test_filtered_reports_agree_and_show_untouched_limits(backend: Backend) -> None:
    now = time.time()
    gov = clocked(backend, now)
    await activity(gov)
    alice = await budget_report(POLICY, backend, user="alice", now=now)
    await assert_agrees(gov, alice)
    names = [(row.name, row.who) for row in alice.rows]
    assert names == [
        ("per_user_calls", "alice"),
        ("burst", "alice"),
        ("per_tool", "user=alice tool=fetch"),
        ("per_tool", "user=alice tool=search"),
        ("user_spend", "alice"),  # nothing spent yet: shown, at zero
        ("global_spend", "*"),
    ]
    assert alice.rows[4].spent == 0 and alice.rows[4].remaining == usd(1)
    tenant = await budget_report(POLICY, backend, tenant="initech", now=now)
    await assert_agrees(gov, tenant)
    assert [(row.name, row.who) for row in tenant.rows] == [
        ("tenant_tokens", "initech"),
        ("tenant_trial", "initech"),
        ("global_spend", "*"),
    ]
    # A user with a tool: the per-tool limit is read directly, no listing needed.
    pair = await budget_report(POLICY, backend, user="alice", tool="search", now=now)
    assert pair.listed == 0 or any(not set(lim.dimensions) <= {Scope.USER, Scope.TOOL}
                                   for lim in POLICY)  # fmt: skip
    assert ("per_tool", "user=alice tool=search") in [(r.name, r.who) for r in pair.rows]
    hostile = await budget_report(POLICY, backend, user="bob:1,tool=x", now=now)
    await assert_agrees(gov, hostile)
    assert {row.who for row in hostile.rows if row.limit.dimensions} == {
        "bob:1,tool=x",
        "user=bob:1,tool=x tool=search",
    }
    long = await budget_report(POLICY, backend, user=LONG_ID, now=now)
    await assert_agrees(gov, long)
    assert [r.spent for r in long.rows if r.name == "burst"] == [2]


async def test_ledger_mode_in_flight_and_committed_agree(backend: Backend) -> None:
    now = time.time()
    ledger = MemoryLedger()
    gov = clocked(backend, now, ledger)
    await activity(gov)
    before = await budget_report(POLICY, backend, now=now)
    await assert_agrees(gov, before)
    await ledger.project(backend)  # in-flight amounts move to committed
    after = await budget_report(POLICY, backend, now=now)
    await assert_agrees(gov, after)
    assert [(r.key, r.spent) for r in after.rows] == [(r.key, r.spent) for r in before.rows]


async def test_listing_is_bounded_and_skips_other_keys(backend: Backend) -> None:
    now = time.time()
    # A past minute's bucket (before the breaker trips), and older policies' counters:
    # a retired limit, and limits of this policy's names counted per other scopes.
    assert (await clocked(backend, now - 120).check(Context(user="carol"))).admitted
    same_day = bucket_for(Window.DAY, now - 120, POLICY.tz) == bucket_for(
        Window.DAY, now, POLICY.tz
    )
    gov = clocked(backend, now)
    await activity(gov)
    for older in (
        Policy.of(Limit("retired", cap=9, window=Window.DAY),
                  Limit("burst", cap=9, window=Window.MINUTE, scope=Scope.TENANT)),
        Policy.of(Limit("burst", cap=9, window=Window.MINUTE, scope=(Scope.USER, Scope.TOOL))),
    ):  # fmt: skip
        await Governor(older, backend, clock=lambda: now).check(
            Context(user="alice", tenant="acme", tool="x")
        )
    if isinstance(backend, RedisBackend):
        await backend.mark_ready("e1")  # an internal key: never listed
        assert await backend.client.exists(EPOCH_KEY)
    full = await budget_report(POLICY, backend, now=now)
    await assert_agrees(gov, full, Context(user="carol"))
    assert not full.truncated
    shown = [(r.name, r.who) for r in full.rows]
    assert ("burst", "carol") not in shown  # a past minute
    assert ("burst", "acme") not in shown and ("burst", "user=alice tool=x") not in shown
    assert not any(r.name == "retired" for r in full.rows)
    if same_day:
        assert ("per_user_calls", "carol") in shown
    # Listed: this policy's keys in their current periods, plus the one key whose
    # "user=*" also matches "user=alice,tool=x" (parsed, then left out).
    assert full.listed == len([r for r in full.rows if r.limit.dimensions]) + 1

    minute = bucket_for(Window.MINUTE, now).label
    burst = key_pattern("burst", (Scope.USER,), {}, minute)
    listed = await backend.counter_keys(100, match=burst)
    assert listed == sorted(listed)
    parsed = [parse_key(k) for k in listed]
    assert {p.values for p in parsed if p is not None} == {
        ("",), (escape(LONG_ID),), ("alice",), ("alice", "x"), ("bob:1,tool=x",), ("ü [bold]",)
    }  # fmt: skip
    alice = key_pattern("burst", (Scope.USER,), {Scope.USER: "alice"}, minute)
    assert await backend.counter_keys(100, match=alice) == [f"mcpbg:v1:burst:user=alice:{minute}"]
    everything = await backend.counter_keys(10_000)
    assert everything == sorted(everything)
    assert not any(k.startswith("mcpbg:v1:_") for k in everything)
    assert len(everything) > full.listed  # past periods and other policies' keys

    seen: list[tuple[str, int]] = []
    cut = await budget_report(
        POLICY, backend, max_keys=3, now=now, progress=lambda *p: seen.append(p)
    )
    assert cut.truncated and cut.listed == 3
    assert seen == [("per_user_calls", 0)]  # the first limit's listing filled the budget
    assert len(await backend.counter_keys(3)) == 3
    assert await backend.counter_keys(0) == []
    assert await backend.counter_keys(0, match=burst) == []


def test_key_patterns_hold_no_glob_characters_but_the_wildcard() -> None:
    pattern = key_pattern("t", (Scope.TENANT, Scope.USER), {Scope.USER: "*?[x]\\"}, "20261129")
    assert pattern == "mcpbg:v1:t:tenant=*,user=%2A%3F%5Bx%5D%5C:20261129"
    assert pattern_regex(pattern).fullmatch("mcpbg:v1:t:tenant=acme,user=%2A%3F%5Bx%5D%5C:20261129")
    with pytest.raises(ValueError, match="glob"):
        key_pattern("t", (), {}, "2026[11]")


async def test_counters_are_read_in_chunks(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = time.time()
    gov = clocked(backend, now)
    await activity(gov)
    whole = await budget_report(POLICY, backend, now=now)
    monkeypatch.setattr(budgets, "USAGE_CHUNK", 4)
    chunked = await budget_report(POLICY, backend, now=now)
    assert len(chunked.rows) > 4 * 3
    assert [(r.key, r.spent) for r in chunked.rows] == [(r.key, r.spent) for r in whole.rows]
    await assert_agrees(gov, chunked)


async def test_memory_listing_drops_expired_counters() -> None:
    clock = [time.time()]
    backend = MemoryBackend(clock=lambda: clock[0])
    gov = Governor(POLICY, backend, clock=lambda: clock[0])
    await gov.check(Context(user="a"))
    assert len(await backend.counter_keys(100)) == 2  # per_user_calls, burst
    clock[0] += 2 * 86_400 + 7200  # the day's and minute's buckets are gone
    assert await backend.counter_keys(100) == []


# -- the key inverse ------------------------------------------------------------

ATOMS = ("a", ":", ",", "=", "%", "%3A", "#", "{", "}", "\n", " ", "\x00", "é", "😀", "global")
hostile = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=30),
    st.lists(st.sampled_from(ATOMS), max_size=8).map("".join),
    st.builds(lambda n, t: "a" * n + t, st.integers(150, 260), st.sampled_from(ATOMS)),
)
limit_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,20}", fullmatch=True)
buckets = st.sampled_from(["20261129", "20261129T1914", "202611@Europe/Paris", "session"])


@settings(max_examples=300, deadline=None)
@given(
    name=limit_names,
    dims=st.lists(st.sampled_from(list(Scope)), unique=True, max_size=5).map(
        lambda ds: tuple(sorted(ds, key=list(Scope).index))
    ),
    data=st.data(),
    bucket=buckets,
)
def test_parse_key_inverts_counter_key(
    name: str, dims: tuple[Scope, ...], data: st.DataObject, bucket: str
) -> None:
    values = tuple(data.draw(hostile) for _ in dims)
    key = counter_key(name, scope_segment(dims, values), bucket)
    parsed = parse_key(key)
    assert parsed is not None
    assert (parsed.limit, parsed.dims, parsed.bucket) == (name, dims, bucket)
    for value, got, hashed in zip(values, parsed.values, parsed.hashed, strict=True):
        assert hashed == escape(value).startswith("#")
        assert got == (escape(value) if hashed else value)
    assert parsed.key == key


@pytest.mark.parametrize(
    "key",
    [
        "mcpbg:v1:_applied",
        "mcpbg:v1:_seen:20261129",
        "mcpbg:v1:_alerted:x:global:20261129:80",
        "mcpbg:v2:burst:global:20261129",
        "other:v1:burst:global:20261129",
        "mcpbg:v1:burst:global:",
        "mcpbg:v1:burst:planet=a:20261129",
        "mcpbg:v1:burst:tool=a,user=b:20261129",  # not the canonical order
        "mcpbg:v1:burst:user=a,user=b:20261129",
        "mcpbg:v1:burst:user:20261129",
        "mcpbg:v1:burst:user=a%3a:20261129",  # lower-case escape: no context makes it
        "mcpbg:v1:burst:user=a%3:20261129",
        "mcpbg:v1:burst:user=%FF:20261129",  # not UTF-8
        "mcpbg:v1:burst:user=a b:20261129",
        "mcpbg:v1:burst:user=#abc:20261129",
        "mcpbg:v1:burst:user=" + "a" * 200 + ":20261129",  # too long to be unhashed
    ],
)
def test_parse_key_refuses_what_no_context_produces(key: str) -> None:
    assert parse_key(key) is None


def test_parse_key_reads_the_golden_shapes() -> None:
    assert parse_key("mcpbg:v1:per_tool:user=a%3Ab,tool=search:20261129") == ParsedKey(
        "per_tool", (Scope.USER, Scope.TOOL), ("a:b", "search"), (False, False), "20261129"
    )
    assert parse_key("mcpbg:v1:g:global:202611@Europe/Paris") == ParsedKey(
        "g", (), (), (), "202611@Europe/Paris"
    )


# -- rendering -------------------------------------------------------------------


def test_amounts_and_periods_read_as_people_expect() -> None:
    assert format_amount(Unit.USD_MICROS, 7_420_000) == "$7.420000"
    assert format_amount(Unit.CALLS, 1_234_567) == "1,234,567"
    assert format_amount(Unit.TOKENS, 0) == "0"
    t = 1_764_374_400.0 + 19 * 3600 + 14 * 60 + 5  # 2025-11-29T19:14:05Z
    paris = POLICY.tz
    assert period(Window.MINUTE, bucket_for(Window.MINUTE, t), UTC) == "2025-11-29 19:14 UTC"
    assert period(Window.HOUR, bucket_for(Window.HOUR, t), paris) == "2025-11-29 19:00 UTC"
    assert (
        period(Window.DAY, bucket_for(Window.DAY, t, paris), paris) == "2025-11-29 (Europe/Paris)"
    )
    assert period(Window.MONTH, bucket_for(Window.MONTH, t), UTC) == "2025-11"
    assert period(Window.SESSION, Bucket("session", None, None)) == "this session"


async def test_printed_table_shows_ids_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """Caller ids are data: rich markup in one prints as written; the demo prints this way."""
    backend = MemoryBackend()
    now = time.time()
    await activity(clocked(backend, now))
    report = await budget_report(POLICY, backend, user="ü [bold]", now=now)
    cells = table_rows(report)
    assert cells[0][:3] == ("per_user_calls", "user", "ü [bold]")
    print_report(report, title="budgets")
    out = capsys.readouterr().out
    assert "ü [bold]" in out and "$0.060000" in out and "yes" in out


# -- the command -------------------------------------------------------------------

TOML = """\
[[limits]]
name = "per_user_calls"
cap = 2_000
window = "day"
scope = "user"

[[limits]]
name = "tenant_tokens"
cap = 5_000_000
unit = "tokens"
window = "month"
scope = "tenant"

[[limits]]
name = "global_spend"
cap_usd = "0.05"
window = "day"
breaker = true
gated = false
"""


async def run_cli(argv: list[str]) -> int:
    """The command as a user runs it, in its own thread (it starts its own event loop)."""
    return await asyncio.to_thread(mcpbg, argv)


async def test_command_json_and_table_agree_with_usage(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(TOML)
    policy = Policy.from_file(path)
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    gov = Governor(policy, backend, prices=PRICES)
    # The checks, the command and the reads below in one UTC day (and month): the
    # command, on the wall clock, lists the current period's counters only.
    await room(86_400, needed=60)
    ctxs = [Context(user=f"user{i}", tenant=f"t{i % 2}") for i in range(5)]
    for i, ctx in enumerate(ctxs):
        for _ in range(i + 1):
            await gov.check(ctx)
    await gov.meter_tokens("tenant_tokens", "m-1", input_tokens=1_200_000, output_tokens=34_567,
                           ctx=ctxs[0])  # fmt: skip
    await gov.meter("global_spend", usd("0.01"), ctxs[0])

    args = ["budgets", "--policy", str(path), "--redis-url", redis_url]
    assert await run_cli([*args, "--json"]) == 0  # nothing exceeded
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert len(rows) == 5 + 1 + 1 and doc["truncated"] is False  # t1 has no tokens yet
    for row in rows:
        ctx = Context(**row["scope_values"])
        assert await gov.usage(row["name"], ctx) == row["spent"]
        assert row["limit"] == policy[row["name"]].cap
    assert {r["spent"] for r in rows if r["name"] == "per_user_calls"} == {1, 2, 3, 4, 5}
    assert [r["spent"] for r in rows if r["scope_values"] == {"tenant": "t0"}] == [1_234_567]

    assert await run_cli([*args, "--user", "user3"]) == 0
    table = capsys.readouterr().out
    assert "user3" in table and "user2" not in table
    assert "$0.010000" in table and "$0.050000" in table  # dollars, from micros
    assert "2,000" in table  # thousands separators
    assert "global_spend" in table and "per_user_calls" in table

    await gov.meter("global_spend", usd("0.05"), ctxs[0])  # the breaker trips
    assert await run_cli([*args, "--tenant", "t0", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["exceeded"]) for r in doc["rows"]] == [
        ("tenant_tokens", False),
        ("global_spend", True),
    ]
    assert await run_cli([*args, "--max-keys", "2"]) == 1
    out = capsys.readouterr().out
    assert "listing stopped at 2 keys" in out
    await gov.aclose()


def test_command_input_errors(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    example = str(Path(__file__).resolve().parent.parent / "examples" / "policy.toml")
    assert mcpbg(["budgets", "--redis-url", redis_url]) == 2
    assert "--policy: required" in capsys.readouterr().err
    assert mcpbg(["budgets", "--policy", example]) == 2
    assert "--redis-url: required" in capsys.readouterr().err
    assert mcpbg(["budgets", "--policy", example, "--redis-url", redis_url, "--max-keys", "0"]) == 2
    assert "--max-keys" in capsys.readouterr().err
    assert mcpbg(["budgets", "--policy", example, "--redis-url", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcpbg budgets: redis unreachable") and err.count("\n") == 1
    # The example policy on an empty Redis: a row per global limit, nothing exceeded.
    assert mcpbg(["budgets", "--policy", example, "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "global_spend" in out and "$25.000000" in out
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0  # a report writes nothing
    client.close()
