"""A running ``mcpbg serve`` app over a real Redis and a file ledger of governed calls,
for the API tests and the browser tests (tests/test_serve.py, tests/test_browser.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp_budget_governor import Context, Governor, RedisBackend
from mcp_budget_governor.console.api import Console, build_app
from mcp_budget_governor.console.auth import Tokens
from mcp_budget_governor.policy_file import load_policy
from mcp_budget_governor.producers.file_ledger import FileLedger
from testing.buckets import room
from testing.services import RedisService
from testing.thread_server import ThreadServer

READ = "read-token-0123456789abcdef"
WRITE = "write-token-0123456789abcdef"

POLICY = """
[[limits]]
name = "burst"
cap = 3
window = "minute"
scope = "user"

[[limits]]
name = "tenant_spend"
cap_usd = "1.00"
window = "day"
scope = "tenant"

[[limits]]
name = "global_spend"
cap_usd = "1.50"
window = "day"
breaker = true
gated = false
"""


@dataclass
class Served:
    url: str
    policy: Path
    ledger: Path
    redis_url: str
    server: ThreadServer


async def governed_calls(policy: Path, redis_url: str, ledger: Path) -> None:
    """Calls of two tenants: admitted, metered, refused by burst, then by the breaker."""
    gov = Governor(
        load_policy(str(policy)),
        RedisBackend.from_url(redis_url, timeout=5.0),
        ledger=FileLedger(ledger, fsync="always"),
    )
    async with gov:
        await room(60, needed=10)  # "burst" is a minute's: each user's 4th call is refused
        for user, tenant, cost in (
            ("u1", "acme", 200_000),
            ("u2", "acme", 50_000),
            ("u3", "globex", 300_000),
        ):
            ctx = Context(user=user, tenant=tenant, tool="search")
            for _ in range(4):  # the 4th is refused by burst
                d = await gov.check(ctx)
                if d.admitted:
                    await gov.meter(("tenant_spend", "global_spend"), cost, ctx)
        # $1.65 spent: the breaker sheds the next caller.
        assert not (await gov.check(Context(user="u4", tenant="globex", tool="fetch"))).admitted


@contextmanager
def serve_console(folder: Path, service: RedisService, db: int) -> Iterator[Served]:
    """The app on a loopback port, over Redis database ``db`` of ``service`` (a db of its
    own, claimed by ``RedisService.claimed``: an external server's must be empty, and it
    is emptied at the end) and a file ledger in ``folder`` holding :func:`governed_calls`."""
    policy = folder / "policy.toml"
    policy.write_text(POLICY)
    ledger = folder / "ledger"
    with service.claimed(db) as url:
        asyncio.run(governed_calls(policy, url, ledger))

        async def build() -> tuple[Any, Any]:
            pol = load_policy(str(policy))
            backend = RedisBackend.from_url(url, timeout=5.0)
            gov = Governor(pol, backend)  # writes straight to the counters (no ledger)
            tokens = Tokens(READ, WRITE)
            console = Console(pol, backend, tokens, ledger_dir=str(ledger), governor=gov)
            return build_app(console), gov

        server = ThreadServer(build).start()
        try:
            yield Served(server.url, policy, ledger, url, server)
        finally:
            server.stop()
