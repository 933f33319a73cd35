"""Where alerts go: one bounded queue per sink, logs, a Kafka topic, webhooks with retries."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable
from urllib.parse import urlsplit

from mcp_budget_governor.errors import GovernorError, InvalidInputError
from mcp_budget_governor.events import rfc3339
from mcp_budget_governor.urls import check_http_url
from mcp_budget_governor.webhooks import sign

from .event import Alert

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__package__)  # the package's one logger: ...stream.alerts

#: The Kafka topic alerts go to unless the worker names another.
DEFAULT_ALERT_TOPIC = "mcpbg.alerts"


class AlertDeliveryError(GovernorError):
    """A sink could not deliver an alert (after its retries)."""


@runtime_checkable
class AlertSink(Protocol):
    """Somewhere alerts go. ``send`` raises when the alert could not be delivered."""

    @property
    def name(self) -> str:
        """How logs name this sink (never with secrets)."""
        ...

    async def send(self, alert: Alert) -> None: ...

    async def aclose(self) -> None: ...


class AlertDispatcher:
    """Fans alerts out to sinks: one bounded queue and one delivery task per sink.

    A sink receives alerts in the order they were published, one at a time;
    sinks do not wait for one another. :meth:`publish` never blocks: when a
    sink's queue is full the alert is dropped for that sink (ERROR logged,
    counted in ``dropped``). Failures are logged (ERROR) and counted in
    ``failed``; ``delivered`` counts successes. Tasks start on the first publish.
    """

    def __init__(self, sinks: Sequence[AlertSink], *, queue_size: int = 10_000) -> None:
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise InvalidInputError("queue_size", queue_size, "expected a positive integer")
        self.sinks = tuple(sinks)
        self._queue_size = queue_size
        self._queues: list[asyncio.Queue[Alert]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.delivered = 0
        self.failed = 0
        self.dropped = 0

    def _start(self) -> None:
        for sink in self.sinks:
            queue: asyncio.Queue[Alert] = asyncio.Queue(self._queue_size)
            self._queues.append(queue)
            self._tasks.append(
                asyncio.get_running_loop().create_task(
                    self._deliver(sink, queue), name=f"mcpbg-alerts {sink.name}"
                )
            )

    def publish(self, alerts: Sequence[Alert]) -> None:
        """Queue ``alerts`` for every sink (call from the event loop)."""
        if not alerts or not self.sinks:
            return
        if not self._tasks:
            self._start()
        for sink, queue in zip(self.sinks, self._queues, strict=True):
            for alert in alerts:
                try:
                    queue.put_nowait(alert)
                except asyncio.QueueFull:
                    self.dropped += 1
                    log.error(
                        "alerts: %s is %d alerts behind; dropped %s (id %s)",
                        sink.name,
                        queue.qsize(),
                        alert.describe(),
                        alert.id,
                    )

    async def _deliver(self, sink: AlertSink, queue: asyncio.Queue[Alert]) -> None:
        while True:
            alert = await queue.get()
            try:
                await sink.send(alert)
                self.delivered += 1
            except Exception as exc:  # a sink must never stop the others, or the evaluator
                self.failed += 1
                log.error(
                    "alerts: %s could not deliver %s (id %s): %s",
                    sink.name,
                    alert.describe(),
                    alert.id,
                    exc,
                )
            finally:
                queue.task_done()

    async def flush(self) -> None:
        """Wait until every queued alert was delivered or given up."""
        await asyncio.gather(*(queue.join() for queue in self._queues))

    async def aclose(self, grace: float = 10.0) -> None:
        """Deliver what is queued (at most ``grace`` s), stop the tasks, close the sinks."""
        if self._tasks:
            try:
                await asyncio.wait_for(self.flush(), grace)
            except TimeoutError:
                left = sum(queue.qsize() for queue in self._queues)
                log.warning("alerts: closing with %d alerts undelivered", left)
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()
            self._queues.clear()
        for sink in self.sinks:
            try:
                await sink.aclose()
            except Exception as exc:
                log.warning("alerts: closing %s failed: %s", sink.name, exc)


def _logfmt(value: object) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if not text or any(c in text for c in ' ="\\'):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    return text


class LogSink:
    """One structured (logfmt) line per alert, at WARNING by default.

    The alert's fields also travel as ``record.mcpbg_alert`` (a dict) for
    JSON log handlers::

        mcpbg.alert kind=threshold level=80 limit=spend scope="user=alice" bucket=20261129
        window=day used=800 cap=1000 unit=usd_micros shadow=false key="..." id=...
    """

    def __init__(
        self, logger: logging.Logger | None = None, *, level: int = logging.WARNING
    ) -> None:
        self.logger = logger or log
        self.level = level

    @property
    def name(self) -> str:
        return f"log {self.logger.name}"

    async def send(self, alert: Alert) -> None:
        fields = {
            "kind": alert.kind,
            "level": alert.level,
            "limit": alert.limit,
            "scope": alert.scope,
            "bucket": alert.bucket,
            "window": alert.window.value,
            "used": alert.used,
            "cap": alert.cap,
            "unit": alert.unit.value,
            "shadow": alert.shadow,
            "key": alert.key,
            "id": alert.id,
        }
        line = " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())
        self.logger.log(
            self.level,
            "mcpbg.alert %s",
            line,
            extra={"mcpbg_alert": {**alert.data(), "id": alert.id, "time": rfc3339(alert.at)}},
        )

    async def aclose(self) -> None:
        return None


class TopicProducer(Protocol):
    """Sends one record and waits for the broker's ack; raises on failure.

    The worker wires it to its producer, e.g. with aiokafka::

        async def produce(topic: str, key: bytes, value: bytes) -> None:
            await producer.send_and_wait(topic, value, key=key)
    """

    def __call__(self, topic: str, key: bytes, value: bytes) -> Awaitable[None]: ...


class TopicSink:
    """Alerts to a Kafka topic (``mcpbg.alerts`` by default) through ``produce``.

    The record key is the counter key, so every alert of one counter lands in
    one partition, in level order; the value is the alert's CloudEvent JSON.
    The producer belongs to the caller (``aclose`` leaves it open).
    """

    def __init__(self, produce: TopicProducer, topic: str = DEFAULT_ALERT_TOPIC) -> None:
        if not topic:
            raise InvalidInputError("topic", topic, "must not be empty")
        self.produce = produce
        self.topic = topic

    @property
    def name(self) -> str:
        return f"topic {self.topic}"

    async def send(self, alert: Alert) -> None:
        await self.produce(self.topic, alert.key.encode(), alert.to_json())

    async def aclose(self) -> None:
        return None


#: Statuses worth another attempt: timeouts, throttling, server errors.
_RETRY_STATUSES = frozenset({408, 425, 429})


class WebhookSink:
    """POSTs each alert's CloudEvent JSON (``application/cloudevents+json``) to ``url``.

    - ``timeout``: seconds one attempt may take, connect to last byte.
    - ``retries``: further attempts after a connection error, a timeout, a
      408/425/429 or a 5xx (so at most ``retries + 1`` requests); any other
      non-2xx status (a 4xx, a redirect) is not retried.
    - ``backoff``: seconds before the first retry, doubled each time, at most
      ``max_backoff``.
    - ``headers``: extra request headers (an ``Authorization``, say).
    - ``secret``: signs every attempt (``X-Mcpbg-Timestamp`` and
      ``X-Mcpbg-Signature``, :mod:`mcp_budget_governor.webhooks`), so a receiver
      can refuse a forged, altered or replayed request.

    After the last attempt :meth:`send` raises :class:`AlertDeliveryError`
    (which the dispatcher logs). One send therefore lasts at most about
    ``(retries + 1) * timeout`` plus the pauses. Logs name the URL by scheme,
    host and port only: a webhook path often holds a secret token.

    Needs ``aiohttp`` (installed with the ``stream`` extra).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        headers: dict[str, str] | None = None,
        secret: str | None = None,
    ) -> None:
        parts = urlsplit(check_http_url(url))
        if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
            raise InvalidInputError("secret", "…", "expected at least 16 characters")
        self.secret = secret
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise InvalidInputError("timeout", timeout, "expected seconds > 0")
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise InvalidInputError("retries", retries, "expected an integer from 0 to 100")
        for name, value in (("backoff", backoff), ("max_backoff", max_backoff)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise InvalidInputError(name, value, "expected seconds >= 0")
        self.url = url
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.headers = {"Content-Type": "application/cloudevents+json", **(headers or {})}
        port = f":{parts.port}" if parts.port else ""
        self._where = f"{parts.scheme}://{parts.hostname}{port}"
        self._session: aiohttp.ClientSession | None = None

    @property
    def name(self) -> str:
        return f"webhook {self._where}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            import aiohttp

            self._session = aiohttp.ClientSession()
        return self._session

    def delay(self, attempt: int) -> float:
        """The pause after failed attempt number ``attempt`` (1-based)."""
        return min(self.backoff * 2.0 ** (attempt - 1), self.max_backoff)

    async def send(self, alert: Alert) -> None:
        import aiohttp

        body = alert.to_json()
        session = self._client()
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        attempts = self.retries + 1
        problem = "not attempted"
        for attempt in range(1, attempts + 1):
            try:
                headers = self.headers
                if self.secret is not None:  # signed per attempt: a retry is not stale
                    headers = {**headers, **sign(self.secret, body)}
                async with session.post(
                    self.url,
                    data=body,
                    headers=headers,
                    timeout=timeout,
                    allow_redirects=False,
                ) as response:
                    status = response.status
                    if 200 <= status < 300:
                        return
                    problem = f"HTTP {status}"
                    if status not in _RETRY_STATUSES and status < 500:
                        raise AlertDeliveryError(
                            f"{self.name}: {problem}, not retried (alert {alert.id})"
                        )
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = (
                    f"timed out after {self.timeout:g} s"
                    if isinstance(exc, TimeoutError)
                    else f"{type(exc).__name__}: {exc}"
                )
            if attempt < attempts:
                pause = self.delay(attempt)
                log.info(
                    "alerts: %s attempt %d of %d failed (%s); retrying in %.2f s",
                    self.name,
                    attempt,
                    attempts,
                    problem,
                    pause,
                )
                await asyncio.sleep(pause)
        raise AlertDeliveryError(f"{self.name}: gave up after {attempts} attempts ({problem})")

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            with contextlib.suppress(Exception):
                await session.close()
