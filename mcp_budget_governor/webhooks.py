"""Signed alert webhooks: what the worker adds to each POST, and how a receiver checks it.

Every webhook request carries two headers (the secret is ``MCPBG_ALERT_WEBHOOK_SECRET``):

- ``X-Mcpbg-Timestamp``: the Unix time of the attempt, in whole seconds;
- ``X-Mcpbg-Signature``: ``v1=`` and the lowercase hex HMAC-SHA256, keyed with the
  secret's UTF-8 bytes, of ``<timestamp>.<body>`` (the body's bytes as sent).

A receiver recomputes the signature over the body it got and compares in
constant time (an altered body or timestamp fails), refuses a timestamp more
than :data:`TOLERANCE` seconds from its clock (an old request replayed later
fails), and remembers the ids of the events it accepted within that window
(the same request replayed at once fails). docs/alerts.md has the receiver's
snippet, which needs only the standard library; :func:`verify` is the same rule.

>>> headers = sign("s3cret", b'{"id":"a"}', timestamp=1_800_000_000)
>>> verify("s3cret", b'{"id":"a"}', headers, now=1_800_000_010)
>>> verify("s3cret", b'{"id":"b"}', headers, now=1_800_000_010)
Traceback (most recent call last):
...
mcp_budget_governor.webhooks.SignatureError: the signature does not match the body
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

from .errors import GovernorError

TIMESTAMP_HEADER = "X-Mcpbg-Timestamp"
SIGNATURE_HEADER = "X-Mcpbg-Signature"
#: Seconds a signed request stays acceptable either side of the receiver's clock.
TOLERANCE = 300


class SignatureError(GovernorError):
    """A webhook request that is not the worker's, altered, or too old."""


def signature(secret: str, body: bytes, timestamp: int) -> str:
    """``v1=<hex HMAC-SHA256 of "<timestamp>.<body>">``."""
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"v1={mac.hexdigest()}"


def sign(secret: str, body: bytes, *, timestamp: int | None = None) -> dict[str, str]:
    """The headers that sign ``body`` now (or at ``timestamp``)."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: signature(secret, body, ts)}


def verify(
    secret: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float | None = None,
    tolerance: int = TOLERANCE,
) -> None:
    """Raise :class:`SignatureError` unless ``headers`` sign ``body`` within ``tolerance``."""
    lower = {k.lower(): v for k, v in headers.items()}
    raw = lower.get(TIMESTAMP_HEADER.lower(), "")
    if not raw.isdigit():
        raise SignatureError(f"no {TIMESTAMP_HEADER} header of whole seconds")
    if abs((time.time() if now is None else now) - int(raw)) > tolerance:
        raise SignatureError(f"the timestamp {raw} is more than {tolerance} s from now")
    given = lower.get(SIGNATURE_HEADER.lower(), "")
    if not hmac.compare_digest(given, signature(secret, body, int(raw))):
        raise SignatureError("the signature does not match the body")
