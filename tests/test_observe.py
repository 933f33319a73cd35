"""Hot-path observability: metrics scraped after governed calls, refusal logs, free when off."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from mcp_budget_governor import (
    Backend,
    Context,
    Governor,
    Limit,
    Policy,
    RedisBackend,
    Scope,
    Window,
)
from mcp_budget_governor.observe import Observer

pytest.importorskip("opentelemetry.exporter.prometheus")

from mcp_budget_governor.integrations.otel import Telemetry, serve_prometheus


def _policy() -> Policy:
    return Policy.of(
        Limit("burst", cap=2, window=Window.MINUTE, scope=Scope.USER),
        Limit("tenant_day", cap=3, window=Window.DAY, scope=Scope.TENANT),
    )


def _samples(text: str, name: str) -> dict[tuple[str, str, str], float]:
    """``{(decision, limit, reason): value}`` of one metric's lines."""
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        key = (labels["mcpbg_decision"], labels.get("mcpbg_limit", ""), labels["mcpbg_reason"])
        out[key] = float(line.rsplit(" ", 1)[1])
    return out


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _gauge(text: str, name: str) -> float:
    """The value of an unlabelled gauge (Prometheus adds the unit: ``_charges``)."""
    (value,) = re.findall(rf"^{name}(?:_[a-z]+)?\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(value)


async def test_scrape_finds_admitted_and_refused_counts_by_limit_and_reason(
    backend: Backend,
) -> None:
    tel = Telemetry.prometheus()
    try:
        now = time.time()  # one instant: the refusal by "burst" is one minute's
        gov = Governor(_policy(), backend, observer=tel, clock=lambda: now)
        # u1: 2 admitted, then refused by burst; u2: 1 admitted, then the tenant's 3rd
        # call is admitted... and the 4th refused by tenant_day.
        for _ in range(3):
            await gov.check(Context(user="u1", tenant="acme"))
        for _ in range(2):
            await gov.check(Context(user="u2", tenant="acme"))
        server = serve_prometheus(tel, 0)
        try:
            port = server.server_address[1]
            text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
        finally:
            server.shutdown()
    finally:
        tel.close()
    counts = _samples(text, "mcpbg_governor_decisions_total")
    assert counts == {
        ("admitted", "", "ok"): 3.0,
        ("refused", "burst", "budget_exceeded:user/minute"): 1.0,
        ("refused", "tenant_day", "budget_exceeded:tenant/day"): 1.0,
    }
    assert 'http_response_status_code="429"' in text
    assert "mcpbg_governor_check_duration_seconds_count" in text
    assert _gauge(text, "mcpbg_governor_degraded") == 0.0
    assert _gauge(text, "mcpbg_governor_fallback_pending") == 0.0


async def test_degraded_state_and_fallback_are_exported(own_redis: object) -> None:
    url = own_redis.url  # type: ignore[attr-defined]
    tel = Telemetry.prometheus()
    try:
        gov = Governor(
            Policy.of(Limit("burst", cap=5, window=Window.MINUTE, scope=Scope.USER)),
            RedisBackend.from_url(url, timeout=0.5),
            observer=tel,
            retry_interval=60.0,
        )
        assert (await gov.check(Context(user="u"))).admitted
        own_redis.stop()  # type: ignore[attr-defined]
        decision = await gov.check(Context(user="u"))
        assert decision.admitted and decision.degraded  # fail-open: local fallback
        text = tel.scrape()
    finally:
        tel.close()
    assert _gauge(text, "mcpbg_governor_degraded") == 1.0
    assert _gauge(text, "mcpbg_governor_fallback_pending") == 1.0
    assert 'mcpbg_degraded="true"' in text


async def test_refusals_logged_once_at_info_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = time.time()
    gov = Governor(
        Policy.of(Limit("burst", cap=1, window=Window.MINUTE, scope=Scope.USER)),
        observer=Observer(log_interval=3600),
        clock=lambda: now,  # one instant: 49 refusals by one minute's "burst"
    )
    with caplog.at_level(logging.INFO, logger="mcp_budget_governor.refusals"):
        for _ in range(50):  # a runaway loop
            await gov.check(Context(user="loop", tenant="acme", tool="search"))
    lines = [r for r in caplog.records if r.name == "mcp_budget_governor.refusals"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    msg = lines[0].getMessage()
    assert (
        "limit=burst" in msg and "reason=budget_exceeded:user/minute" in msg and "user=loop" in msg
    )
    assert gov._obs is not None
    assert gov._obs.refusals.suppressed[("burst", "budget_exceeded:user/minute")] == 48


def test_without_an_observer_opentelemetry_is_never_imported() -> None:
    code = (
        "import asyncio, sys\n"
        "from mcp_budget_governor import Context, Governor, Limit, Policy, Scope, Window\n"
        "g = Governor(Policy.of(Limit('b', cap=1, window=Window.MINUTE, scope=Scope.USER)))\n"
        "asyncio.run(g.check(Context(user='u')))\n"
        "asyncio.run(g.check(Context(user='u')))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')"
        " or m.endswith('.otel')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
