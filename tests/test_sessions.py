"""Session budgets across forks: a session and its forks spend one budget.

``Context(session="fork-7", session_root="fix-4821")`` keys every
``Scope.SESSION`` counter on the root; the ledger records the session and its
root; session counters expire a stated idle time (``SESSION_TTL_SECONDS``)
after their last write, on MemoryBackend and on a real Redis.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

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
from mcp_budget_governor.policy_file import load_file
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.file_ledger import FileLedger
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.fastdecode import decode
from mcp_budget_governor.stream.projector import to_applied
from mcp_budget_governor.windows import SESSION_TTL_SECONDS

MCPBG = Path(sys.executable).with_name("mcpbg")
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


def test_costs_of_a_session_split_tools_and_models_with_its_budget_line(tmp_path: Path) -> None:
    folder = tmp_path / "ledger"
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(
        '[[limits]]\nname = "session_spend"\ncap_usd = "1.00"\nwindow = "session"\n'
    )
    prices = PriceTable().with_price("m", 3, 15)  # $ per million input / output tokens

    async def write() -> None:
        gov = Governor(
            load_file(policy_file), MemoryBackend(), ledger=FileLedger(folder), prices=prices
        )
        async with gov:
            await gov.meter("session_spend", usd("0.10"), ROOT.with_tool("search"))
            await gov.meter("session_spend", usd("0.20"), FORKS[0].with_tool("browse"))
            # 10,000 input + 2,000 output tokens of m: $0.03 + $0.03.
            await gov.meter_tokens(
                "session_spend", "m", input_tokens=10_000, output_tokens=2_000, ctx=FORKS[1]
            )
            await gov.meter("session_spend", usd(5), Context(user="ana", session="other"))

    asyncio.run(write())
    out = subprocess.run(
        [str(MCPBG), "costs", "--ledger-dir", str(folder), "--session", "fix-4821",
         "--policy", str(policy_file), "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["summary"][0]["usd"] == "0.360000"
    assert {r["kind"]: r["usd"] for r in report["spend split"]} == {
        "tools": "0.300000",
        "models": "0.060000",
    }
    assert {r["tool"]: r["usd"] for r in report["spend by tool"]} == {
        "search": "0.100000",
        "browse": "0.200000",
        None: "0.060000",
    }
    (budget,) = report["session budget"]
    assert (budget["limit"], budget["usd"], budget["cap_usd"], budget["remaining_usd"]) == (
        "session_spend",
        "0.360000",
        "1.000000",
        "0.640000",
    )
    # The table form prints the same figures for people.
    table = subprocess.run(
        [str(MCPBG), "costs", "--ledger-dir", str(folder), "--session", "fix-4821",
         "--policy", str(policy_file)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "session budget" in table.stdout and "$0.640000" in table.stdout


async def test_a_middleware_resolver_rolls_forks_up_to_their_root(backend: Backend) -> None:
    from fastmcp import Client, FastMCP
    from fastmcp.exceptions import ToolError

    from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware

    roots = {"fork-7": "fix-4821", "fork-8": "fix-4821"}
    session = ["fix-4821"]

    async def root_of(s: str) -> str | None:
        return roots.get(s)

    gov = Governor(Policy.of(Limit("per_session", cap=3, window=Window.SESSION)), backend)
    mcp = FastMCP("forks")
    mcp.add_middleware(
        BudgetMiddleware(
            gov, identify=lambda c: Context(user="ana", session=session[0]), session_root=root_of
        )
    )

    @mcp.tool
    async def step() -> str:
        return "ok"

    async with Client(mcp) as client:
        for s in ("fix-4821", "fork-7", "fork-8"):
            session[0] = s
            await client.call_tool("step", {})
        session[0] = "fork-7"
        with pytest.raises(ToolError, match="budget_exceeded:session/session"):
            await client.call_tool("step", {})  # the root's three calls are spent
    assert await gov.usage("per_session", ROOT) == 3


@pytest.mark.parametrize("old_segment", [False, True], ids=["with-root", "before-the-column"])
def test_the_archive_keeps_the_root_and_reads_segments_written_before_it(
    tmp_path: Path, old_segment: bool
) -> None:
    import pyarrow.parquet as pq

    from mcp_budget_governor.projections.costs import Filter, summary
    from mcp_budget_governor.projections.ledger_view import open_ledger
    from mcp_budget_governor.stream.archiver import ledger_table, segment_name

    ledger = MemoryLedger()
    gov = Governor(Policy.of(SESSION_BUDGET), MemoryBackend(), ledger=ledger)

    async def spend() -> None:
        await gov.meter("session_spend", usd("0.10"), ROOT)
        await gov.meter("session_spend", usd("0.20"), FORKS[0])

    asyncio.run(spend())
    events = [(n, parse(encode(e, "test"))) for n, e in enumerate(ledger.entries)]
    table, _ = ledger_table("ledger", 0, events)
    if old_segment:
        table = table.drop_columns(["session_root"])
    day = tmp_path / f"date={time.strftime('%Y-%m-%d', time.gmtime(ledger.entries[0].time))}"
    day.mkdir()
    pq.write_table(table, day / segment_name("ledger", 0, 0, 1))
    con = open_ledger(archive_dir=tmp_path)
    try:
        roots = sorted(
            (r[0], r[1] or "-")
            for r in con.execute('SELECT "session", session_root FROM costs').fetchall()
        )
        (row,) = summary(con, Filter(session="fix-4821")).rows
    finally:
        con.close()
    if old_segment:  # read as before: the fork is a session of its own
        assert roots == [("fix-4821", "-"), ("fork-7", "-")]
        assert row[-1] == usd("0.10")
    else:
        assert roots == [("fix-4821", "-"), ("fork-7", "fix-4821")]
        assert row[-1] == usd("0.30")
