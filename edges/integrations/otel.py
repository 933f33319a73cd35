"""OpenTelemetry metrics and spans from a governor, and a Prometheus endpoint (``[otel]`` extra).

``Governor(policy, backend, observer=Telemetry())`` reports through the global
meter and tracer providers (FastMCP's, a collector's); servers without a
collector use :meth:`Telemetry.prometheus`, which keeps its own meter provider
with a Prometheus reader and can serve ``/metrics``:

>>> import asyncio
>>> from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window
>>> tel = Telemetry.prometheus()
>>> gov = Governor(
...     Policy.of(Limit("burst", cap=1, window=Window.MINUTE, scope=Scope.USER)),
...     observer=tel,
... )
>>> async def two():
...     return [(await gov.check(Context(user="u_1"))).status for _ in range(2)]
>>> asyncio.run(two())
[200, 429]
>>> import re
>>> for line in tel.scrape().splitlines():
...     if line.startswith("mcpbg_governor_decisions_total"):
...         print(*re.findall(r'mcpbg_(?:decision|limit|reason)="([^"]*)"', line), line[-3:])
admitted  ok 1.0
refused burst budget_exceeded:user/minute 1.0
>>> tel.close()

Metrics (OpenTelemetry names; Prometheus turns dots into underscores and adds
the unit and ``_total``): ``mcpbg.governor.decisions`` (attributes
``mcpbg.decision``, ``mcpbg.limit``, ``mcpbg.reason``,
``http.response.status_code``, ``mcpbg.degraded``),
``mcpbg.governor.check.duration`` (seconds), ``mcpbg.governor.degraded``
(1 while the counters are unreachable), ``mcpbg.governor.fallback.pending``
(outage charges waiting to be replayed), and for a ledger with an outbox
``mcpbg.ledger.outbox.depth``, ``mcpbg.ledger.outbox.oldest_age`` (seconds),
``mcpbg.ledger.events.appended`` / ``.shipped`` / ``.spilled``. Each check is
a span ``mcpbg.check`` carrying the same attributes. Refusals are logged as
by :class:`~mcp_budget_governor.observe.Observer`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import orjson
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, start_http_server

from ..context import EMPTY, Context
from ..decision import Decision
from ..observe import CheckFn, Observer, Watched

__all__ = ["LATENCY_BUCKETS", "Telemetry", "serve_prometheus"]

#: Histogram bounds for check latency, seconds (a check is ~50 us to a few ms).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

_Attrs = dict[str, str | int | bool]


class Telemetry(Observer):
    """Metrics and spans for one or more governors (each ``Governor(observer=...)``).

    - ``meter_provider`` / ``tracer_provider``: default the global ones;
    - ``spans``: False for metrics only;
    - ``log_interval``: seconds between two log lines of the same kind of refusal.
    """

    def __init__(
        self,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        *,
        spans: bool = True,
        log_interval: float = 10.0,
    ) -> None:
        super().__init__(log_interval=log_interval)
        from .. import __version__

        meter = (meter_provider or metrics.get_meter_provider()).get_meter(
            "mcp_budget_governor", __version__
        )
        self._tracer = (
            (tracer_provider or trace.get_tracer_provider()).get_tracer(
                "mcp_budget_governor", __version__
            )
            if spans
            else None
        )
        self._governors: list[Watched] = []
        self._attrs: dict[tuple[bool, str | None, int, str, bool], _Attrs] = {}
        self._decisions = meter.create_counter(
            "mcpbg.governor.decisions",
            unit="{decision}",
            description="Checks decided, by decision, limit, reason and status",
        )
        self._duration = meter.create_histogram(
            "mcpbg.governor.check.duration",
            unit="s",
            description="How long a check took, its counters' round trip included",
            explicit_bucket_boundaries_advisory=list(LATENCY_BUCKETS),
        )
        meter.create_observable_gauge(
            "mcpbg.governor.degraded",
            [self._degraded],
            description="1 while the shared counters are unreachable and fail modes decide",
        )
        meter.create_observable_gauge(
            "mcpbg.governor.fallback.pending",
            [self._pending],
            unit="{charge}",
            description="Charges made on local fallback counters, waiting to be replayed",
        )
        meter.create_observable_gauge(
            "mcpbg.ledger.outbox.depth",
            [self._outbox_depth],
            unit="{event}",
            description="Ledger events in the local outbox not yet acknowledged by Kafka",
        )
        meter.create_observable_gauge(
            "mcpbg.ledger.outbox.oldest_age",
            [self._outbox_age],
            unit="s",
            description="Age of the oldest unshipped ledger event (0 when none)",
        )
        for what in ("appended", "shipped", "spilled"):
            meter.create_observable_counter(
                f"mcpbg.ledger.events.{what}",
                [self._stat(what)],
                unit="{event}",
                description=f"Ledger events {what} (spilled: through the outbox files)",
            )
        self._registry: CollectorRegistry | None = None
        self._reader: Any = None
        self._provider: Any = None

    @classmethod
    def prometheus(cls, **options: Any) -> Telemetry:
        """A :class:`Telemetry` with its own meter provider and a Prometheus reader in its
        own registry: :meth:`scrape` gives the text, :func:`serve_prometheus` serves it."""
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider

        reader = PrometheusMetricReader()
        # The reader registers itself in prometheus_client's global registry: move it
        # to one of its own, so several governors (or tests) in a process never collide.
        collector = getattr(reader, "_collector", None)
        registry = CollectorRegistry()
        if collector is not None:
            REGISTRY.unregister(collector)
            registry.register(collector)
        provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
        tel = cls(provider, **options)
        tel._registry, tel._reader, tel._provider = registry, reader, provider
        return tel

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry of :meth:`prometheus` telemetry."""
        if self._registry is None:
            raise RuntimeError("not a Prometheus telemetry: use Telemetry.prometheus()")
        return self._registry

    def scrape(self) -> str:
        """The Prometheus text exposition of :attr:`registry`, as ``/metrics`` serves it."""
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        """Shut down the meter provider :meth:`prometheus` made (others are the caller's)."""
        if self._provider is not None:
            collector = getattr(self._reader, "_collector", None)
            if collector is not None and self._registry is not None:
                # The reader's shutdown takes it out of the global registry.
                self._registry.unregister(collector)
                REGISTRY.register(collector)
            self._provider.shutdown()
            self._provider = None

    # -- the governor's hooks ----------------------------------------------

    def attach(self, governor: Watched) -> None:
        super().attach(governor)
        self._governors.append(governor)

    async def observe_check(
        self, check: CheckFn, ctx: Context | None, amount: int, approved: Sequence[str]
    ) -> Decision:
        if self._tracer is None:
            return await super().observe_check(check, ctx, amount, approved)
        with self._tracer.start_as_current_span("mcpbg.check") as span:
            t0 = time.perf_counter()
            decision = await check(ctx, amount, approved)
            seconds = time.perf_counter() - t0
            span.set_attributes(self._attributes(decision))
            if ctx is not None:
                span.set_attributes(_context(ctx))
        self.decided(decision, ctx or EMPTY, seconds)
        return decision

    def decided(self, decision: Decision, ctx: Context, seconds: float) -> None:
        attrs = self._attributes(decision)
        self._decisions.add(1, attrs)
        self._duration.record(seconds, attrs)
        if not decision.admitted:
            self.refusals.note(decision, ctx)

    def _attributes(self, d: Decision) -> _Attrs:
        key = (d.admitted, d.limit, d.status, d.reason, d.degraded)
        attrs = self._attrs.get(key)
        if attrs is None:
            attrs = {
                "mcpbg.decision": "admitted" if d.admitted else "refused",
                "mcpbg.reason": d.reason,
                "http.response.status_code": d.status,
                "mcpbg.degraded": d.degraded,
            }
            if d.limit is not None:
                attrs["mcpbg.limit"] = d.limit
            if len(self._attrs) < 10_000:
                self._attrs[key] = attrs
        return attrs

    # -- observable instruments (read at collection time) --------------------

    def _degraded(self, options: CallbackOptions) -> Iterable[Observation]:
        down = any(g.degraded for g in self._governors)
        return [Observation(1 if down else 0)]

    def _pending(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sum(g.pending_charges for g in self._governors))]

    def _outboxes(self) -> list[Any]:
        return [
            g.ledger
            for g in self._governors
            if g.ledger is not None and hasattr(g.ledger, "outbox")
        ]

    def _outbox_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(sum(len(ledger.outbox) for ledger in self._outboxes()))]

    def _outbox_age(self, options: CallbackOptions) -> Iterable[Observation]:
        oldest = 0.0
        now = time.time()
        for ledger in self._outboxes():
            for _, raw in ledger.outbox.peek(1):
                at = _event_time(raw)
                if at is not None:
                    oldest = max(oldest, now - at)
        return [Observation(oldest)]

    def _stat(self, name: str) -> Any:
        def read(options: CallbackOptions) -> Iterable[Observation]:
            total = 0
            for g in self._governors:
                stats = getattr(g.ledger, "stats", None)
                total += int(getattr(stats, name, 0) or 0)
            return [Observation(total)]

        return read


def _context(ctx: Context) -> _Attrs:
    out: _Attrs = {}
    for name in ("user", "tenant", "tool"):
        value = getattr(ctx, name)
        if value is not None:
            out[f"mcpbg.{name}"] = value
    return out


def _event_time(raw: bytes) -> float | None:
    """The ``time`` of one outbox record (a CloudEvent), epoch seconds."""
    try:
        when = orjson.loads(raw).get("time")
        return datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


def serve_prometheus(telemetry: Telemetry, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` of ``telemetry`` (from :meth:`Telemetry.prometheus`) on ``port``
    from a background thread; returns the server (``.shutdown()`` stops it)."""
    server, _thread = start_http_server(port, addr=addr, registry=telemetry.registry)
    return server
