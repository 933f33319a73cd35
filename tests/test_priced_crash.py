"""Nothing after the tool waits on the store (issue 33), and nothing is lost for it: a
process killed (SIGKILL) right after its last governed call returned has every
ledger event of its calls in the file ledger, fixed prices charged with their
admission and hard caps settled without awaiting the store's reply alike; once
projected, the counters equal the ledger and nothing is left in flight."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Unit, Window
from mcp_budget_governor.producers.file_ledger import FileProjector

CHILD = """
import asyncio, os, signal, sys
from mcp_budget_governor import Context, Governor, Limit, Policy, RedisBackend, Unit, Window, usd
from mcp_budget_governor.integrations.flow import governed_call
from mcp_budget_governor.producers.file_ledger import FileLedger

folder, redis_url = sys.argv[1:3]

async def main():
    policy = Policy.of(
        Limit("calls", cap=10**6, window=Window.DAY),
        Limit("spend", cap=usd(1000), window=Window.DAY, unit=Unit.USD_MICROS, scope="user"),
    )
    gov = Governor(policy, RedisBackend.from_url(redis_url, timeout=5.0), ledger=FileLedger(folder))
    async def work():
        return 1
    for i in range(150):
        ctx = Context(user=f"u{i % 3}", tool="t")
        if i % 2:  # a fixed price, charged with the admission
            await governed_call(gov, ctx, work, fixed={"spend": 1000 + i})
        else:  # a hard cap: reserved with the admission, settled after, reply not awaited
            await governed_call(gov, ctx, work, estimate={"spend": 5000}, fixed={"spend": 2000 + i})
    os.kill(os.getpid(), signal.SIGKILL)  # the last settle's reply never awaited

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_process_killed_after_its_calls_loses_no_charge(redis_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "ledger"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), redis_url],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr.decode(errors="replace")[-2000:]
    events = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.open()]
    kinds = [e["type"].split(".")[1] for e in events]
    assert kinds.count("admitted") == 150
    assert kinds.count("metered") == kinds.count("reserved") == kinds.count("settled") == 75
    owed: dict[str, int] = {}
    for e in events:
        for c in e["data"]["charges"]:
            if c["limit"] == "spend":
                owed[e["data"]["context"]["user"]] = (
                    owed.get(e["data"]["context"]["user"], 0) + c["amount"]
                )
    # What the calls cost: every fixed price once, every hard cap settled to its price.
    assert sum(owed.values()) == sum(1000 + i if i % 2 else 2000 + i for i in range(150))

    async def project() -> dict[str, tuple[int, int]]:
        backend = RedisBackend.from_url(redis_url)
        policy = Policy.of(
            Limit("spend", cap=10**12, window=Window.DAY, unit=Unit.USD_MICROS, scope="user")
        )
        gov = Governor(policy, backend)
        await FileProjector(folder, backend).catch_up()
        out = {}
        for user in owed:
            state = await backend.state(gov._read_slot("spend", Context(user=user)).key)
            out[user] = (state.committed, state.in_flight)
        await gov.aclose()
        return out

    counters = asyncio.run(project())
    assert counters == {user: (amount, 0) for user, amount in owed.items()}
