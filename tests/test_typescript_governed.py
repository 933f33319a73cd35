"""TypeScript governor -> TypeScript KafkaLedger -> Python ``mcpbg worker``, live.

A Node process (``ts/test/cross/governed.ts``) runs a TypeScript ``Governor`` with a
``RedisBackend`` and a ``KafkaLedger`` on the real broker: checks (admitted, and
refused past a cap) and metered costs, each reported on stdout as it completes. It is
SIGKILLed once mid-run, with events still unshipped in its outbox, and restarted on
the same outbox folder at the next operation. Then the Python worker projects the
topic: every counter equals what TypeScript reported admitted and metered, nothing is
left in flight, and each operation is exactly one event (a refusal too), but a call
admitted with its fixed price charged in the same round trip (``admitted``'s ``price``),
which is two: its admission and its cost, each moved out of flight under its own id;
and a hard-capped call, whose estimate the admission reserves (three: admitted,
reserved, settled to its price); the process is killed right after one, its
settle's reply never awaited.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from testing.node import TS_DIR, npm_ci, require_node
from testing.stream_support import (
    Stream,
    assert_exact,
    backend,
    engine,
    kafka,
    names,
    stream,
    unique_events,
    workers,
)

__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name

POLICY = """
[[limits]]
name = "burst"
cap = 6
window = "day"
scope = "user"

[[limits]]
name = "tenant_calls"
cap = 100000
window = "day"
scope = "tenant"

[[limits]]
name = "spend"
cap_usd = "100"
window = "day"
scope = "tenant"
gated = false
"""

USERS = [f"u{i}" for i in range(5)]
TENANTS = ["acme", "globex", "initech"]
N = 160
KILL_AFTER = 70


def _ops(rng: random.Random) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    for _ in range(N):
        ctx = {"user": rng.choice(USERS), "tenant": rng.choice(TENANTS)}
        draw = rng.random()
        if draw < 0.4:
            ops.append({"op": "check", "ctx": ctx})
        elif draw < 0.55:
            ops.append({"op": "priced", "price": {"spend": rng.randrange(1, 50_000)}, "ctx": ctx})
        elif draw < 0.65:
            price = rng.randrange(1, 50_000)
            ops.append({"op": "held", "estimate": {"spend": 50_000}, "price": {"spend": price},
                        "ctx": ctx})  # fmt: skip
        else:
            ops.append({"op": "meter", "limit": "spend", "amount": rng.randrange(1, 50_000),
                        "ctx": ctx})  # fmt: skip
    # The op the process is SIGKILLed right after: a hard-capped call of a fresh user
    # (admitted), whose settle was written without its reply awaited.
    ops[KILL_AFTER] = {"op": "held", "estimate": {"spend": 50_000}, "price": {"spend": 1_234},
                       "ctx": {"user": "killed", "tenant": TENANTS[0]}}  # fmt: skip
    return ops


def _run(argv: list[str], log: Path) -> tuple[int, list[dict[str, Any]]]:
    with log.open("wb") as err:
        proc = subprocess.run(argv, cwd=TS_DIR, stdout=subprocess.PIPE, stderr=err, timeout=180)
    return proc.returncode, [json.loads(line) for line in proc.stdout.decode().splitlines()]


async def _sum(stream: Stream, limit: str, scope: str) -> int:
    """The committed total of one limit and scope value over all its buckets."""
    keys = await stream.backend.counter_keys(1000, match=f"mcpbg:v1:{limit}:{scope}:*")
    total = 0
    for key in keys:
        state = await stream.backend.state(key)
        assert (state.in_flight, state.pending) == (0, {}), key
        total += state.committed
    return total


@pytest.fixture(scope="module")
def node() -> str:
    require_node()
    npm_ci()
    subprocess.run(["node", "scripts/copy-lua.mjs"], cwd=TS_DIR, check=True)
    path = shutil.which("node")
    assert path is not None
    return path


@pytest.mark.slow
async def test_typescript_governor_events_are_projected_exactly_once(
    stream: Stream, node: str
) -> None:
    policy = stream.tmp_path / "policy.toml"
    policy.write_text(POLICY, encoding="utf-8")
    ops = _ops(random.Random(11))
    ops_file = stream.tmp_path / "ops.json"
    ops_file.write_text(json.dumps(ops), encoding="utf-8")
    outbox = stream.tmp_path / "ts-outbox"

    def argv(start: int, *kill: str) -> list[str]:
        # node with tsx's loader, one process: the SIGKILL hits the process that appends.
        return [node, "--import", "tsx", "test/cross/governed.ts", str(policy),
                stream.redis_url, stream.kafka.bootstrap, stream.topic, str(outbox),
                str(ops_file), str(start), *kill]  # fmt: skip

    code, first = _run(argv(0, str(KILL_AFTER)), stream.tmp_path / "governed-0.log")
    assert code == -signal.SIGKILL, (code, first[-3:])
    killing = first[-1]
    assert killing["killing"] == KILL_AFTER
    assert [r["unshipped"] for r in first if "shipped" in r] == [0]  # half way: all shipped
    assert killing["unshipped"] > 0  # the restart has events of the killed run to ship
    code, second = _run(argv(KILL_AFTER + 1), stream.tmp_path / "governed-1.log")
    log = (stream.tmp_path / "governed-1.log").read_text(errors="replace")
    assert code == 0, log
    assert second[-1] == {"closed": 0}, (second[-3:], log)
    reports = [r for r in first + second if "i" in r]
    assert [r["i"] for r in reports] == list(range(N))  # every operation reported once
    assert reports[KILL_AFTER] == {"i": KILL_AFTER, "status": 200}  # killed right after its settle

    # What TypeScript said it did, per limit and scope value.
    want: Counter[tuple[str, str]] = Counter()
    refused = metered = priced = held = 0
    for op, report in zip(ops, reports, strict=True):
        user, tenant = op["ctx"]["user"], op["ctx"]["tenant"]
        if op["op"] == "meter":
            want["spend", f"tenant={tenant}"] += op["amount"]
            metered += 1
        elif report["status"] == 200:
            want["burst", f"user={user}"] += 1
            want["tenant_calls", f"tenant={tenant}"] += 1
            if op["op"] == "priced":
                assert report["paid"] is True, report
                want["spend", f"tenant={tenant}"] += op["price"]["spend"]
                priced += 1
            elif op["op"] == "held":
                want["spend", f"tenant={tenant}"] += op["price"]["spend"]
                held += 1
        else:
            assert report["status"] == 429, report
            refused += 1
    assert refused > 0  # some users went past burst = 6
    assert priced > 0 and held > 0
    assert sum(want["burst", f"user={u}"] for u in USERS) < N

    stream.start_worker()
    records = await stream.caught_up()
    events = unique_events(records)
    # One event per operation, a priced admission two, a held one three, a re-sent one
    # counted once.
    extra = priced + 2 * held
    assert len(events) == N + extra
    assert len(records) >= N + extra
    kinds = Counter(e.type for e in events)
    assert kinds == {"mcpbg.admitted.v1": N - refused - metered, "mcpbg.rejected.v1": refused,
                     "mcpbg.metered.v1": metered + priced, "mcpbg.reserved.v1": held,
                     "mcpbg.settled.v1": held}, kinds  # fmt: skip
    assert await assert_exact(stream.backend, records) == N + extra
    got = {(limit, scope): await _sum(stream, limit, scope) for limit, scope in want}
    assert got == dict(want)
    print(
        f"{N} TypeScript operations ({refused} refused), killed after op {KILL_AFTER} with "
        f"{killing['unshipped']} events unshipped; {len(records)} records, {len(events)} "
        f"events; counters = what TypeScript admitted and metered"
    )
