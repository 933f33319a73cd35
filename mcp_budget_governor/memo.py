"""Caches bounded in bytes, for values derived from caller-chosen strings.

A cache bounded only in entries lets a caller pin memory by sending long,
distinct names (65,536 entries of one megabyte each is 64 GiB). These caches
count the bytes of what they hold (``sys.getsizeof`` of the key's and value's
strings, plus a fixed overhead per entry) and start over when the budget is
reached; what does not fit one entry's share is simply not kept.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: What one entry costs besides its strings: the dict slot, the tuple and object headers.
ENTRY_OVERHEAD = 160


def text_bytes(*parts: object) -> int:
    """The memory ``parts`` hold (their ``sys.getsizeof``), plus :data:`ENTRY_OVERHEAD`."""
    return ENTRY_OVERHEAD + sum(sys.getsizeof(p) for p in parts)


class BytesCache(dict[K, V]):
    """A dict holding at most ``max_bytes`` (as :meth:`put` is told), emptied when full.

    A dict itself, so ``get`` is the dict's own (the hot paths look up far more
    often than they store).

    >>> cache: BytesCache[str, int] = BytesCache(1 << 20)
    >>> cache.put("a", 1, text_bytes("a")); cache.get("a"), cache.get("b")
    (1, None)
    """

    __slots__ = ("max_bytes", "max_entry", "size")

    def __init__(self, max_bytes: int, *, max_entry: int | None = None) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        #: The largest entry kept (default: 1/64 of the budget); larger ones are not cached.
        self.max_entry = max_bytes // 64 if max_entry is None else max_entry
        #: Bytes held now, as told to :meth:`put`.
        self.size = 0

    def put(self, key: K, value: V, size: int) -> None:
        """Keep ``value`` under ``key``, ``size`` bytes; nothing if larger than ``max_entry``."""
        if size > self.max_entry or key in self:
            return
        if self.size + size > self.max_bytes:
            self.clear()
        self[key] = value
        self.size += size

    def clear(self) -> None:
        super().clear()
        self.size = 0
