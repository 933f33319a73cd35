"""The shared auto-pipelined connection: replies matched back under concurrency, failures clean."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis

from mcp_budget_governor import RedisBackend
from mcp_budget_governor.counters import CounterOp
from mcp_budget_governor.errors import BackendUnavailableError
from mcp_budget_governor.projections.counters.autopipe import Address, Pipe, _PyReader, pack

FAR = 4_102_444_800


async def test_concurrent_charges_share_writes_and_get_their_own_replies(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    keys = [f"mcpbg:v1:ap:user=u{i}:m1" for i in range(50)]
    try:
        for _ in range(2):
            results = await asyncio.gather(
                *(
                    backend.charge([CounterOp(k, i + 1, 10**9, True, FAR)])
                    for i, k in enumerate(keys)
                )
            )
            assert all(r.admitted for r in results)
        # Each caller read its own counter's total (before the charge), not a neighbour's.
        results = await asyncio.gather(
            *(backend.charge([CounterOp(k, 0, 10**9, True, FAR)]) for k in keys)
        )
        assert [r.used for r in results] == [(2 * (i + 1),) for i in range(50)]
        assert await backend.usage(keys) == [2 * (i + 1) for i in range(50)]
    finally:
        await backend.client.delete(*keys)
        await backend.aclose()


async def test_a_silent_server_times_out_every_call_in_flight() -> None:
    """A server that accepts and never answers: each call fails within the timeout."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", timeout=0.2)
    try:
        op = CounterOp("mcpbg:v1:ap:user=u:m1", 1, 10, True, FAR)
        outcomes = await asyncio.gather(
            *(backend.charge([op]) for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(o, BackendUnavailableError) for o in outcomes)
    finally:
        await backend.aclose()
        server.close()


async def test_a_refused_connection_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", timeout=0.2)
    with pytest.raises(BackendUnavailableError):
        await backend.charge([CounterOp("mcpbg:v1:ap:user=u:m1", 1, 10, True, FAR)])
    await backend.aclose()


async def test_a_restarted_connection_is_picked_up(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    key = "mcpbg:v1:ap:user=r:m1"
    try:
        assert (await backend.charge([CounterOp(key, 1, 10, True, FAR)])).admitted
        await backend.client.client_kill_filter(skipme=True, _type="normal")
        await asyncio.sleep(0.05)
        # The dead connection fails at most the call in flight; the next reconnects.
        for _ in range(3):
            try:
                await backend.charge([CounterOp(key, 1, 10, True, FAR)])
                break
            except BackendUnavailableError:
                continue
        assert (await backend.charge([CounterOp(key, 0, 10, True, FAR)])).admitted
    finally:
        await backend.client.delete(key)
        await backend.aclose()


def test_the_python_reader_parses_what_redis_sends() -> None:
    reader = _PyReader()
    data = b"*3\r\n:1\r\n$3\r\nabc\r\n*2\r\n$-1\r\n+OK\r\n-ERR bad\r\n"
    reader.feed(data[:7])
    assert reader.gets() is False
    reader.feed(data[7:])
    assert reader.gets() == [1, b"abc", [None, b"OK"]]
    assert str(reader.gets()) == "ERR bad"
    assert reader.gets() is False


async def test_auth_and_select_come_first(redis_url: str) -> None:
    address = Address.of_client(RedisBackend.from_url(redis_url[:-1] + "3").client)
    assert address is not None and address.db == 3
    pipe = Pipe(address, 2.0)
    try:
        assert await pipe.call(pack(["SET", "mcpbg:test:ap", "x"])) == b"OK"
        assert await pipe.call(pack(["GET", "mcpbg:test:ap"])) == b"x"
        assert await pipe.call(pack(["DEL", "mcpbg:test:ap"])) == 1
    finally:
        pipe.close()


async def test_a_meter_behind_is_seen_by_the_next_check_without_waiting(redis_url: str) -> None:
    from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window

    policy = Policy.of(Limit("ap_spend", cap=10, window=Window.DAY, scope=Scope.USER))
    gov = Governor(policy, RedisBackend.from_url(redis_url, timeout=2.0))
    ctx = Context(user="mb")
    try:
        assert (await gov.check(ctx)).admitted  # connected
        for _ in range(10):
            await gov.meter_behind({"ap_spend": 1}, ctx)
        # Written in order on the shared connection: this check comes after all ten.
        assert not (await gov.check(ctx)).admitted
        assert await gov.usage("ap_spend", ctx) == 11  # the first check counted one call
    finally:
        await gov.aclose()


async def test_a_meter_behind_that_fails_is_kept_for_later() -> None:
    """Redis gone after the write: the charge is kept and replayed, as a waited one would be."""
    from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window

    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    policy = Policy.of(Limit("ap_spend", cap=10, window=Window.DAY, scope=Scope.USER))
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", timeout=0.2)
    gov = Governor(policy, backend)
    try:
        await backend._pipe()._connect()
        await gov.meter_behind({"ap_spend": 3}, Context(user="mb"))
        await asyncio.gather(*gov._detached)
        assert len(gov._outage.pending) == 1 and gov._outage.pending[0][1][0].amount == 3
    finally:
        server.close()
        gov._outage.pending.clear()
        await gov.aclose()


def test_a_backend_used_by_one_asyncio_run_after_another_reconnects(redis_url: str) -> None:
    backend = RedisBackend.from_url(redis_url, timeout=2.0)
    key = "mcpbg:v1:ap:user=runs:m1"
    for _ in range(3):
        assert asyncio.run(backend.charge([CounterOp(key, 1, 10, True, FAR)])).admitted
    assert asyncio.run(backend.usage([key])) == [3]
    sync = redis.Redis.from_url(redis_url)
    sync.delete(key)
    sync.close()
