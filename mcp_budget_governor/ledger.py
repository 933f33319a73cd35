"""What the governor appends to the ledger, and the interface a ledger offers.

Entries are plain data; producers (``mcp_budget_governor.producers``) decide
how they travel (Kafka, a file, memory). Each charge carries its bucket and
counter key, computed from the entry's time by the producer side, so a late
projection lands in the right bucket by construction.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

import uuid_utils

from .caps import Change
from .context import Context
from .money import Unit
from .windows import Window

#: The ledger topic when none is named (``--topic`` or its variable, ``settings.SETTINGS``).
DEFAULT_TOPIC = "mcpbg.ledger"


def partition_key(tenant: object, user: object) -> bytes:
    """The ledger's partition key: the tenant, else the user, so one scope stays in order.

    >>> partition_key("acme", "u1"), partition_key(None, "u1"), partition_key(None, None)
    (b'acme', b'u1', b'-')
    """
    scope = tenant if tenant is not None else user
    return b"-" if scope is None else str(scope).encode()


def partition_of(key: bytes, partitions: int) -> int:
    """The partition (an index into the sorted partition ids) of a record's key: CRC-32.

    >>> partition_of(b"acme", 6) == partition_of(partition_key("acme", "u9"), 6)
    True
    """
    return zlib.crc32(key) % partitions


class EntryType(StrEnum):
    """One entry per admission, rejection, metered cost, reservation, settlement, release;
    and a recovery (``mcpbg reconcile --fix``) for an operation whose event was lost."""

    ADMITTED = "admitted"
    REJECTED = "rejected"
    METERED = "metered"
    RESERVED = "reserved"
    SETTLED = "settled"
    RELEASED = "released"
    RECOVERED = "recovered"
    # Run-time changes (caps.ChangeKind): no charges, a ``change`` instead.
    CAP_SET = "cap_set"
    CAP_UNSET = "cap_unset"
    PLAN_ASSIGNED = "plan_assigned"
    GRANTED = "granted"
    RESET = "reset"


@dataclass(frozen=True, slots=True)
class LedgerCharge:
    """A signed amount charged to one counter."""

    limit: str
    unit: Unit
    amount: int
    window: Window
    bucket: str
    key: str
    expire_at: int


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """The tokens behind a metered cost, so it can be re-derived and audited."""

    model: str
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    price_version: str | None = None


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One ledger event. ``id`` (a UUIDv7) is the idempotency key end to end."""

    id: str
    type: EntryType
    time: float
    context: Context
    charges: tuple[LedgerCharge, ...] = ()
    limit: str | None = None
    status: int = 200
    over: tuple[str, ...] = ()
    usage: TokenUsage | None = None
    degraded: bool = False
    reservation: str | None = field(default=None)
    change: Change | None = None
    #: ``OnExceed.ASK`` limits the user approved going over for this call.
    approved: tuple[str, ...] = ()


def new_id() -> str:
    """A time-ordered UUIDv7."""
    return str(uuid_utils.uuid7())


def id_time(event_id: str) -> float | None:
    """When a UUIDv7 event id was made (epoch seconds, to the millisecond); None if
    ``event_id`` is not a UUIDv7.

    >>> id_time("01938f5e-0000-7000-8000-000000000000")
    1733277122.56
    """
    digits = event_id.replace("-", "")
    if len(digits) != 32 or digits[12] != "7":
        return None
    try:
        return int(digits[:12], 16) / 1000
    except ValueError:
        return None


@runtime_checkable
class Ledger(Protocol):
    """Somewhere entries are appended, in order, never lost."""

    async def append(self, entry: LedgerEntry) -> None:
        """Append one entry; must not block the hot path for long."""
        ...

    async def aclose(self) -> None:
        """Flush what is buffered and release resources."""
        ...

    # Optional: ``prepare(entry) -> None``, called while the governor waits for the
    # counters' reply with the entry it will most likely append (admitted, nothing
    # over), so the ledger can encode it meanwhile; the append that follows may be of
    # that very object, or of another entry (then the preparation is forgotten).
