"""Prometheus metrics of the stream worker (``--metrics-port``; off by default).

Counters of records, applied events, dead letters and rebuilds, and per
partition the last applied offset and the lag the last fetch reported. They
live in their own registry, so several workers in one test process do not
collide with each other or with an application's default registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

REGISTRY = CollectorRegistry()
RECORDS = Counter("mcpbg_worker_records", "Ledger records read", registry=REGISTRY)
APPLIED = Counter(
    "mcpbg_worker_applied_events", "Events applied to the counters", registry=REGISTRY
)
DEAD = Counter(
    "mcpbg_worker_dead_letters", "Records sent to the dead-letter topic", registry=REGISTRY
)
REBUILDS = Counter("mcpbg_worker_rebuilds", "Rebuilds of an emptied Redis", registry=REGISTRY)
LAST_OFFSET = Gauge(
    "mcpbg_worker_last_offset", "Last offset processed", ["partition"], registry=REGISTRY
)
LAG = Gauge(
    "mcpbg_worker_lag",
    "Highwater minus position, as last fetched",
    ["partition"],
    registry=REGISTRY,
)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` on ``port`` from a background thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)
