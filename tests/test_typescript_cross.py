"""One budget, two languages: a Python and a TypeScript governor on one real Redis.

The TypeScript governor runs in a Node process (``ts/test/cross/driver.ts``)
driven line by line from here, with the same policy file, against the Redis of
the fixtures: calls alternating between the two languages admit exactly the
cap (one after the other, and all at once); a charge made in TypeScript is what
Python's ``usage()`` and ``mcpbg budgets`` report; a hostile id lands on one
counter from both; Python and TypeScript calls waiting for a concurrency slot
(``wait=``) share one queue and are admitted in arrival order.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from mcp_budget_governor import Context, Governor, LimitExceeded, RedisBackend
from mcp_budget_governor.holds import Reservations
from mcp_budget_governor.integrations.fastmcp import shared_request_state
from mcp_budget_governor.keys import APPROVAL_KEY
from mcp_budget_governor.planning import check_plan
from mcp_budget_governor.policy_file import load_file
from testing.buckets import room
from testing.node import Driver as Node
from testing.node import prepare_driver

POLICY = """
[[limits]]
name = "burst"
cap = 7
window = "minute"
scope = "user"

[[limits]]
name = "together"
cap = 11
window = "hour"
scope = ["tenant", "user"]

[[limits]]
name = "race"
cap = 150
window = "minute"
scope = "tenant"

[[limits]]
name = "spend"
cap_usd = "1"
window = "day"
scope = "user"
gated = false
"""

SPREAD = 3.0  # seconds over which each side starts its concurrent calls
HOSTILE = "a:b,{c}=%41 é\n🙂#" + "x" * 40


@pytest.fixture(scope="module")
def node_ready() -> None:
    prepare_driver()


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY, encoding="utf-8")
    return path


@pytest.fixture
def node(node_ready: None, policy_file: Path, redis_url: str) -> Iterator[Node]:
    n = Node(policy_file, redis_url)
    yield n
    n.close()


@pytest.fixture
async def python_gov(policy_file: Path, redis_url: str) -> Any:
    gov = Governor(load_file(policy_file), RedisBackend.from_url(redis_url, timeout=5.0))
    yield gov
    await gov.aclose()


@pytest.mark.slow
async def test_alternating_calls_admit_exactly_the_cap(node: Node, python_gov: Governor) -> None:
    ctx = {"user": "alternating"}
    await room(60, needed=10)  # "burst" is per minute: all 20 calls in one bucket
    statuses = []
    for i in range(20):
        if i % 2 == 0:
            statuses.append(("py", (await python_gov.check(Context(**ctx))).status))
        else:
            statuses.append(("ts", node("check", ctx=ctx)["status"]))
    admitted = [who for who, status in statuses if status == 200]
    print(f"alternating: {len(admitted)} of 20 admitted against cap 7: {statuses}")
    assert len(admitted) == 7
    assert set(admitted) == {"py", "ts"}
    assert [s for _, s in statuses] == [200] * 7 + [429] * 13
    assert await python_gov.usage("burst", Context(**ctx)) == 7
    assert node("usage", limit="burst", ctx=ctx)["usage"] == 7


@pytest.mark.slow
async def test_concurrent_calls_from_both_languages_admit_exactly_the_cap(
    node: Node, python_gov: Governor
) -> None:
    ctx = {"tenant": "racing"}  # only "race" (150 per minute per tenant) applies
    await python_gov.check(Context(tenant="warm-up"))  # connected, scripts loaded
    node("check", ctx={"tenant": "warm-up"})
    await room(60, needed=SPREAD + 15)  # "race" is per minute: all 400 calls in one bucket

    async def spread(i: int) -> Any:
        await asyncio.sleep(i * SPREAD / 200)
        return await python_gov.check(Context(**ctx))

    # 200 calls from each language, both started over the same 3 seconds, all concurrent.
    node.send("checks", n=200, spread_ms=SPREAD * 1000, ctx=ctx)
    py = await asyncio.gather(*(spread(i) for i in range(200)))
    ts = node.read()["statuses"]
    py_admitted, ts_admitted = sum(d.admitted for d in py), ts.count(200)
    print(
        f"concurrent: {py_admitted + ts_admitted} of 400 admitted against cap 150 "
        f"(python {py_admitted}, typescript {ts_admitted})"
    )
    assert py_admitted + ts_admitted == 150
    assert set(ts) | {d.status for d in py} <= {200, 429}
    assert await python_gov.usage("race", Context(**ctx)) == 150
    assert node("usage", limit="race", ctx=ctx)["usage"] == 150


@pytest.mark.slow
async def test_a_typescript_charge_is_what_python_and_mcpbg_budgets_report(
    node: Node, python_gov: Governor, policy_file: Path, redis_url: str
) -> None:
    ctx = {"user": "spender"}
    assert node("meter", limit="spend", amount=250_000, ctx=ctx)["total"] == 250_000
    assert await python_gov.usage("spend", Context(**ctx)) == 250_000
    await python_gov.meter("spend", 50_000, Context(**ctx))
    assert node("usage", limit="spend", ctx=ctx)["usage"] == 300_000
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "mcp_budget_governor.cli", "budgets", "--policy", str(policy_file),
         "--redis-url", redis_url, "--user", "spender", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [r for r in json.loads(out.stdout)["rows"] if r["name"] == "spend"]
    assert [(r["spent"], r["remaining"]) for r in rows] == [(300_000, 700_000)], out.stdout


@pytest.mark.slow
async def test_a_hostile_id_lands_on_the_same_counter_from_both(
    node: Node, python_gov: Governor
) -> None:
    ctx = {"user": HOSTILE, "tenant": "x,y=z"}
    await room(60, needed=10)  # the key names the minute's bucket, as the counts below do
    py_key = check_plan(python_gov.policy, Context(**ctx), time.time()).slots[0].key
    assert node("key", limit="burst", ctx=ctx)["key"] == py_key
    assert node("check", ctx=ctx)["status"] == 200
    assert (await python_gov.check(Context(**ctx))).status == 200
    assert node("check", ctx=ctx)["status"] == 200
    assert await python_gov.usage("burst", Context(**ctx)) == 3
    assert await python_gov.usage("together", Context(**ctx)) == 3
    # A neighbour whose id differs only after the separator shares nothing.
    assert node("usage", limit="burst", ctx={"user": "a:b"})["usage"] == 0


@pytest.mark.slow
async def test_a_cap_set_in_one_language_is_enforced_by_the_other(
    node: Node, python_gov: Governor
) -> None:
    await room(60, needed=10)  # "burst" counts per minute
    # TypeScript sets user "small"'s burst to 2 (no ledger: lua/change.lua); Python enforces it.
    node("set_cap", limit="burst", amount=2, ctx={"user": "small"})
    statuses = [(await python_gov.check(Context(user="small"))).status for _ in range(4)]
    assert statuses == [200, 200, 429, 429]
    # Python sets user "big"'s burst to 9; TypeScript enforces it.
    await python_gov.set_cap("burst", 9, user="big")
    ts = [node("check", ctx={"user": "big"})["status"] for _ in range(11)]
    assert ts == [200] * 9 + [429] * 2


def test_python_and_typescript_replicas_share_one_approval_key(node: Node, redis_url: str) -> None:
    """One key seals both languages' approvals (keys.APPROVAL_KEY): whichever side
    makes it first, the other reads it and keeps it."""
    shared_request_state(redis_url)  # Python makes it
    made_by_python = stored_approval_key(redis_url)
    assert node("approval_key")["key"] == made_by_python
    delete_approval_key(redis_url)
    made_by_typescript = node("approval_key")["key"]
    assert made_by_typescript != made_by_python and len(made_by_typescript) == 64
    shared_request_state(redis_url)  # Python reads it, leaves it
    assert stored_approval_key(redis_url) == made_by_typescript


def stored_approval_key(url: str) -> str:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return str(client.get(APPROVAL_KEY))
    finally:
        client.close()


def delete_approval_key(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.delete(APPROVAL_KEY)
    finally:
        client.close()


WAIT_POLICY = """
[[limits]]
name = "parallel"
cap = 2
unit = "concurrent"
scope = "user"
"""


def node_on(policy: str, path: Path, redis_url: str) -> Iterator[tuple[Node, Path]]:
    """A Node governor on a policy of its own (``policy``, written to ``path``), and
    the path, for a fixture to yield from: the scenarios whose limits differ from POLICY's."""
    path.write_text(policy, encoding="utf-8")
    n = Node(path, redis_url)
    yield n, path
    n.close()


@pytest.fixture
def wait_node(node_ready: None, tmp_path: Path, redis_url: str) -> Iterator[tuple[Node, Path]]:
    yield from node_on(WAIT_POLICY, tmp_path / "wait_policy.toml", redis_url)


@pytest.mark.slow
async def test_python_and_typescript_waiters_share_one_queue_first_come_first_served(
    wait_node: tuple[Node, Path], redis_url: str
) -> None:
    """Six callers, alternately Python and TypeScript, wait for a cap of 2 concurrent
    calls held by Python: each slot that frees goes to the oldest waiter, whatever
    its language (lua/charge.lua's queue), and a wait that runs out is a 429 with a
    retry hint on either side."""
    node, path = wait_node
    gov = Governor(load_file(path), RedisBackend.from_url(redis_url, timeout=5.0))
    ctx = {"user": f"waiting-{time.time_ns()}"}
    try:
        held: list[tuple[str, Any]] = []  # (who, Python decision or TypeScript name), oldest first
        for _ in range(2):
            d = await gov.check(Context(**ctx))
            assert d.admitted
            held.append(("py", d))
        arrivals: list[tuple[str, Any]] = []
        py_done: list[str] = []

        async def py_wait(name: str) -> Any:
            d = await gov.check(Context(**ctx), wait=30)
            if d.admitted:
                py_done.append(name)
            return d

        for i in range(6):
            name = f"w{i}"
            if i % 2 == 0:
                arrivals.append(("py", (name, asyncio.create_task(py_wait(name)))))
            else:
                assert node("wait_check", name=name, wait=30, ctx=ctx) == {"started": True}
                arrivals.append(("ts", (name, None)))
            await asyncio.sleep(0.15)  # each arrives (is queued) before the next
        order: list[str] = []
        for who, (name, task) in arrivals:
            old_who, old = held.pop(0)
            if old_who == "py":
                await gov.release(old)
            else:
                node("release", name=old)
            if who == "py":
                d = await asyncio.wait_for(task, 10)
                assert d.status == 200
                held.append(("py", d))
            else:
                r = await asyncio.wait_for(asyncio.to_thread(node, "result", name=name), 10)
                assert r["status"] == 200
                held.append(("ts", name))
            order.append(name)
            ts_done = node("admitted_names")["names"]
            # Nobody else got in: exactly the waiters up to this one were admitted.
            assert sorted(py_done + ts_done) == sorted(order), (py_done, ts_done, order)
        print(f"cross-language waiters admitted in order {order} ({[w for w, _ in arrivals]})")
        assert order == [f"w{i}" for i in range(6)]
        assert await gov.usage("parallel", Context(**ctx)) == 2
        # Both slots held (one by each language): a wait that runs out is the refusal.
        assert node("wait_check", name="late-ts", wait=0.3, ctx=ctx) == {"started": True}
        late_py = await gov.check(Context(**ctx), wait=0.3)
        late_ts = await asyncio.to_thread(node, "result", name="late-ts")
        assert (late_py.status, late_py.retry_after) == (429, 1)
        assert (late_ts["status"], late_ts["retry_after"], late_ts["limit"]) == (429, 1, "parallel")
        for who, old in held:
            if who == "py":
                await gov.release(old)
            else:
                node("release", name=old)
        assert await gov.usage("parallel", Context(**ctx)) == 0
    finally:
        await gov.aclose()


HOLD_POLICY = """
[[limits]]
name = "hold_user"
cap = 100
window = "day"
scope = "user"
gated = false

[[limits]]
name = "hold_tenant"
cap = 100
window = "day"
scope = "tenant"
gated = false
"""


@pytest.fixture
def hold_node(node_ready: None, tmp_path: Path, redis_url: str) -> Iterator[tuple[Node, Path]]:
    yield from node_on(HOLD_POLICY, tmp_path / "hold_policy.toml", redis_url)


@pytest.mark.slow
async def test_hard_caps_on_two_limits_hold_all_or_nothing_across_languages(
    hold_node: tuple[Node, Path], redis_url: str
) -> None:
    """Estimates on two limits, reserved by Python (holds.Reservations) and TypeScript
    (Governor.reserveAll) at once, naming the limits in opposite orders: each
    reservation holds both or neither, so exactly the caps' worth is admitted, and a
    TypeScript settlement is what Python's usage() reports."""
    node, path = hold_node
    gov = Governor(load_file(path), RedisBackend.from_url(redis_url, timeout=5.0))
    tag = time.time_ns()
    ctx = {"user": f"holder-{tag}", "tenant": f"acme-{tag}"}
    try:
        assert node("reserve_all", estimates={"hold_user": 10, "hold_tenant": 10},
                    actual={"hold_user": 3}, ctx=ctx) == {"status": 200}  # fmt: skip
        assert await gov.usage("hold_user", Context(**ctx)) == 3
        assert await gov.usage("hold_tenant", Context(**ctx)) == 10  # its estimate stands
        # 97 left on user, 90 on tenant: 9 more reservations of 10 + 10 fit.

        async def py_hold(i: int) -> int:
            await asyncio.sleep(i * 0.5 / 20)
            try:
                async with Reservations(gov, {"hold_tenant": 10, "hold_user": 10}, Context(**ctx)):
                    await asyncio.sleep(0.2)
            except LimitExceeded as exc:
                return exc.decision.status
            return 200

        node.send("reserve_alls", n=20, estimates={"hold_user": 10, "hold_tenant": 10},
                  hold_ms=200, spread_ms=500, ctx=ctx)  # fmt: skip
        py = await asyncio.gather(*(py_hold(i) for i in range(20)))
        ts = (await asyncio.to_thread(node.read))["statuses"]
        print(f"hard caps: python {py.count(200)} + typescript {ts.count(200)} of 40 held")
        assert py.count(200) + ts.count(200) == 9
        assert set(py) | set(ts) == {200, 429}
        assert await gov.usage("hold_user", Context(**ctx)) == 93
        assert await gov.usage("hold_tenant", Context(**ctx)) == 100
    finally:
        await gov.aclose()
