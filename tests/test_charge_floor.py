"""``testing/charge_floor.lua`` makes the very Redis commands ``lua/charge.lua`` makes.

The benchmarks (``benchmarks/bench_lua.py``, ``ts/bench/check.ts``) quote the floor
script as what charge.lua's Redis work costs without its logic; that only holds while
the two issue the same commands. Each runs once, alone, on a private Redis, and the
commands each made from Lua are counted (INFO commandstats).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from benchmarks import bench_lua
from mcp_budget_governor.lua import source
from testing.services import start_redis

FLOOR = Path(__file__).resolve().parents[1] / "testing" / "charge_floor.lua"


@pytest.fixture(scope="module")
def private_url() -> Iterator[str]:
    service = start_redis(prefer_local=True)  # commandstats are the server's: no one else's calls
    try:
        yield service.url
    finally:
        service.stop()


def commands_made(client: redis.Redis, script: str, args: list[Any]) -> dict[str, int]:
    sha = client.script_load(script)
    client.config_resetstat()
    reply = client.evalsha(sha, *args)
    stats: dict[str, Any] = client.info("commandstats")
    made = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    made = {k: n for k, n in made.items() if k.split("|")[0] not in ("evalsha", "config", "info")}
    assert isinstance(reply, list) and reply[0] == 0, reply
    return made


def test_the_floor_makes_charge_luas_commands(private_url: str) -> None:
    client = redis.Redis.from_url(private_url)
    port = client.connection_pool.connection_kwargs["port"]
    args = asyncio.run(bench_lua.plan_args(port, "inline"))  # bench_lua's own arguments
    charge = commands_made(client, source("charge"), args())
    floor = commands_made(client, FLOOR.read_text("utf-8"), args())  # a fresh operation id
    assert charge == {"set": 1, "hmget": 3, "hget": 3, "hincrby": 3}
    assert floor == charge
