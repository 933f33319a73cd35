"""A client cancels calls at every instant of their admission, tool and settle.

The store is put 40 ms away (``testing/delay_proxy.py``), so a cancellation a
few milliseconds into a call lands before the store's reply, between the reply
and the ledger, in the tool or in its settle. The server is the FastMCP quick
start (``BudgetMiddleware``) with a global concurrency cap of 1, a fixed price
per call and a file ledger; the caller is the official Python MCP client
(``mcp.client.Client``, streamable HTTP), which cancels by its cancel scope
(``notifications/cancelled``). Each call names its own user, so the ledger
tells each call's outcome apart. Afterwards, whatever the instants:

- every admitted call is paid exactly once (one ``metered`` event of its fixed
  price per ``admitted`` event, none for a refused call);
- no lease is held: the cap of 1 is free at once (well before ``lease_ttl``)
  and the next call is admitted;
- nothing is left in flight without its event: ``mcpbg reconcile --older-than 0``
  finds no orphan and no drift once the ledger is projected, and the counters
  equal the ledger.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastmcp import FastMCP
from fastmcp.server.middleware import MiddlewareContext
from mcp.client import Client

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.events import parse
from mcp_budget_governor.integrations.fastmcp import BudgetMiddleware
from mcp_budget_governor.producers.file_ledger import FileLedger, FileProjector
from testing.delay_proxy import DelayProxy, behind_proxy, target_of
from testing.ledger_run import run_cli
from testing.stores import backend_for, is_postgres, pending_of, store_args
from testing.stream_support import kafka
from testing.thread_server import ThreadServer

pytestmark = pytest.mark.slow
__all__ = ["kafka"]  # a fixture, used by name

#: How far away the store is (each reply's delay), and the spread of the cancel instants.
STORE_DELAY = 0.040
SPREAD = 0.050
CALLS = 200
PRICE = usd("0.01")


def sweep_policy() -> Policy:
    return Policy.of(
        Limit("one_at_a_time", cap=1, unit=Unit.CONCURRENT),  # global: one call at a time
        Limit("calls", cap=1_000_000, window=Window.DAY, scope=Scope.USER),
        Limit("spend", cap=usd(1000), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
    )


def user_from_meta(context: MiddlewareContext[Any]) -> Context | None:
    fc = context.fastmcp_context
    rc = fc.request_context if fc is not None else None
    user = (rc.meta or {}).get("user") if rc is not None else None
    return Context(user=user) if isinstance(user, str) else None


def build(governor: Governor) -> FastMCP:
    mcp = FastMCP("swept")
    mcp.add_middleware(BudgetMiddleware(governor, identify=user_from_meta))

    @mcp.tool(meta={"mcpbg": {"cost_usd": "0.01", "limit": "spend"}})
    async def work() -> str:
        await asyncio.sleep(0.005)
        return "done"

    return mcp


@pytest.fixture(params=["redis", "postgres"])
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A store's URL, and one whose every reply arrives ``STORE_DELAY`` late."""
    url: str = request.getfixturevalue(f"{request.param}_url")
    with DelayProxy(*target_of(url), delay=STORE_DELAY) as proxy:
        yield url, behind_proxy(url, proxy)


#: The TypeScript SDK client's sweep: fewer calls, a pause after each (it cannot read the
#: store to see the slot back), so a refusal by the previous call's lease stays rare.
TS_CLIENT_CALLS = 100
TS_CLIENT_PAUSE_MS = 120


@pytest.mark.parametrize("caller", ["python", "typescript"])
async def test_cancels_at_every_instant_pay_once_and_free_the_slot(
    stores: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], caller: str
) -> None:
    """The official Python client (200 calls, cancel scopes) or the TypeScript SDK client
    (``ts/test/cross/cancelClient.ts``: AbortSignal) against the Python server."""
    near_store, far_store = stores
    ledger_dir = tmp_path / "ledger"

    async def serve() -> tuple[Any, Governor]:
        backend = backend_for(far_store)
        if is_postgres(far_store):
            await backend.migrate()
        await backend.mark_ready("sweep")  # a ledger's counters must be marked ready
        gov = Governor(sweep_policy(), backend, ledger=FileLedger(ledger_dir))
        return build(gov).http_app(), gov

    server = await asyncio.to_thread(ThreadServer(serve).start)
    # The test reads the slot straight from the store: a read through the server's own
    # connections would queue its next check behind it.
    watch = Governor(sweep_policy(), backend_for(near_store))

    async def slot_taken() -> int:
        return await watch.usage("one_at_a_time")

    async def slot_freed(deadline: float) -> bool:
        # Far below lease_ttl (30 s): a lease left behind would hold the slot that long.
        end = time.monotonic() + deadline
        while await slot_taken():
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.01)
        return True

    cancelled: list[str] = []
    try:
        if caller == "typescript":
            cancelled = await typescript_sweep(f"{server.url}/mcp")
            assert await slot_freed(5.0), "the slot stayed taken"
        async with Client(f"{server.url}/mcp") as client:
            for i in range(CALLS if caller == "python" else 0):
                user = f"c{i:03d}"
                with anyio.move_on_after(SPREAD * i / (CALLS - 1)) as scope:
                    await client.call_tool("work", {}, meta={"user": user})
                if scope.cancelled_caught:
                    cancelled.append(user)
                # The cancelled call ends on the server on its own time: its slot is back
                # within a few round trips, never after the lease expires.
                assert await slot_freed(5.0), f"call {user}: the slot stayed taken"
            result = await client.call_tool("work", {}, meta={"user": "after"})
            assert not result.is_error, result  # the cap of 1 is free: the next call runs
    finally:
        await watch.aclose()
        await asyncio.to_thread(server.stop)  # closes the governor: the ledger is flushed

    events = [
        parse(line)
        for f in sorted(ledger_dir.glob("*.jsonl"))
        for line in f.read_bytes().splitlines()
    ]
    kinds: dict[str, Counter[str]] = {}
    spend_paid = 0
    for e in events:
        kinds.setdefault(e.data.context.user or "", Counter())[e.type.split(".")[1]] += 1
        spend_paid += sum(c.amount for c in e.data.charges if c.limit == "spend")
    admitted = [u for u, k in kinds.items() if k["admitted"]]
    for user, k in kinds.items():
        assert k["admitted"] <= 1 and k["metered"] == k["admitted"], (user, dict(k))
    assert spend_paid == PRICE * len(admitted)
    # The sweep reached both sides of the store's reply: calls cancelled before their check
    # reached the counters (no event), and calls admitted, then cancelled.
    admitted_then_cancelled = set(admitted) & set(cancelled)
    assert len(admitted_then_cancelled) >= 10, (len(admitted), len(cancelled))
    if caller == "python":  # a TypeScript call is sent before its abort timer can fire
        assert set(cancelled) - set(kinds), (len(kinds), len(cancelled))

    # Projected, nothing stays in flight, and reconcile finds no orphan and no drift.
    backend = backend_for(near_store)
    try:
        await FileProjector(ledger_dir, backend).catch_up()
    finally:
        await backend.aclose()
    code, out, err = run_cli(
        capsys, "reconcile", "--ledger-dir", str(ledger_dir), "--older-than", "0",
        "--json", *store_args(near_store),
    )  # fmt: skip
    assert code == 0, out + err
    report = json.loads(out)
    assert report["orphans"] == [] and not report.get("drift"), report
    for user in admitted:
        key = next(c.key for e in events for c in e.data.charges
                   if c.limit == "calls" and e.data.context.user == user)  # fmt: skip
        in_flight, _ = pending_of(near_store, key)
        assert in_flight == {}, (user, in_flight)


async def typescript_sweep(url: str) -> list[str]:
    """Run the TypeScript SDK client's sweep against ``url``; the users it cancelled."""
    from testing.node import TS_DIR, npm_ci, tsx

    npm_ci()
    proc = await asyncio.create_subprocess_exec(
        *tsx(), "test/cross/cancelClient.ts", url, str(TS_CLIENT_CALLS),
        str(SPREAD * 1000), str(TS_CLIENT_PAUSE_MS), "s",
        cwd=TS_DIR, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, out
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert len(lines) == TS_CLIENT_CALLS
    return [line["user"] for line in lines if line["cancelled"]]


# -- the same instants under the Governor's own API, many calls at once ---------------

#: Instants (seconds) a cancellation lands after a call starts: spread over the admission.
INSTANTS = [SPREAD * i / 39 for i in range(40)]


def per_user_policy() -> Policy:
    return Policy.of(
        Limit("mine", cap=1, scope=Scope.USER, unit=Unit.CONCURRENT),
        Limit("calls", cap=1_000_000, window=Window.DAY, scope=Scope.USER),
        Limit("spend", cap=usd(1000), window=Window.DAY, unit=Unit.USD_MICROS, gated=False),
    )


async def cancelled_at(instant: float, call: Any) -> bool:
    """Run ``call()``, cancelling it ``instant`` seconds in; whether it was cancelled."""
    task = asyncio.ensure_future(call())
    await asyncio.sleep(instant)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


def ledger_of(entries: list[Any]) -> dict[str, Counter[str]]:
    kinds: dict[str, Counter[str]] = {}
    for e in entries:
        kinds.setdefault(e.context.user or "", Counter())[str(e.type)] += 1
    return kinds


async def nothing_held(gov: Governor, users: list[str]) -> None:
    """Every user's slot is free (a leaked lease would hold it for lease_ttl, 30 s)."""
    for user in users:
        assert await gov.usage("mine", Context(user=user)) == 0, user


async def in_flight_has_events(store: str, gov: Governor, ledger: Any, users: list[str]) -> None:
    """Every in-flight amount the calls left has its ledger event: nothing is orphaned."""
    ids = {e.id for e in ledger.entries}
    for user in users:
        for limit in ("calls", "spend"):
            key = gov._read_slot(limit, Context(user=user)).key
            entries, _ = pending_of(store, key)
            assert set(entries) <= ids, (user, limit, entries)


@pytest.mark.parametrize("how", ["check", "admitted", "governed_call", "reserve", "wait"])
async def test_governor_cancels_at_every_instant(stores: tuple[str, str], how: str) -> None:
    from mcp_budget_governor.integrations.flow import governed_call
    from mcp_budget_governor.producers.memory_ledger import MemoryLedger

    near_store, far_store = stores
    backend = backend_for(far_store)
    if is_postgres(far_store):
        await backend.migrate()
    await backend.mark_ready("sweep")
    ledger = MemoryLedger()
    gov = Governor(per_user_policy(), backend, ledger=ledger)
    users = [f"{how}{i:02d}" for i in range(len(INSTANTS))]

    async def one(user: str) -> None:
        ctx = Context(user=user)
        if how == "check":
            decision = await gov.check(ctx)
            await gov.release(decision)
        elif how == "admitted":
            async with gov.admitted(ctx) as decision:
                decision.raise_for_status()
                await asyncio.sleep(0.005)
        elif how == "governed_call":
            await governed_call(
                gov, ctx, lambda: asyncio.sleep(0.005), fixed={"spend": PRICE},
                estimate={"spend": 3 * PRICE},
            )  # fmt: skip
        elif how == "reserve":
            held = await gov.reserve("spend", 3 * PRICE, ctx)
            await gov.settle(held, PRICE)
        else:  # a waiter behind a holder: cancelled, it leaves the queue
            async with gov.admitted(ctx, wait=5) as decision:
                decision.raise_for_status()

    watch = Governor(per_user_policy(), backend_for(near_store))  # reads, not 40 ms away
    await gov.release(await gov.check(Context(user="warm")))  # connected, scripts loaded
    holders = []
    if how == "wait":  # every user's slot taken, so every call waits
        holders = [await gov.check(Context(user=u)) for u in users]
    try:
        outcomes = await asyncio.gather(
            *(cancelled_at(t, lambda u=u: one(u)) for t, u in zip(INSTANTS, users, strict=True))
        )
        for holder in holders:
            await gov.release(holder)
        assert sum(outcomes) >= len(users) // 2  # most were cancelled mid-way
        await nothing_held(watch, users)
        await in_flight_has_events(near_store, watch, ledger, users)
        kinds = ledger_of(ledger.entries)
        for user in users:
            k = kinds.get(user, Counter())
            if how == "governed_call":  # the reservation settles to the fixed price
                closing = k["settled"] + k["metered"]
                assert closing == k["admitted"] and k["reserved"] <= k["admitted"], (user, k)
            if how in ("reserve", "governed_call"):
                assert k["reserved"] == k["settled"] + k["released"], (user, k)
        if how == "wait":  # nobody is left queued ahead: a new call is admitted at once
            for user in users:
                decision = await gov.check(Context(user=user), wait=0.5)
                assert decision.admitted, (user, decision)
                await gov.release(decision)
        if how == "governed_call":  # every admitted call paid its price once
            admitted = sum(kinds.get(u, Counter())["admitted"] for u in users)
            paid = sum(c.amount for e in ledger.entries for c in e.charges if c.limit == "spend")
            assert paid == PRICE * admitted
    finally:
        await watch.aclose()
        await gov.aclose()


# -- the TypeScript server (ts/test/cross/cancelServer.ts), the same sweep -----------

TS_POLICY = """
[[limits]]
name = "one_at_a_time"
cap = 1
unit = "concurrent"

[[limits]]
name = "calls"
cap = 1000000
window = "day"
scope = "user"

[[limits]]
name = "spend"
cap_usd = "1000"
window = "day"
scope = "user"
gated = false
"""


def ts_watch(near_store: str) -> Governor:
    """Reads the TypeScript server's counters straight from the store (not 40 ms away)."""
    return Governor(
        Policy.of(
            Limit("one_at_a_time", cap=1, unit=Unit.CONCURRENT),
            Limit("calls", cap=1_000_000, window=Window.DAY, scope=Scope.USER),
            Limit("spend", cap=usd(1000), window=Window.DAY, scope=Scope.USER,
                  unit=Unit.USD_MICROS, gated=False),
        ),
        backend_for(near_store),
    )  # fmt: skip


async def start_ts_server(
    tmp_path: Path, near_store: str, far_store: str, *ledger: str
) -> tuple[asyncio.subprocess.Process, int]:
    """``ts/test/cross/cancelServer.ts`` on ``far_store`` (``ledger``: its KafkaLedger's
    bootstrap, topic and outbox folder); the process and the port it listens on."""
    from testing.node import TS_DIR, prepare_driver, tsx

    prepare_driver()  # the packages, and the Lua and SQL copied into ts/
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text(TS_POLICY)
    if is_postgres(far_store):
        backend = backend_for(near_store)
        await backend.migrate()
        await backend.aclose()
    proc = await asyncio.create_subprocess_exec(
        *tsx(), "test/cross/cancelServer.ts", str(policy_file), far_store, *ledger,
        cwd=TS_DIR, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        return proc, json.loads(line)["port"]
    except BaseException:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
        raise


async def sweep_ts_server(port: int, watch: Governor, users: list[str]) -> list[str]:
    """Cancel a call of each of ``users`` at instants spread over ``SPREAD``, checking the
    global slot is free at once after each; then one more call runs. The users cancelled."""

    async def slot_freed() -> bool:
        end = time.monotonic() + 5.0  # far below lease_ttl (30 s)
        while await watch.usage("one_at_a_time"):
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.01)
        return True

    cancelled: list[str] = []
    async with Client(f"http://127.0.0.1:{port}/mcp", mode="legacy") as client:
        for i, user in enumerate(users):
            with anyio.move_on_after(SPREAD * i / (CALLS - 1)) as scope:
                await client.call_tool("work", {}, meta={"user": user})
            if scope.cancelled_caught:
                cancelled.append(user)
            assert await slot_freed(), f"call {user}: the slot stayed taken"
        result = await client.call_tool("work", {}, meta={"user": "after"})
        assert not result.is_error, result
    return cancelled


async def paid_once(watch: Governor, users: list[str]) -> list[str]:
    """Each user's counters hold one call and its price, or nothing; the admitted users."""
    admitted = []
    for user in users:
        calls = await watch.usage("calls", Context(user=user))
        paid = await watch.usage("spend", Context(user=user))
        assert calls in (0, 1) and paid == PRICE * calls, (user, calls, paid)
        if calls:
            admitted.append(user)
    return admitted


async def test_a_typescript_server_settles_every_cancel(
    stores: tuple[str, str], tmp_path: Path
) -> None:
    """The TypeScript SDK integration (``governTools``) in inline mode (no ledger: its
    charges are committed at once, so there is nothing in flight to orphan): every
    admitted call pays its price once, a refused or unchecked one nothing, and the
    global slot is free at once after each cancel."""
    near_store, far_store = stores
    proc, port = await start_ts_server(tmp_path, near_store, far_store)
    watch = ts_watch(near_store)
    users = [f"t{i:03d}" for i in range(CALLS)]
    try:
        cancelled = await sweep_ts_server(port, watch, users)
        admitted = await paid_once(watch, users)
        assert len(set(admitted) & set(cancelled)) >= 20, (len(admitted), len(cancelled))
        assert set(cancelled) - set(admitted)  # some cancelled before their check
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        await watch.aclose()


async def test_a_typescript_server_with_the_kafka_ledger_leaves_no_orphan(
    stores: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], kafka: Any
) -> None:
    """The same sweep with the TypeScript server's events in the TypeScript KafkaLedger
    (durable outbox, ``test/driverLedger.ts``): its charges stay in flight until the
    worker's projection (``Projector``, archived) commits them from the topic. Then
    every admitted call has one ``admitted`` and one ``metered`` event of its price,
    the counters equal the ledger, nothing is left in flight, and ``mcpbg reconcile
    --older-than 0`` finds no orphan and no drift."""
    from mcp_budget_governor.stream.archiver import Archiver
    from mcp_budget_governor.stream.projector import Projector
    from mcp_budget_governor.stream.topic_reader import read_topic

    near_store, far_store = stores
    topic = f"cancel-{uuid.uuid4().hex[:10]}"
    ledger = (kafka.bootstrap, topic, str(tmp_path / "outbox"))
    proc, port = await start_ts_server(tmp_path, near_store, far_store, *ledger)
    watch = ts_watch(near_store)
    users = [f"k{i:03d}" for i in range(CALLS)]
    try:
        cancelled = await sweep_ts_server(port, watch, users)
    finally:
        proc.terminate()  # closes the governor: the ledger ships its outbox
        code = await asyncio.wait_for(proc.wait(), 60)
    try:
        assert code == 0, code
        records = await read_topic(kafka.bootstrap, topic)
        assert records.caught_up and not records.malformed, records.highwater
        events = list({r.event.id: r.event for r in records}.values())  # at least once: by id
        kinds: dict[str, Counter[str]] = {}
        for e in events:
            kinds.setdefault(e.data.context.user or "", Counter())[e.type.split(".")[1]] += 1
        for user, k in kinds.items():
            assert k["admitted"] <= 1 and k["metered"] == k["admitted"], (user, dict(k))
        admitted = sorted(u for u, k in kinds.items() if k["admitted"] and u != "after")
        spend = sum(c.amount for e in events for c in e.data.charges if c.limit == "spend")
        assert spend == PRICE * (len(admitted) + 1)  # and the call after the sweep
        assert len(set(admitted) & set(cancelled)) >= 20, (len(admitted), len(cancelled))
        assert set(cancelled) - set(admitted)  # some cancelled before their check

        # The worker's projection, archived as the worker archives it.
        archive = tmp_path / "archive"
        letters: list[Any] = []
        backend = backend_for(near_store)
        projector = Projector(
            backend, topic, dlq=letters.append, archive=Archiver(archive, topic=topic).write_batch
        )
        try:
            by_partition: dict[int, list[tuple[int, bytes]]] = {}
            for r in records:
                raw = r.event.model_dump_json().encode()
                by_partition.setdefault(r.partition, []).append((r.offset, raw))
            for p, batch in sorted(by_partition.items()):
                await projector.apply_batch(p, batch)
        finally:
            await backend.aclose()
        assert letters == []
        # The counters are the ledger's: each admitted user one call and its price.
        assert await paid_once(watch, users) == admitted
        code, out, err = run_cli(
            capsys, "reconcile", "--archive-dir", str(archive), "--older-than", "0",
            "--json", *store_args(near_store),
        )  # fmt: skip
        assert code == 0, out + err
        report = json.loads(out)
        assert report["orphans"] == [] and not report.get("drift"), report
        for e in events:
            for c in e.data.charges:
                in_flight, total = pending_of(near_store, c.key)
                assert in_flight == {} and total == 0, (c.key, in_flight, total)
    finally:
        await watch.aclose()
