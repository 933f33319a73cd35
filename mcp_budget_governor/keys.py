"""Counter keys: ``mcpbg:v1:<limit>:<scope>:<bucket>``.

This scheme is a contract: changing it would silently reset every budget, so
golden vectors in the tests pin it.

Scope values come from callers and may hold anything (separators, braces,
newlines, megabytes). Each value is percent-encoded (everything except
``A-Z a-z 0-9 _ . -`` becomes ``%XX`` of its UTF-8 bytes), which is injective
and leaves no ``:``, ``=``, ``,``, ``{`` or ``}`` in the key. A value whose
encoding would exceed ``MAX_VALUE_CHARS`` is replaced by ``#`` and its SHA-256:
``#`` never survives encoding, so the two forms cannot collide.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from .scopes import Dimensions

PREFIX = "mcpbg:v1"
GLOBAL_SCOPE = "global"
MAX_VALUE_CHARS = 192
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")


@lru_cache(maxsize=65_536)
def escape(value: str) -> str:
    """Encode one scope value for a key segment.

    >>> escape("a:b{c}")
    'a%3Ab%7Bc%7D'
    """
    raw = value.encode("utf-8")
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(out) > MAX_VALUE_CHARS:
        return "#" + hashlib.sha256(raw).hexdigest()
    return out


def scope_segment(dims: Dimensions, values: tuple[str, ...]) -> str:
    """``user=alice`` or ``tenant=acme,tool=search``; ``global`` for no scope."""
    if not dims:
        return GLOBAL_SCOPE
    return ",".join(f"{d.value}={escape(v)}" for d, v in zip(dims, values, strict=True))


def counter_key(limit: str, scope: str, bucket: str) -> str:
    """The Redis key of one counter.

    >>> counter_key("burst", "user=u_42", "20261129T1914")
    'mcpbg:v1:burst:user=u_42:20261129T1914'
    """
    return f"{PREFIX}:{limit}:{scope}:{bucket}"


#: Hash of partition -> last applied offset, advanced by the projection.
WATERMARK_KEY = f"{PREFIX}:_applied"
#: Prefix of the per-day sets of applied event ids (``<prefix>:20261129``).
SEEN_PREFIX = f"{PREFIX}:_seen"
#: Present while Redis holds a complete projection; its loss means Redis restarted empty.
EPOCH_KEY = f"{PREFIX}:_epoch"
