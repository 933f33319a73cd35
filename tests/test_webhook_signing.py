"""Signed alert webhooks: the worker's WebhookSink signs, and the receiver snippet of
docs/alerts.md, run as written, accepts it once and refuses a replayed, altered or stale one."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mcp_budget_governor import Unit, Window
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.stream.alerts.event import Alert
from mcp_budget_governor.stream.alerts.sinks import WebhookSink
from mcp_budget_governor.webhooks import SignatureError, sign, verify

DOCS = Path(__file__).resolve().parents[1] / "docs" / "alerts.md"
SECRET = "a-long-random-secret"


def documented_verifier() -> Any:
    """``verify_mcpbg_webhook`` as docs/alerts.md writes it (its own module, like a paste)."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    (block,) = [b for b in blocks if "def verify_mcpbg_webhook" in b]
    namespace: dict[str, Any] = {}
    exec(compile(block, str(DOCS), "exec"), namespace)
    namespace["seen"].clear()
    return namespace["verify_mcpbg_webhook"]


class Receiver:
    """A webhook receiver on loopback that answers 204 to what the snippet accepts, else 401."""

    def __init__(self) -> None:
        self.verify = documented_verifier()
        self.requests: list[tuple[bytes, dict[str, str]]] = []
        self.accepted: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = dict(self.headers.items())
                receiver.requests.append((body, headers))
                try:
                    alert = receiver.verify(SECRET, body, headers)
                except ValueError:
                    self.send_response(401)
                else:
                    receiver.accepted.append(alert["id"])
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/mcpbg"

    def post(self, body: bytes, headers: dict[str, str]) -> int:
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.server.serve_forever, daemon=True)
    thread.start()
    yield r
    r.server.shutdown()
    r.server.server_close()


def _alert() -> Alert:
    return Alert(
        "threshold", "spend", "user=alice", "mcpbg:v1:spend:user=alice:20261129", "20261129",
        Window.DAY, 80, 800, 1000, Unit.USD_MICROS, False, time.time(),
    )  # fmt: skip


def test_the_documented_receiver_accepts_a_signed_alert_once(receiver: Receiver) -> None:
    alert = _alert()
    sink = WebhookSink(receiver.url, secret=SECRET, retries=0)

    async def send() -> None:
        try:
            await sink.send(alert)
        finally:
            await sink.aclose()

    asyncio.run(send())
    assert receiver.accepted == [alert.id]
    body, headers = receiver.requests[0]
    # The same request again: refused (the id was seen).
    assert receiver.post(body, headers) == 401
    # An altered body under the original signature: refused.
    altered = body.replace(b'"level":80', b'"level":10')
    assert altered != body
    assert receiver.post(altered, headers) == 401
    # A request signed ten minutes ago: refused, however genuine.
    old = _alert()
    stale = old.to_json()
    assert receiver.post(stale, sign(SECRET, stale, timestamp=int(time.time()) - 600)) == 401
    # Unsigned, or signed with another key: refused.
    fresh = _alert().to_json()
    assert receiver.post(fresh, {}) == 401
    assert receiver.post(fresh, sign("another-secret-16chars", fresh)) == 401
    assert receiver.accepted == [alert.id]


def test_unsigned_by_default_and_a_short_secret_is_refused(receiver: Receiver) -> None:
    sink = WebhookSink(receiver.url, retries=0)
    assert sink.secret is None
    with pytest.raises(InvalidInputError, match="secret"):
        WebhookSink(receiver.url, secret="short")


def test_verify_is_the_same_rule() -> None:
    body = b'{"id":"x"}'
    headers = sign(SECRET, body, timestamp=1_800_000_000)
    verify(SECRET, body, headers, now=1_800_000_299)
    with pytest.raises(SignatureError, match="from now"):
        verify(SECRET, body, headers, now=1_800_000_301)
    with pytest.raises(SignatureError, match="does not match"):
        verify(SECRET, body + b" ", headers, now=1_800_000_000)
    with pytest.raises(SignatureError, match="whole seconds"):
        verify(SECRET, body, {}, now=1_800_000_000)
