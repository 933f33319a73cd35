"""The Governor's recording of work done (meters, settlements, a reservation's
release): the slots charged in one call and appended as one ledger event, both
made even when the caller is cancelled meanwhile; a charge may be sent without
awaiting its reply (``meter_behind``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from . import planning
from .context import Context
from .counters import Backend, ChargeResult, CounterOp
from .errors import BackendBusyError, BackendUnavailableError
from .ledger import EntryType, Ledger, LedgerEntry, TokenUsage, new_id
from .outage import Outage
from .planning import Slot

log = logging.getLogger("mcp_budget_governor")

#: The governor's charge (:func:`.admission.charge`, bound to it): ops, event id, keywords.
Charge = Callable[..., Awaitable[ChargeResult]]


async def record(
    ledger: Ledger | None,
    backend: Backend,
    outage: Outage,
    charge: Charge,
    detached: set[asyncio.Future[None]],
    slots: Sequence[Slot],
    ctx: Context,
    kind: EntryType,
    usage: TokenUsage | None,
    now: float,
    *,
    reservation: str | None,
    want_used: bool,
    detach: bool,
) -> tuple[int | None, bool, int | None]:
    """Charge ``slots`` in one call and append them as one ledger event; the
    caller runs it to its end (:func:`.shielding.to_the_end`), so both are made
    even when it is cancelled meanwhile (then raised after).

    Returns the first slot's total before the charge (with ``want_used``,
    when a counter answered, else None), whether the shared counters
    were unreachable, and the first slot's effective cap with grants (None:
    its default). ``detach``: the reply is awaited in the background, its task
    kept in ``detached`` meanwhile.
    """
    cap: int | None = None
    ledgered = ledger is not None
    event_id = new_id() if ledgered else None
    op_id = None if event_id is not None else new_id()
    degraded = False
    before: int | None = None
    # Nothing to count or read (a settlement's zero delta): no round trip.
    idle = not want_used and not any(s.amount for s in slots)
    on_wire = (
        sent(backend, outage, [s.op for s in slots], event_id, op_id)
        if detach and not idle
        else None
    )
    if on_wire is not None:
        task = asyncio.ensure_future(_detached_reply(outage, ledgered, on_wire, slots, op_id))
        detached.add(task)
        task.add_done_callback(detached.discard)
    elif not idle:
        try:
            result = await charge([s.op for s in slots], event_id, want_used=want_used, op_id=op_id)
            if want_used and result.used:
                before = result.used[0]
                cap = result.caps[0] if result.caps else None
        except BackendUnavailableError:
            degraded = True
            before = await outage.charge_failed(slots, op_id, ledgered=ledgered)
        except BackendBusyError:
            # A completed call is charged whatever the store's load: inline mode
            # keeps it for the next charge to replay (the ledger carries it).
            outage.keep_for_later(slots, op_id, ledgered=ledgered)
    if ledger is not None and event_id is not None:
        await ledger.append(
            LedgerEntry(
                event_id, kind, now, ctx, planning.ledger_charges(slots),
                usage=usage, degraded=degraded, reservation=reservation,
            )
        )  # fmt: skip
    return before, degraded, cap


def sent(
    backend: Backend,
    outage: Outage,
    ops: Sequence[CounterOp],
    event_id: str | None,
    op_id: str | None,
    *,
    want_used: bool = False,
) -> Awaitable[ChargeResult] | None:
    """The charge written at once, its reply not awaited (``charge_sent``), or None."""
    send: Any = getattr(backend, "charge_sent", None)
    if send is None or outage.down_until:
        return None
    on_wire: Awaitable[ChargeResult] = send(
        ops, event_id=event_id, want_used=want_used, op_id=op_id
    )
    return on_wire


async def _detached_reply(
    outage: Outage,
    ledgered: bool,
    on_wire: Awaitable[ChargeResult],
    slots: Sequence[Slot],
    op_id: str | None,
) -> None:
    """The reply of a charge nobody waits for: a failure goes where a waited one would."""
    try:
        await on_wire
    except BackendUnavailableError:
        outage.mark_down()
        await outage.charge_failed(slots, op_id, ledgered=ledgered)
    except Exception:
        log.exception("a metered charge sent without waiting failed")
