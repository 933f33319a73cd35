"""The Governor's run-time changes applied (``set_cap``, ``unset_cap``, ``assign_plan``,
``grant``, ``reset``): built by :mod:`.admin`, then appended to the ledger (projected
like a charge) or, with no ledger, written to the counters store now.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import admin, bounds, reading
from .caps import Change
from .context import Context
from .counters import Backend
from .errors import GovernorError, InvalidInputError
from .ledger import EntryType, Ledger, LedgerEntry, new_id
from .outage import Outage
from .policy import Policy


async def grant(
    policy: Policy,
    backend: Backend,
    outage: Outage,
    limit: str,
    scope: Mapping[str, str],
    amount: int,
    *,
    now: float,
    reason: str,
    actor: str,
) -> tuple[Change, Context]:
    """The grant of ``amount`` on ``limit``'s current counter, its sum checked first."""
    change, ctx = admin.grant_change(
        policy, limit, scope, amount, now=now, reason=reason, actor=actor
    )
    # The sum is checked before it is applied: the counter's cap and grants so far
    # plus this one stay in the exact range, where every backend counts alike.
    slot = reading.slot_of(policy, limit, ctx, now)
    ((_, room_cap),) = await reading.read(backend, outage, (slot,))
    why = bounds.sum_problem("grant", room_cap, change.amount)
    if why is not None:
        raise InvalidInputError(
            "amount",
            amount,
            f"the counter's cap and grants ({room_cap}) plus this one "
            f"would leave the exact range (at most {bounds.MAX_AMOUNT})",
        )
    return change, ctx


async def reset(
    policy: Policy,
    backend: Backend,
    limit: str,
    scope: Mapping[str, str],
    *,
    now: float,
    reason: str,
    actor: str,
) -> tuple[Change, Context]:
    """The grant that restores the current period's room to the cap, keeping the
    recorded spend: what the counter has spent now (replayed as that same value)."""
    probe, _ = admin.grant_change(policy, limit, scope, 1, now=now)
    (used,) = await backend.usage([probe.key])
    return admin.grant_change(
        policy, limit, scope, None, now=now, used=used, reason=reason, actor=actor
    )


async def apply(
    change: Change, ctx: Context, ledger: Ledger | None, backend: Backend, now: float
) -> bool:
    """Append ``change`` to the ledger, or write it to the counters; returns whether it
    was written now (then plans cached under the old caps are stale)."""
    if ledger is not None:
        kind = EntryType(change.kind.value)
        await ledger.append(LedgerEntry(new_id(), kind, now, ctx, (), change=change))
        return False
    writer: Any = getattr(backend, "change", None)
    if writer is None:
        raise GovernorError(f"{type(backend).__name__} stores no run-time changes; use a ledger")
    await writer([change])
    return True
