"""Alerts: threshold crossings and breaker trips, once per limit, scope, bucket and level.

The evaluator runs on both backends (``backend`` fixture: memory and a real
Redis); dedupe goes through the matching store (:class:`MemoryDeduper`, or
:class:`RedisDeduper` on fresh connections to the same Redis, which is what a
restarted or second worker has). The webhook sink talks to a real HTTP server
on 127.0.0.1 in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import orjson
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from mcp_budget_governor import (
    Backend,
    BackendUnavailableError,
    Context,
    InvalidInputError,
    Limit,
    MemoryBackend,
    OnExceed,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
)
from mcp_budget_governor.counters import CounterOp
from mcp_budget_governor.events import MalformedEventError
from mcp_budget_governor.ledger import LedgerCharge
from mcp_budget_governor.planning import slot
from mcp_budget_governor.stream.alerts import (
    ALERT_TYPE,
    Alert,
    AlertDeliveryError,
    AlertDispatcher,
    AlertEvaluator,
    AlertSink,
    Deduper,
    LogSink,
    Mark,
    MemoryDeduper,
    RedisDeduper,
    TopicSink,
    WebhookSink,
    alert_levels,
    marker_key,
    parse_alert,
)

LOGGER = "mcp_budget_governor.stream.alerts"
DAY = 86_400

SPEND = Limit(
    "spend",
    cap=1000,
    window=Window.DAY,
    scope=Scope.USER,
    unit=Unit.USD_MICROS,
    gated=False,
    alert_at=(50, 80, 100),
)
BREAKER = Limit(
    "global_spend", cap=500, window=Window.DAY, unit=Unit.USD_MICROS, breaker=True, gated=False
)
SHADOW = Limit(
    "shadow_calls", cap=10, window=Window.DAY, scope=Scope.USER, on_exceed=OnExceed.ALERT
)
SHADOW_LEVELS = Limit(
    "shadow_levels",
    cap=10,
    window=Window.DAY,
    scope=Scope.USER,
    on_exceed=OnExceed.ALERT,
    alert_at=(50,),
)
QUIET = Limit("per_user", cap=10, window=Window.DAY, scope=Scope.USER)
POLICY = Policy.of(SPEND, BREAKER, SHADOW, SHADOW_LEVELS, QUIET)
ALICE = Context(user="alice")
BOB = Context(user="bob")


async def spend(
    backend: Backend, limit: Limit, amount: int, *, ctx: Context = ALICE, now: float | None = None
) -> LedgerCharge:
    """Charge ``amount`` to ``limit``'s counter (committed) and return the ledger charge."""
    s = slot(limit, ctx, time.time() if now is None else now, UTC, amount, enforce=False)
    assert s is not None
    await backend.charge([s.op])
    return s.ledger_charge()


def levels(alerts: Sequence[Alert]) -> list[tuple[str, str, int]]:
    return [(a.limit, a.kind, a.level) for a in alerts]


@pytest.fixture
async def store(
    backend: Backend, request: pytest.FixtureRequest
) -> AsyncIterator[Callable[[], Deduper]]:
    """Dedupers over one shared store: each call is what another (or a restarted) worker has."""
    if not isinstance(backend, RedisBackend):
        shared = MemoryDeduper()
        yield lambda: shared
        return
    url = request.getfixturevalue("redis_url")
    clients: list[aioredis.Redis] = []

    def make() -> Deduper:
        client = aioredis.Redis.from_url(url)
        clients.append(client)
        return RedisDeduper(client)

    yield make
    for client in clients:
        await client.aclose()


def evaluator(backend: Backend, dedupe: Deduper, **kwargs: Any) -> AlertEvaluator:
    return AlertEvaluator(POLICY, backend, dedupe=dedupe, **kwargs)


class CountingBackend:
    """Delegates to a backend and records every ``usage`` call."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.reads: list[list[str]] = []

    async def usage(self, keys: Sequence[str]) -> list[int]:
        self.reads.append(list(keys))
        return await self.inner.usage(keys)


# -- thresholds ---------------------------------------------------------------


async def test_each_level_fires_once_as_it_is_crossed(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    ev = evaluator(backend, store())
    steps = [(400, []), (100, [50]), (300, [80]), (150, []), (50, [100]), (10, [])]
    for amount, expected in steps:
        charge = await spend(backend, SPEND, amount)
        fired = await ev.evaluate([charge])
        assert [a.level for a in fired] == expected, amount
        assert await ev.evaluate([charge]) == []  # the same state again: nothing
    assert ev.fired == 3


async def test_a_jump_fires_every_level_crossed_once_in_order(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    ev = evaluator(backend, store())
    before = time.time()
    assert await ev.evaluate([await spend(backend, SPEND, 100)]) == []
    charge = await spend(backend, SPEND, 1100)
    fired = await ev.evaluate([charge, charge])
    assert [a.level for a in fired] == [50, 80, 100]
    assert {(a.limit, a.kind) for a in fired} == {("spend", "threshold")}
    for alert in fired:
        assert alert.used == 1200 and alert.cap == 1000
        assert alert.unit is Unit.USD_MICROS and alert.window is Window.DAY
        assert alert.scope == "user=alice" and alert.key == charge.key
        assert alert.bucket == charge.bucket and not alert.shadow
        assert before <= alert.at <= time.time()
    assert len({a.id for a in fired}) == 3
    assert await ev.evaluate([charge]) == []


async def test_a_restarted_worker_fires_nothing_again(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    first = evaluator(backend, store())
    charge = await spend(backend, SPEND, 600)
    assert [a.level for a in await first.evaluate([charge])] == [50]
    restarted = evaluator(backend, store())  # no local memory, the same store
    assert await restarted.evaluate([charge]) == []
    charge = await spend(backend, SPEND, 250)
    assert [a.level for a in await restarted.evaluate([charge])] == [80]
    assert await first.evaluate([charge]) == []  # fired elsewhere: learnt from the store


async def test_concurrent_workers_fire_each_level_exactly_once(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    workers = [evaluator(backend, store()) for _ in range(4)]
    charge = await spend(backend, SPEND, 1000)
    results = await asyncio.gather(*(w.evaluate([charge]) for w in workers))
    fired = sorted(a.level for result in results for a in result)
    assert fired == [50, 80, 100]


async def test_the_next_bucket_and_another_scope_fire_again(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    ev = evaluator(backend, store())
    today = await spend(backend, SPEND, 500)
    assert [a.level for a in await ev.evaluate([today])] == [50]
    bob = await spend(backend, SPEND, 500, ctx=BOB)
    fired = await ev.evaluate([bob, today])
    assert [(a.scope, a.level) for a in fired] == [("user=bob", 50)]
    tomorrow = await spend(backend, SPEND, 500, now=time.time() + DAY)
    assert tomorrow.key != today.key
    fired = await ev.evaluate([tomorrow])
    assert [(a.bucket, a.level) for a in fired] == [(tomorrow.bucket, 50)]


async def test_a_refund_below_a_level_does_not_fire_it_again(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    ev = evaluator(backend, store())
    assert [a.level for a in await ev.evaluate([await spend(backend, SPEND, 550)])] == [50]
    assert await ev.evaluate([await spend(backend, SPEND, -150)]) == []
    assert await ev.evaluate([await spend(backend, SPEND, 150)]) == []


# -- breakers, shadow limits, silent limits -------------------------------------


async def test_a_breaker_trip_fires_once(backend: Backend, store: Callable[[], Deduper]) -> None:
    ev = evaluator(backend, store())
    assert await ev.evaluate([await spend(backend, BREAKER, 499)]) == []
    charge = await spend(backend, BREAKER, 1)
    fired = await ev.evaluate([charge])
    assert levels(fired) == [("global_spend", "breaker", 100)]
    assert fired[0].scope == "global" and fired[0].used == 500 and fired[0].cap == 500
    assert await ev.evaluate([charge]) == []
    assert await evaluator(backend, store()).evaluate([await spend(backend, BREAKER, 100)]) == []


async def test_a_breaker_with_levels_reports_its_trip_as_the_breaker(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    limit = Limit(
        "spend_breaker", cap=100, window=Window.DAY, breaker=True, gated=False, alert_at=[150, 50]
    )
    assert alert_levels(limit) == ((50, "threshold"), (100, "breaker"), (150, "threshold"))
    ev = AlertEvaluator(Policy.of(limit), backend, dedupe=store())
    fired = await ev.evaluate([await spend(backend, limit, 160)])
    assert levels(fired) == [
        ("spend_breaker", "threshold", 50),
        ("spend_breaker", "breaker", 100),
        ("spend_breaker", "threshold", 150),
    ]


async def test_shadow_limits_alert(backend: Backend, store: Callable[[], Deduper]) -> None:
    ev = evaluator(backend, store())
    # No alert_at: "admit and report" still reports reaching the cap.
    assert await ev.evaluate([await spend(backend, SHADOW, 9)]) == []
    fired = await ev.evaluate([await spend(backend, SHADOW, 3)])
    assert levels(fired) == [("shadow_calls", "threshold", 100)]
    assert fired[0].shadow and fired[0].used == 12
    fired = await ev.evaluate([await spend(backend, SHADOW_LEVELS, 5)])
    assert levels(fired) == [("shadow_levels", "threshold", 50)] and fired[0].shadow
    fired = await ev.evaluate([await spend(backend, SHADOW_LEVELS, 5)])
    assert levels(fired) == [("shadow_levels", "threshold", 100)]


async def test_limits_without_levels_stay_silent_and_unread(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    assert alert_levels(QUIET) == ()
    counting = CountingBackend(backend)
    ev = AlertEvaluator(POLICY, cast(Backend, counting), dedupe=store())
    assert await ev.evaluate([await spend(backend, QUIET, 25)]) == []
    assert counting.reads == []


async def test_one_batch_is_one_counter_read(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    counting = CountingBackend(backend)
    ev = AlertEvaluator(POLICY, cast(Backend, counting), dedupe=store())
    batch = [
        await spend(backend, SPEND, 900),
        await spend(backend, SPEND, 100, ctx=BOB),
        await spend(backend, BREAKER, 600),
        await spend(backend, QUIET, 25),
        await spend(backend, SPEND, 10),
    ]
    fired = await ev.evaluate(batch)
    assert len(counting.reads) == 1
    assert sorted(counting.reads[0]) == sorted({batch[0].key, batch[1].key, batch[2].key})
    assert {(a.limit, a.scope, a.level) for a in fired} == {
        ("spend", "user=alice", 50),
        ("spend", "user=alice", 80),
        ("global_spend", "global", 100),
    }


async def test_unknown_limits_and_expired_buckets_are_ignored(
    backend: Backend, store: Callable[[], Deduper]
) -> None:
    counting = CountingBackend(backend)
    ev = AlertEvaluator(POLICY, cast(Backend, counting), dedupe=store())
    live = await spend(backend, SPEND, 1000)
    gone = LedgerCharge(
        "retired", Unit.CALLS, 5, Window.DAY, live.bucket, "mcpbg:v1:retired:global:x", 2**40
    )
    expired = LedgerCharge(
        "spend", Unit.USD_MICROS, 5, Window.DAY, "20200101", "mcpbg:v1:spend:user=a:20200101", 1
    )
    assert await ev.evaluate([gone, expired]) == []
    assert counting.reads == []


class RecordingDeduper(MemoryDeduper):
    def __init__(self) -> None:
        super().__init__()
        self.claims: list[list[Mark]] = []

    async def claim(self, marks: Sequence[Mark]) -> list[bool]:
        self.claims.append(list(marks))
        return await super().claim(marks)


async def test_markers_take_the_latest_expiry_and_known_levels_cost_no_claim() -> None:
    backend = MemoryBackend()
    dedupe = RecordingDeduper()
    ev = AlertEvaluator(POLICY, backend, dedupe=dedupe, remember=2)
    charge = await spend(backend, SPEND, 900)
    later = LedgerCharge(**{**asdict(charge), "expire_at": charge.expire_at + 60})
    assert [a.level for a in await ev.evaluate([charge, later, charge])] == [50, 80]
    assert [m.expire_at for m in dedupe.claims[0]] == [later.expire_at] * 2
    assert await ev.evaluate([charge]) == [] and len(dedupe.claims) == 1  # known: no round trip
    # Past ``remember`` markers the local memory starts over (the store still dedupes).
    bob = await spend(backend, SPEND, 500, ctx=BOB)
    assert [a.scope for a in await ev.evaluate([bob])] == ["user=bob"]
    assert await ev.evaluate([charge]) == [] and len(dedupe.claims) == 3


async def test_a_session_counter_that_expired_and_came_back_fires_again() -> None:
    now = [time.time()]
    backend = MemoryBackend(clock=lambda: now[0])
    limit = Limit("per_session", cap=10, window=Window.SESSION, alert_at=[50])
    ev = AlertEvaluator(
        Policy.of(limit), backend, dedupe=MemoryDeduper(clock=lambda: now[0]), clock=lambda: now[0]
    )
    ctx = Context(session="s1")
    charge = await spend(backend, limit, 5, ctx=ctx, now=now[0])
    assert [a.level for a in await ev.evaluate([charge])] == [50]
    now[0] += DAY + 1  # idle for a day: the counter and its marker are gone
    charge = await spend(backend, limit, 6, ctx=ctx, now=now[0])
    assert [(a.bucket, a.used) for a in await ev.evaluate([charge])] == [("session", 6)]


@pytest.mark.parametrize(
    "key",
    [
        "mcpbg:v1:odd",
        # Five parts, but not keys.parse_key's grammar: no scope is guessed from it.
        "mcpbg:v1:spend:weird:b",
        "mcpbg:v1:spend:user=a:b:b",
        "mcpbg:v1:other:user=alice:b",
    ],
)
async def test_a_key_of_another_layout_is_named_whole(key: str) -> None:
    backend = MemoryBackend()
    odd = LedgerCharge("spend", Unit.USD_MICROS, 700, Window.DAY, "b", key, 2**40)
    await backend.charge([CounterOp(odd.key, 700, 1000, False, odd.expire_at)])
    ev = AlertEvaluator(POLICY, backend, dedupe=MemoryDeduper())
    assert [(a.scope, a.level) for a in await ev.evaluate([odd])] == [(key, 50)]


# -- the store ------------------------------------------------------------------


async def test_markers_live_in_redis_until_the_counter_expires(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    backend = RedisBackend(client)
    ev = AlertEvaluator(POLICY, backend, dedupe=RedisDeduper(client))
    charge = await spend(backend, SPEND, 500)
    await ev.evaluate([charge])
    marker = marker_key(charge.key, 50)
    assert marker == f"mcpbg:v1:_alerted:spend:user=alice:{charge.bucket}:50"
    ttl = await client.ttl(marker)
    assert abs(ttl - (charge.expire_at - time.time())) <= 2
    assert await client.exists(marker_key(charge.key, 80)) == 0
    assert await RedisDeduper(client).claim([]) == []
    await client.aclose()


async def test_memory_deduper_forgets_expired_markers() -> None:
    now = [1000.0]
    dedupe = MemoryDeduper(clock=lambda: now[0], sweep_every=2)
    assert await dedupe.claim([Mark("a", 1010), Mark("a", 1010), Mark("b", 999)]) == [
        True,
        False,
        False,
    ]
    assert len(dedupe) == 1
    now[0] = 1011.0
    assert len(dedupe) == 0
    assert await dedupe.claim([Mark("a", 2000)]) == [True]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_an_unreachable_store_is_logged_not_raised_and_caught_up_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    dead = aioredis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    with pytest.raises(BackendUnavailableError):
        await RedisDeduper(dead).claim([Mark("mcpbg:v1:_alerted:x", 2**40)])
    ev = AlertEvaluator(POLICY, backend, dedupe=RedisDeduper(dead))
    charge = await spend(backend, SPEND, 800)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert await ev.evaluate([charge]) == []
    assert "cannot record 2 alerts" in caplog.text and ev.failures == 1
    await dead.aclose()

    class Down:
        async def usage(self, keys: Sequence[str]) -> list[int]:
            raise BackendUnavailableError("redis unreachable: test")

    ev = AlertEvaluator(POLICY, cast(Backend, Down()), dedupe=MemoryDeduper())
    with caplog.at_level(logging.WARNING, LOGGER):
        assert await ev.evaluate([charge]) == []
    assert "cannot read 1 counters" in caplog.text
    # Level-triggered: the next evaluation of the counter fires what was missed.
    ev = AlertEvaluator(POLICY, backend, dedupe=MemoryDeduper())
    assert [a.level for a in await ev.evaluate([charge])] == [50, 80]


# -- the JSON form --------------------------------------------------------------


def sample(level: int = 80, used: int = 800) -> Alert:
    return Alert(
        "threshold",
        "spend",
        "user=alice",
        "mcpbg:v1:spend:user=alice:20261129",
        "20261129",
        Window.DAY,
        level,
        used,
        1000,
        Unit.USD_MICROS,
        False,
        1_795_910_400.25,
    )


def test_an_alert_is_a_cloudevent_and_round_trips() -> None:
    alert = sample()
    event = orjson.loads(alert.to_json())
    assert event["specversion"] == "1.0" and event["type"] == ALERT_TYPE == "mcpbg.alert.v1"
    assert event["source"] == "/mcpbg/alerts" and event["id"] == alert.id
    assert event["time"] == "2026-11-29T00:00:00.250000Z"
    assert event["subject"] == alert.key and event["datacontenttype"] == "application/json"
    assert event["data"] == {
        "kind": "threshold",
        "limit": "spend",
        "scope": "user=alice",
        "key": "mcpbg:v1:spend:user=alice:20261129",
        "bucket": "20261129",
        "window": "day",
        "level": 80,
        "used": 800,
        "cap": 1000,
        "unit": "usd_micros",
        "shadow": False,
    }
    assert parse_alert(alert.to_json()) == alert
    # The id names the marker: the same alert again has the same id, another level not.
    assert sample(used=999).id == alert.id != sample(level=50).id


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"type": "mcpbg.metered.v1"}, "type"),
        ({"data": {"kind": "panic"}}, "data"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_malformed_alert_is_refused_with_the_field(change: dict[str, Any], where: str) -> None:
    event = {**sample().to_cloudevent(), **change}
    with pytest.raises(MalformedEventError, match=where):
        parse_alert(orjson.dumps(event))


# -- sinks and delivery ---------------------------------------------------------


async def test_log_sink_writes_one_structured_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, LOGGER):
        await LogSink().send(sample())
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith("mcpbg.alert kind=threshold level=80 limit=spend ")
    assert 'scope="user=alice" bucket=20261129 window=day used=800 cap=1000' in message
    assert "unit=usd_micros shadow=false" in message and f"id={sample().id}" in message
    assert record.mcpbg_alert["level"] == 80  # type: ignore[attr-defined]
    assert record.mcpbg_alert["time"] == "2026-11-29T00:00:00.250000Z"  # type: ignore[attr-defined]


@dataclass
class RecordingProducer:
    """The test double of the worker's producer: records what it is asked to send."""

    sent: list[tuple[str, bytes, bytes]] = field(default_factory=list)
    fail: bool = False

    async def __call__(self, topic: str, key: bytes, value: bytes) -> None:
        if self.fail:
            raise ConnectionError("broker unreachable")
        self.sent.append((topic, key, value))


async def test_topic_sink_sends_the_counter_key_and_the_cloudevent() -> None:
    producer = RecordingProducer()
    sink = TopicSink(producer)
    assert isinstance(sink, AlertSink) and sink.name == "topic mcpbg.alerts"
    await sink.send(sample())
    [(topic, key, value)] = producer.sent
    assert topic == "mcpbg.alerts" and key == sample().key.encode()
    assert parse_alert(value) == sample()
    with pytest.raises(InvalidInputError, match="topic"):
        TopicSink(producer, "")


class BlockingSink:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.got: list[Alert] = []
        self.closed = False

    @property
    def name(self) -> str:
        return "blocking"

    async def send(self, alert: Alert) -> None:
        await self.release.wait()
        self.got.append(alert)

    async def aclose(self) -> None:
        self.closed = True


async def test_every_sink_gets_every_alert_in_order_and_a_failing_one_stops_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    good, bad = RecordingProducer(), RecordingProducer(fail=True)
    ev = evaluator(
        backend, MemoryDeduper(), sinks=[TopicSink(bad, "broken"), TopicSink(good), LogSink()]
    )
    with caplog.at_level(logging.WARNING, LOGGER):
        fired = await ev.evaluate([await spend(backend, SPEND, 1000)])
        fired += await ev.evaluate([await spend(backend, BREAKER, 500)])
        await ev.flush()
    assert [parse_alert(v) for _, _, v in good.sent] == fired and len(fired) == 4
    assert ev.dispatcher.failed == 4 and ev.dispatcher.delivered == 8
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 4
    assert errors[0].startswith("alerts: topic broken could not deliver threshold 50% of spend")
    assert "broker unreachable" in errors[0]
    await ev.aclose()


async def test_a_slow_sink_never_blocks_evaluation_and_a_full_queue_drops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    sink = BlockingSink()
    ev = evaluator(backend, MemoryDeduper(), sinks=[sink], queue_size=2)
    with caplog.at_level(logging.ERROR, LOGGER):
        fired = await asyncio.wait_for(ev.evaluate([await spend(backend, SPEND, 1000)]), 1)
        await asyncio.sleep(0)  # the delivery task takes the first alert and blocks
        fired += await ev.evaluate([await spend(backend, BREAKER, 500)])
    assert len(fired) == 4
    assert ev.dispatcher.dropped == 1 and "blocking is 2 alerts behind" in caplog.text
    sink.release.set()
    await ev.aclose()
    assert [a.level for a in sink.got] == [50, 80, 100] and sink.closed


async def test_a_sink_that_fails_to_close_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    class Sticky(BlockingSink):
        async def aclose(self) -> None:
            raise RuntimeError("stuck")

    with pytest.raises(InvalidInputError, match="queue_size"):
        AlertDispatcher([], queue_size=0)
    dispatcher = AlertDispatcher([Sticky(), LogSink()])
    with caplog.at_level(logging.WARNING, LOGGER):
        await dispatcher.aclose()
    assert "closing blocking failed: stuck" in caplog.text


async def test_aclose_gives_up_on_a_stuck_sink_after_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    sink = BlockingSink()
    ev = evaluator(backend, MemoryDeduper(), sinks=[sink])
    await ev.evaluate([await spend(backend, SPEND, 1000)])
    with caplog.at_level(logging.WARNING, LOGGER):
        await ev.aclose(grace=0.05)
    assert "closing with 2 alerts undelivered" in caplog.text and sink.closed


# -- the webhook, against a real HTTP server ------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Hook:
    """A local HTTP server answering POSTs from a script of (status, delay) replies."""

    def __init__(self) -> None:
        self.script: list[tuple[int, float]] = [(200, 0.0)]
        self.received: list[Received] = []
        self.release = threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                hook.received.append(Received(self.path, dict(self.headers.items()), body))
                status, delay = hook.script.pop(0) if len(hook.script) > 1 else hook.script[0]
                if delay:
                    hook.release.wait(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:  # the client timed out and left
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.handle_error = lambda *a: None  # type: ignore[method-assign]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def url(self, path: str = "/hooks/T0/secret") -> str:
        return f"http://127.0.0.1:{self.server.server_port}{path}"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def hook() -> Iterator[Hook]:
    server = Hook()
    yield server
    server.stop()


async def test_webhook_posts_the_alert_cloudevent(hook: Hook) -> None:
    sink = WebhookSink(hook.url(), headers={"Authorization": "Bearer t0k3n"})
    assert sink.name == f"webhook http://127.0.0.1:{hook.server.server_port}"
    await sink.send(sample())
    await sink.send(sample(level=100, used=1000))
    await sink.aclose()
    assert [r.path for r in hook.received] == ["/hooks/T0/secret"] * 2
    first = hook.received[0]
    assert first.headers["Content-Type"] == "application/cloudevents+json"
    assert first.headers["Authorization"] == "Bearer t0k3n"
    assert orjson.loads(first.body) == orjson.loads(sample().to_json())
    assert parse_alert(first.body) == sample()
    assert parse_alert(hook.received[1].body).level == 100


async def test_webhook_retries_server_errors_then_succeeds(
    hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    hook.script = [(500, 0.0), (503, 0.0), (429, 0.0), (204, 0.0)]
    sink = WebhookSink(hook.url(), retries=3, backoff=0.01)
    with caplog.at_level(logging.INFO, LOGGER):
        await sink.send(sample())
    await sink.aclose()
    assert len(hook.received) == 4
    assert len({r.body for r in hook.received}) == 1  # the same alert, the same id
    assert "attempt 1 of 4 failed (HTTP 500); retrying in 0.01 s" in caplog.text


async def test_webhook_gives_up_after_its_retries_with_a_log_line(
    hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    hook.script = [(500, 0.0)]
    sink = WebhookSink(hook.url(), retries=2, backoff=0.01)
    with pytest.raises(AlertDeliveryError, match=r"gave up after 3 attempts \(HTTP 500\)"):
        await sink.send(sample())
    assert len(hook.received) == 3
    # Through the evaluator: one ERROR line per alert given up, and evaluation goes on.
    backend = MemoryBackend()
    ev = evaluator(backend, MemoryDeduper(), sinks=[sink])
    with caplog.at_level(logging.ERROR, LOGGER):
        fired = await ev.evaluate([await spend(backend, SPEND, 500)])
        await ev.flush()
    assert len(fired) == 1 and len(hook.received) == 6
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.startswith(f"alerts: webhook http://127.0.0.1:{hook.server.server_port} could")
    assert "gave up after 3 attempts (HTTP 500)" in line and "secret" not in line
    await ev.aclose()


async def test_webhook_does_not_retry_a_client_error(hook: Hook) -> None:
    hook.script = [(400, 0.0)]
    sink = WebhookSink(hook.url(), retries=3, backoff=0.01)
    with pytest.raises(AlertDeliveryError, match=r"HTTP 400, not retried"):
        await sink.send(sample())
    await sink.aclose()
    assert len(hook.received) == 1


async def test_webhook_respects_its_timeout(hook: Hook) -> None:
    hook.script = [(200, 5.0)]  # answers only after 5 s
    sink = WebhookSink(hook.url(), timeout=0.2, retries=1, backoff=0.01)
    started = time.monotonic()
    with pytest.raises(AlertDeliveryError, match=r"gave up after 2 attempts \(timed out after 0.2"):
        await sink.send(sample())
    elapsed = time.monotonic() - started
    await sink.aclose()
    assert 0.4 <= elapsed < 1.5
    assert len(hook.received) == 2


async def test_webhook_retries_a_refused_connection() -> None:
    sink = WebhookSink(f"http://127.0.0.1:{free_port()}/x", retries=1, backoff=0.01)
    with pytest.raises(AlertDeliveryError, match="gave up after 2 attempts"):
        await sink.send(sample())
    await sink.aclose()


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"url": "ftp://example.com/x"}, "url"),
        ({"url": "not a url"}, "url"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"retries": -1}, "retries"),
        ({"retries": True}, "retries"),
        ({"backoff": float("nan")}, "backoff"),
        ({"max_backoff": -1}, "max_backoff"),
    ],
)
def test_webhook_refuses_bad_settings(kwargs: dict[str, Any], field_name: str) -> None:
    settings: dict[str, Any] = {"url": "https://hooks.example/x", **kwargs}
    with pytest.raises(InvalidInputError, match=field_name):
        WebhookSink(settings.pop("url"), **settings)


def test_webhook_names_only_scheme_host_and_port_and_backs_off_exponentially() -> None:
    sink = WebhookSink("https://user:pw@hooks.example:8443/T000/secret?token=x", max_backoff=1.5)
    assert sink.name == "webhook https://hooks.example:8443"
    assert [sink.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, 1.5]
    assert isinstance(sink, AlertSink) and isinstance(LogSink(), AlertSink)
    assert isinstance(MemoryDeduper(), Deduper)
