"""An in-memory ledger: entries kept in a list, in order.

For tests and single-process experiments; it is lost with the process. Its
``project()`` applies the entries through a backend's ``apply`` exactly as
the stream worker does, offsets being list positions.
"""

from __future__ import annotations

from mcp_budget_governor.approval import Approval
from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, Backend, hold_roles
from mcp_budget_governor.ledger import LedgerEntry


class MemoryLedger:
    """Keeps every appended entry in ``entries``."""

    def __init__(self) -> None:
        self.entries: list[LedgerEntry] = []

    async def append(self, entry: LedgerEntry) -> None:
        self.entries.append(entry)

    async def aclose(self) -> None:
        return None

    def events(self, start: int = 0, stop: int | None = None) -> list[AppliedEvent]:
        """Entries ``[start:stop]`` as the projection sees them (offset = position)."""
        out = []
        for offset, entry in enumerate(self.entries[start:stop], start=start):
            charges = tuple(AppliedCharge(c.key, c.amount, c.expire_at) for c in entry.charges)
            opens, closes = hold_roles(entry.type.value, entry.reservation, charges)
            changes = () if entry.change is None else (entry.change,)
            spent = tuple((a.once, a.until) for a in entry.approved if isinstance(a, Approval))
            out.append(
                AppliedEvent(offset, entry.id, entry.time, charges, changes, opens, closes, spent)
            )
        return out

    async def project(
        self, backend: Backend, *, partition: str = "memory:0", start: int = 0, batch: int = 500
    ) -> int:
        """Apply entries from ``start`` through ``backend``; returns how many were new."""
        applied = 0
        events = self.events(start)
        for i in range(0, len(events), batch):
            applied += await backend.apply(partition, events[i : i + batch])
        return applied
