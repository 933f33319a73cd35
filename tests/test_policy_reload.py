"""Policy reload: the pure rule, the watcher (mtime polling and SIGHUP), the governor's
swap point on both backends, and the worker and the example server picking up a
changed file as subprocesses on real Redis and Kafka."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    InvalidInputError,
    Limit,
    Policy,
    PolicyError,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.planning import slot
from mcp_budget_governor.policy_reload import (
    PolicyWatcher,
    Stamp,
    due,
    load_or_keep,
    poll_interval,
    watcher_for,
)
from testing.example_server import ExampleServer, example_server
from testing.services import KafkaService
from testing.stream_support import Names, Worker, kafka, names, worker_argv, worker_env, workers

__all__ = ["kafka", "names", "workers"]  # fixtures, imported for pytest

ROOT = Path(__file__).resolve().parent.parent
U1 = Context(user="u1", tenant="acme")


def policy_text(cap: int, *, extra: str = "") -> str:
    return textwrap.dedent(
        f"""\
        [[limits]]
        name = "calls"
        cap = {cap}
        window = "day"
        scope = "user"
        {extra}
        """
    )


BAD = '[[limits]]\nname = "calls"\ncap = 3\n\nwindow = "fortnight"\nscope = "user"\n'


def write(path: Path, text: str) -> None:
    """Replace the file as editors and config managers do: a new file renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def wait_until(condition: object, what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within}s: {what}")
        await asyncio.sleep(0.02)


# -- the pure rule --------------------------------------------------------------


def test_due_and_load_or_keep() -> None:
    a = Stamp(1, 10, 5, 1)
    assert not due(a, a) and not due(None, None) and not due(a, None)
    assert due(a, Stamp(1, 11, 5, 1)) and due(a, Stamp(1, 10, 6, 1)) and due(None, a)
    assert due(a, None, forced=True)
    old = Policy.of(Limit("x", cap=1, window=Window.DAY))
    new = Policy.of(Limit("x", cap=2, window=Window.DAY))
    assert load_or_keep(old, lambda: new).policy is new
    assert load_or_keep(old, lambda: new).reloaded
    same = load_or_keep(old, lambda: Policy.of(Limit("x", cap=1, window=Window.DAY)))
    assert not same.reloaded and same.error is None

    def refuse() -> Policy:
        raise PolicyError("limits[0].cap", -1, "must not be negative")

    kept = load_or_keep(old, refuse)
    assert kept.policy is old and not kept.reloaded and kept.error is not None


def test_poll_interval_names_a_bad_value() -> None:
    assert poll_interval({"MCPBG_POLICY_POLL": "0"}) == 0
    for bad in ("-1", "soon", "1e9"):
        with pytest.raises(InvalidInputError) as exc:
            poll_interval({"MCPBG_POLICY_POLL": bad})
        # the value as read: the text, or the number it was converted to
        assert exc.value.field == "MCPBG_POLICY_POLL"
        assert exc.value.value in (bad, float(bad) if bad != "soon" else bad)


def test_only_files_are_watched(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(policy_text(3))
    current = Policy.from_file(path)
    assert watcher_for("tests.workers:policy", print, current) is None
    assert watcher_for(None, print, current) is None
    watcher = watcher_for(str(path), print, current, 0)
    assert watcher is not None and watcher.interval is None


# -- the watcher ------------------------------------------------------------------


def test_a_changed_file_is_applied_once_and_an_invalid_one_keeps_the_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(policy_text(3))
    applied: list[Policy] = []
    watcher = PolicyWatcher(path, applied.append, interval=None)
    assert watcher.check() is None  # unchanged: not even read
    write(path, policy_text(5))
    outcome = watcher.check()
    assert outcome is not None and outcome.reloaded
    assert [p["calls"].cap for p in applied] == [5] and watcher.policy["calls"].cap == 5
    assert watcher.check() is None
    write(path, BAD)
    with caplog.at_level(logging.ERROR, logger="mcp_budget_governor.policy"):
        outcome = watcher.check()
    assert outcome is not None and not outcome.reloaded
    assert watcher.policy["calls"].cap == 5 and len(applied) == 1
    (record,) = [r for r in caplog.records if r.name == "mcp_budget_governor.policy"]
    message = record.getMessage()
    assert f"{path}:5: limits[0].window: unknown Window" in message
    assert "kept the previous policy" in message
    assert (record.policy_field, record.policy_line) == ("limits[0].window", 5)  # type: ignore[attr-defined]
    assert watcher.check() is None  # the bad version is reported once, not every poll
    path.unlink()
    assert watcher.check() is None  # gone (mid-deploy): quietly keep the policy
    forced = watcher.check(force=True)
    assert forced is not None and forced.error is not None and "no such file" in str(forced.error)
    write(path, policy_text(5))  # back to what is in force: nothing to apply
    outcome = watcher.check()
    assert outcome is not None and not outcome.reloaded and len(applied) == 1


async def test_polling_picks_up_a_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(policy_text(3))
    applied: list[Policy] = []
    async with PolicyWatcher(path, applied.append, interval=0.05) as watcher:
        write(path, policy_text(7))
        await wait_until(lambda: applied, "the new file applied by polling")
        assert watcher.reloads == 1 and applied[0]["calls"].cap == 7
    assert watcher._task is None


def test_sighup_reloads_in_a_subprocess(tmp_path: Path) -> None:
    """A process whose watcher only listens for SIGHUP (no polling) reloads when sent one."""
    path = tmp_path / "policy.toml"
    path.write_text(policy_text(3))
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from mcp_budget_governor.policy_reload import PolicyWatcher

        async def main():
            done = asyncio.Event()
            def apply(policy):
                print("cap", policy["calls"].cap, flush=True)
                done.set()
            async with PolicyWatcher({str(path)!r}, apply, interval=None):
                print("ready", flush=True)
                await done.wait()

        asyncio.run(main())
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        write(path, policy_text(11))
        proc.send_signal(signal.SIGHUP)
        assert proc.stdout.readline().strip() == "cap 11"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the governor's swap point, on both backends --------------------------------


async def test_replace_policy_keeps_counters_and_held_reservations(backend: Backend) -> None:
    tag = uuid.uuid4().hex[:8]
    calls = Limit(f"calls_{tag}", cap=5, window=Window.DAY, scope=Scope.USER)
    spend = Limit(f"spend_{tag}", cap=1000, window=Window.DAY, scope=Scope.USER, unit=Unit.TOKENS)
    gov = Governor(Policy.of(calls, spend), backend)
    assert [(await gov.check(U1)).admitted for _ in range(3)] == [True] * 3
    held = await gov.reserve(spend.name, 400, U1)
    # Lower the cap and drop the spend limit while the reservation is held.
    old = gov.replace_policy(Policy.of(Limit(calls.name, cap=3, window=Window.DAY, scope="user")))
    assert old.limits == (calls, spend)
    refusal = await gov.check(U1)  # 3 already counted: the lower cap refuses, nothing undone
    assert not refusal.admitted and refusal.limit == calls.name
    assert await gov.usage(calls.name, U1) == 3
    # The reservation settles on its own counter although its limit is gone.
    await gov.settle(held, 250)
    gov.replace_policy(Policy.of(calls, spend))
    assert await gov.usage(spend.name, U1) == 250
    assert (await gov.check(U1)).admitted  # the cap back at 5
    with pytest.raises(InvalidInputError):
        gov.replace_policy("policy.toml")  # type: ignore[arg-type]
    gov.replace_policy(Policy.of(calls))
    with pytest.raises(PolicyError, match="no such limit"):
        await gov.meter(spend.name, 1, U1)
    await gov.aclose()


async def test_a_tenants_billing_day_set_at_run_time_by_the_reloaded_file(
    backend: Backend, tmp_path: Path
) -> None:
    """Issue 11's per-tenant anchor set at run time: the file's `anchors` changed and
    reloaded (as every replica does, by poll or SIGHUP) moves that tenant's monthly
    period to its billing day at once; the other tenants keep the calendar month."""
    tag = uuid.uuid4().hex[:8]

    def text(anchors: str) -> str:
        return textwrap.dedent(
            f"""\
            [[limits]]
            name = "month_{tag}"
            cap = 2
            window = "month"
            scope = "tenant"
            {anchors}
            """
        )

    path = tmp_path / "policy.toml"
    path.write_text(text(""))
    watcher = PolicyWatcher(path, lambda p: gov.replace_policy(p), interval=None)
    gov = Governor(watcher.policy, backend)
    acme, beta = Context(tenant="acme"), Context(tenant="beta")
    assert [(await gov.check(acme)).admitted for _ in range(3)] == [True, True, False]
    assert [(await gov.check(beta)).admitted for _ in range(3)] == [True, True, False]
    # acme now bills from the 15th: its period (from the last 15th) is a new bucket
    # (label YYYYMM+15, not the calendar month's YYYYMM), with room.
    write(path, text("anchors = { acme = 15 }"))
    outcome = watcher.check()
    assert outcome is not None and outcome.reloaded
    lim = gov.policy[f"month_{tag}"]
    assert lim.anchor_for(("acme",)) == 15 and lim.anchor_for(("beta",)) == 1
    acme_slot = slot(lim, acme, time.time(), gov.policy.tz, 1, enforce=True)
    assert acme_slot is not None and acme_slot.key.endswith("+15"), acme_slot
    assert [(await gov.check(acme)).admitted for _ in range(3)] == [True, True, False]
    assert not (await gov.check(beta)).admitted  # beta: still the calendar month, spent
    keys = {k: v["total"] for k, v in (await gov.status(acme)).items()}
    assert keys == {f"month_{tag}": 2}
    await gov.aclose()


# -- the worker and the example server, as processes ------------------------------

LEVELS = policy_text(100, extra="alert_at = [50]")


@pytest.mark.slow
def test_the_worker_reloads_on_sighup(
    workers: list[Worker], kafka: KafkaService, redis_url: str, names: Names, tmp_path: Path
) -> None:
    """SIGHUP only (``MCPBG_POLICY_POLL=0``): each reload is the signal's doing."""
    path = tmp_path / "policy.toml"
    path.write_text(LEVELS)
    env = worker_env(tmp_path)
    env.update(
        MCPBG_KAFKA_URL=f"kafka://{kafka.bootstrap}",
        MCPBG_REDIS_URL=redis_url,
        MCPBG_POLICY=str(path),
        MCPBG_POLICY_POLL="0",
    )
    argv = worker_argv(names.topic, names.group, "--topic-wait", "20", "--partitions", "1")
    worker = Worker("reload", tmp_path / "worker.log", argv, env)
    workers.append(worker)
    wait_log(worker, "projector: assigned")
    write(path, policy_text(100, extra="alert_at = [10, 50]"))
    worker.proc.send_signal(signal.SIGHUP)
    wait_log(worker, f"policy: reloaded {path} (1 limits)")
    write(path, BAD)
    worker.proc.send_signal(signal.SIGHUP)
    wait_log(worker, f"policy: kept the previous policy, {path} is invalid: {path}:5: limits[0]")
    assert worker.text().count("policy: reloaded") == 1
    assert worker.proc.poll() is None, worker.tail()
    assert worker.terminate() == 0


def wait_log(worker: Worker, text: str, *, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while text not in worker.text():
        if worker.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in the worker's log\n{worker.tail()}")
        time.sleep(0.1)


SERVER_POLICY = """\
anonymous = "shared"

[[limits]]
name = "burst"
cap = 3
window = "minute"
scope = "user"

[[limits]]
name = "user_spend"
cap_usd = "1.00"
window = "day"
scope = "user"
"""
ONE_LIMIT = SERVER_POLICY.split('\n\n[[limits]]\nname = "user_spend"')[0] + "\n"


@pytest.fixture
def server(tmp_path: Path, redis_url: str, kafka: KafkaService) -> Iterator[ExampleServer]:
    """examples/server.py on a free port, polling its policy every 0.2 s."""
    with example_server(
        tmp_path, SERVER_POLICY, redis_url, kafka.bootstrap, MCPBG_POLICY_POLL="0.2"
    ) as srv:
        srv.wait_health('"limits":2')
        yield srv


@pytest.mark.slow
def test_the_example_server_reloads_its_policy(server: ExampleServer) -> None:
    write(server.policy, ONE_LIMIT)  # picked up by polling
    server.wait_health('"limits":1')
    write(server.policy, BAD)
    server.wait_log(f"{server.policy}:5: limits[0].window: unknown Window")
    server.wait_health('"limits":1')  # the previous policy stays
    write(server.policy, SERVER_POLICY)
    server.proc.send_signal(signal.SIGHUP)  # handled: a reload, not the default (terminate)
    server.wait_health('"limits":2')
    assert server.proc.poll() is None


async def test_an_integration_follows_the_replaced_policy(backend: Backend) -> None:
    """The ASGI middleware reads ``governor.policy`` per request: a reload needs no rewiring."""
    import httpx2 as httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from mcp_budget_governor.integrations.asgi import BudgetASGIMiddleware

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    name = f"calls_{uuid.uuid4().hex[:8]}"
    gov = Governor(Policy.of(Limit(name, cap=5, window=Window.DAY, scope="user")), backend)
    app = BudgetASGIMiddleware(
        Starlette(routes=[Route("/hello", hello)]),
        gov,
        identify=lambda scope: Context(user="u1"),
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert [(await client.get("/hello")).status_code for _ in range(2)] == [200, 200]
        gov.replace_policy(Policy.of(Limit(name, cap=2, window=Window.DAY, scope="user")))
        assert (await client.get("/hello")).status_code == 429
        gov.replace_policy(Policy.of(Limit(name, cap=4, window=Window.DAY, scope="user")))
        assert (await client.get("/hello")).status_code == 200
    await gov.aclose()
