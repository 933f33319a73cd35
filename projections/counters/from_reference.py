"""Move the live counters of mcp-budget-governor 0.1.0 into ours (``mcpbg migrate
--from-reference``), so a user who switches mid-window keeps what was counted.

The reference kept one plain Redis string per counter,
``mcpbg:<limit>:<scope>:<bucket>`` (``reference_keys``); ours are hashes at
``mcpbg:v1:...``. Each reference counter of a limit the policy still has
(same name, window and scope), in a bucket that has not ended, is added to
our counter for the same caller and period, then taken off the old key by
the amount moved: a reference replica still counting meanwhile leaves its
later calls on the old key, for the next run. The charge carries an
operation id made of the old key and the amount, so a run that dies between
the two steps and is run again does not count it twice. Ended buckets are
left to expire: their period is over.

Inline counters only: the amounts moved are not ledger events, so a rebuild
of the counters from the ledger does not see them (it would forget the
current period's calls from before the switch, nothing more).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from mcp_budget_governor import planning
from mcp_budget_governor.counters import CounterOp
from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.policy import Policy
from mcp_budget_governor.reference_keys import (
    NAMESPACE,
    ReferenceCounter,
    parse_reference_key,
    window_end,
)

from .redis import RedisBackend


@dataclass(slots=True)
class Moved:
    """What a run did: ``moved`` (old key, our key, amount), and how many keys it
    left alone because they are not a policy limit's, or their bucket has ended."""

    moved: list[tuple[str, str, int]] = field(default_factory=list)
    unknown: int = 0
    ended: int = 0


def op_id(counter: ReferenceCounter, amount: int) -> str:
    """The operation id of moving ``amount`` from ``counter``: the same on a rerun."""
    return "ref-" + hashlib.sha256(f"{counter.key}\n{amount}".encode()).hexdigest()[:40]


async def _reference_keys(client: Any) -> AsyncIterator[str]:
    async for raw in client.scan_iter(match=f"{NAMESPACE}:*", count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        if not key.startswith(f"{NAMESPACE}:v1:"):
            yield key


async def move_reference_counters(
    backend: RedisBackend, policy: Policy, *, now: float, dry_run: bool = False
) -> Moved:
    """Move every live reference counter of ``policy``'s limits (see the module)."""
    if policy.timezone not in (None, "UTC", "Etc/UTC"):
        raise InvalidInputError(
            "policy.timezone",
            policy.timezone,
            "the reference counted UTC days: move its counters with a UTC policy, "
            "then set the time zone from the next period",
        )
    client = backend.client
    out = Moved()
    async for key in _reference_keys(client):
        counter = parse_reference_key(key, policy)
        if counter is None:
            out.unknown += 1
            continue
        if window_end(counter.limit.window, counter.start).timestamp() <= now:
            out.ended += 1
            continue
        if await client.type(key) not in (b"string", "string"):
            out.unknown += 1
            continue
        raw: Any = await client.get(key)
        try:
            amount = int(raw)
        except (TypeError, ValueError):
            out.unknown += 1
            continue
        if amount <= 0:
            continue
        s = planning.slot(counter.limit, counter.ctx, now, policy.tz, amount, enforce=False)
        assert s is not None  # the context was read from the key: it names every dimension
        if not dry_run:
            op = CounterOp(s.key, amount, s.limit.cap, False, s.expire_at)
            await backend.charge([op], want_used=False, op_id=op_id(counter, amount))
            await client.decrby(key, amount)
        out.moved.append((key, s.key, amount))
    return out
