"""Counter keys: ``mcpbg:v1:<limit>:<scope>:<bucket>``.

This scheme is a contract: changing it would silently reset every budget, so
golden vectors in the tests pin it.

Scope values come from callers and may hold anything (separators, braces,
newlines, megabytes). Each value is percent-encoded (everything except
``A-Z a-z 0-9 _ . -`` becomes ``%XX`` of its UTF-8 bytes), which is injective
and leaves no ``:``, ``=``, ``,``, ``{`` or ``}`` in the key. A value whose
encoding would exceed ``MAX_VALUE_CHARS`` is replaced by ``#`` and its SHA-256:
``#`` never survives encoding, so the two forms cannot collide.

A key is therefore at most :data:`MAX_KEY_CHARS` long, whatever the values;
:func:`escape` remembers its recent answers in a cache bounded in bytes, and
never keeps a value longer than ``MAX_VALUE_CHARS`` (those are hashed anyway).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from .memo import BytesCache, text_bytes
from .reference_keys import (  # mcp-budget-governor 0.1.0's keys functions, here too
    MIN_TTL_SECONDS as MIN_TTL_SECONDS,
)
from .reference_keys import NAMESPACE as NAMESPACE
from .reference_keys import bucket as bucket
from .reference_keys import now_utc as now_utc
from .reference_keys import reference_key
from .reference_keys import retry_after_seconds as retry_after_seconds
from .reference_keys import ttl_seconds as ttl_seconds
from .reference_keys import window_end as window_end
from .scopes import Dimensions, Scope
from .windows import SESSION_BUCKET

# A limit's name, as it may stand in a key. A leading "_" is reserved: the projection's
# own keys live at mcpbg:v1:_<name>.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")

PREFIX = "mcpbg:v1"
GLOBAL_SCOPE = "global"
MAX_VALUE_CHARS = 192
_SAFE_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-"
_SAFE = frozenset(_SAFE_BYTES)
#: The longest bucket label a key may end with (the ledger schema's bound).
MAX_BUCKET_CHARS = 64
#: The longest counter key: a 64-character limit name, every dimension at its
#: longest escaped value, a 64-character bucket label.
MAX_KEY_CHARS = (
    len(PREFIX)
    + 1
    + 64
    + 1
    + sum(len(d.value) + 1 + MAX_VALUE_CHARS + 1 for d in Scope)
    - 1
    + 1
    + MAX_BUCKET_CHARS
)

#: A session counter's key ends so: scope values are escaped (no ``:``), so the
#: last segment is always the bucket label.
SESSION_SUFFIX = ":" + SESSION_BUCKET


def slides(key: str) -> bool:
    """Whether a counter's expiry slides with each write: a session's counter lives
    ``windows.SESSION_TTL_SECONDS`` after its last write; a window's ends with its
    bucket (lua/charge.lua flag 's').

    >>> slides("mcpbg:v1:chat:session=s_1:session"), slides("mcpbg:v1:burst:user=u:20260101")
    (True, False)
    """
    return key.endswith(SESSION_SUFFIX)


# Recent escapes: 8 MiB at most, whatever callers send (see memo.BytesCache).
_ESCAPED: BytesCache[str, str] = BytesCache(8 << 20)


def escape(value: str) -> str:
    """Encode one scope value for a key segment.

    >>> escape("a:b{c}")
    'a%3Ab%7Bc%7D'
    """
    hit = _ESCAPED.get(value)
    if hit is not None:
        return hit
    out = _escape(value)
    if len(value) <= MAX_VALUE_CHARS:  # a longer one is hashed: never worth keeping
        _ESCAPED.put(value, out, text_bytes(value, out))
    return out


def _escape(value: str) -> str:
    raw = value.encode("utf-8")
    if len(value) > MAX_VALUE_CHARS:  # every character encodes to one or more: hashed
        return "#" + hashlib.sha256(raw).hexdigest()
    if not raw.translate(None, _SAFE_BYTES):  # nothing to encode (most ids): at C speed
        return value
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(out) > MAX_VALUE_CHARS:
        return "#" + hashlib.sha256(raw).hexdigest()
    return out


def scope_segment(dims: Dimensions, values: tuple[str, ...]) -> str:
    """``user=alice`` or ``tenant=acme,tool=search``; ``global`` for no scope."""
    if not dims:
        return GLOBAL_SCOPE
    return ",".join(f"{d.value}={escape(v)}" for d, v in zip(dims, values, strict=True))


def counter_key(limit: Any, scope: Any, bucket: Any) -> str:
    """The Redis key of one counter.

    >>> counter_key("burst", "user=u_42", "20261129T1914")
    'mcpbg:v1:burst:user=u_42:20261129T1914'

    ``counter_key(limit, scope_map, moment)`` (a :class:`Limit`, Scope -> value, a
    datetime) is mcp-budget-governor 0.1.0's key (:func:`reference_key`).
    """
    if limit.__class__ is not str:
        return reference_key(limit, scope, bucket)
    return f"{PREFIX}:{limit}:{scope}:{bucket}"


#: Keys under this prefix are the projection's own, never counters.
INTERNAL_PREFIX = f"{PREFIX}:_"
#: Hash of partition -> last applied offset, advanced by the projection.
WATERMARK_KEY = f"{PREFIX}:_applied"
#: Prefix of the per-day sets of applied event ids (``<prefix>:20261129``).
SEEN_PREFIX = f"{PREFIX}:_seen"
#: Prefix of the projection's open reservations (``<prefix>:<reserved event id>``: counter
#: key -> estimate, until its counters expire; ``counters.Holds``).
HOLD_PREFIX = f"{PREFIX}:_res"
#: Present while Redis holds a complete projection; its loss means Redis restarted empty.
EPOCH_KEY = f"{PREFIX}:_epoch"
#: What the epoch marker holds (a rebuild's id): a string of this shape, nothing else.
#: ``epoch_ok`` in lua/lib.lua checks the same (a test holds the two together).
EPOCH_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
#: The key of the TypeScript SDK middleware's default approval seal (the HMAC key
#: of a 2026-07-28 client's ``requestState``), shared by every replica on this Redis:
#: 64 hex digits, created once with SET NX (ts/src/keys.ts APPROVAL_KEY); Python's
#: FastMCP replicas seal their request state under it too (fastmcp.shared_request_state).
APPROVAL_KEY = f"{PREFIX}:_approval"
#: Prefix of the markers of spent approvals (``<prefix>:<one-time id>``,
#: approval.py): charged with the admission an approval allows, in the same atomic
#: step, so a second use finds it and is refused (ts/src/keys.ts SPENT_PREFIX).
SPENT_PREFIX = f"{PREFIX}:_spent"
#: Prefix of the markers of applied inline charges (``<prefix>:<operation id>``).
OP_PREFIX = f"{PREFIX}:_op"
#: How long an inline charge's operation marker lives (mirrored in ``lua/charge.lua``).
#: The marker only has to outlive the charge's replay, which follows an outage within a
#: second of Redis answering again; a marker kept for its bucket's life would hold a
#: month bucket's every charge. A replay after a longer outage may count a charge whose
#: reply was lost a second time: the safe direction for a budget.
OP_HORIZON_SECONDS = 900


#: The sorted set of one concurrency cap's leases for one scope value:
#: ``mcpbg:v1:_lease:<limit>:<scope>``, member the lease id, score its expiry
#: (epoch milliseconds). Internal (``_``): never a counter, never on the ledger.
LEASE_PREFIX = f"{PREFIX}:_lease"


def lease_key(limit: str, scope: str) -> str:
    """The key of the leases of concurrency cap ``limit`` for one scope value.

    >>> lease_key("parallel", "user=u_42")
    'mcpbg:v1:_lease:parallel:user=u_42'
    """
    return f"{LEASE_PREFIX}:{limit}:{scope}"


QUEUE_PREFIX = f"{PREFIX}:_wait"


def queue_key(lease_set: str) -> str:
    """The queue of calls waiting for a slot of lease set ``lease_set`` (lua/lib.lua
    ``waiters_ahead``). The lease set is its hash tag, so in Redis Cluster both share
    one slot (scope values escape braces, so the set's name holds none).

    >>> queue_key("mcpbg:v1:_lease:parallel:user=u_42")
    'mcpbg:v1:_wait:{mcpbg:v1:_lease:parallel:user=u_42}'
    """
    return f"{QUEUE_PREFIX}:{{{lease_set}}}"


def parse_lease_key(key: str) -> ParsedKey | None:
    """Take a lease-set key apart (bucket ``lease``); None for anything else.

    >>> parse_lease_key("mcpbg:v1:_lease:parallel:user=u_42").values
    ('u_42',)
    """
    if not key.startswith(LEASE_PREFIX + ":"):
        return None
    return parse_key(f"{PREFIX}:{key[len(LEASE_PREFIX) + 1 :]}:lease")


def op_key(op_id: str) -> str:
    """The marker key of an inline charge's operation id (see ``lua/charge.lua``)."""
    return f"{OP_PREFIX}:{op_id}"


@dataclass(frozen=True, slots=True)
class ParsedKey:
    """A counter key taken apart: the inverse of :func:`counter_key`.

    ``values`` are the scope values as the caller gave them, except where a
    value was too long and the key holds ``#`` and its SHA-256 instead:
    ``hashed[i]`` is then true and ``values[i]`` is that ``#<hex>`` token,
    since the original cannot be recovered from it.

    >>> key = counter_key("per_tool", scope_segment((Scope.USER, Scope.TOOL), ("a:b", "search")),
    ...                   "20261129")
    >>> key
    'mcpbg:v1:per_tool:user=a%3Ab,tool=search:20261129'
    >>> parse_key(key).values, parse_key(key).key == key
    (('a:b', 'search'), True)
    """

    limit: str
    dims: Dimensions
    values: tuple[str, ...]
    hashed: tuple[bool, ...]
    bucket: str

    @property
    def scope(self) -> str:
        """The key's scope segment: ``user=alice``, ``tenant=acme,tool=search``, ``global``.

        >>> parse_key("mcpbg:v1:per_tool:user=a%3Ab,tool=search:20261129").scope
        'user=a%3Ab,tool=search'
        """
        if not self.dims:
            return GLOBAL_SCOPE
        segments = (v if h else escape(v) for v, h in zip(self.values, self.hashed, strict=True))
        return ",".join(f"{d.value}={s}" for d, s in zip(self.dims, segments, strict=True))

    @property
    def key(self) -> str:
        """The key this was parsed from."""
        return counter_key(self.limit, self.scope, self.bucket)


_HASHED = re.compile(r"#[0-9a-f]{64}")
_ENCODED = re.compile(r"(?:[A-Za-z0-9_.\-]|%[0-9A-F]{2})*")
_DIM_ORDER = {s: i for i, s in enumerate(Scope)}


def unescape(segment: str) -> str:
    """Decode one escaped scope value; ValueError unless ``segment`` is what
    :func:`escape` makes of some value (the hashed form included, returned as is).

    >>> unescape("a%3Ab%7Bc%7D")
    'a:b{c}'
    """
    if _HASHED.fullmatch(segment):
        return segment
    if not _ENCODED.fullmatch(segment):
        raise ValueError(f"not an escaped scope value: {segment!r}")
    value = unquote_to_bytes(segment).decode("utf-8")  # strict: invalid UTF-8 raises
    if escape(value) != segment:
        raise ValueError(f"not an escaped scope value: {segment!r}")  # e.g. too long unhashed
    return value


def parse_key(key: str) -> ParsedKey | None:
    """Take a counter key apart; None for anything else (the projection's own
    ``mcpbg:v1:_*`` keys, other prefixes, a key no context could produce).

    >>> parse_key("mcpbg:v1:per_tool:user=a%3Ab,tool=search:20261129")
    ParsedKey(limit='per_tool', dims=(<Scope.USER: 'user'>, <Scope.TOOL: 'tool'>), \
values=('a:b', 'search'), hashed=(False, False), bucket='20261129')
    """
    parts = key.split(":")
    if len(parts) != 5 or f"{parts[0]}:{parts[1]}" != PREFIX:
        return None
    _, _, limit, scope, bucket = parts
    # A limit name cannot start with "_": that marks the projection's own keys.
    if not NAME_PATTERN.fullmatch(limit) or not bucket:
        return None
    if scope == GLOBAL_SCOPE:
        return ParsedKey(limit, (), (), (), bucket)
    dims: list[Scope] = []
    values: list[str] = []
    hashed: list[bool] = []
    for item in scope.split(","):
        dim, sep, segment = item.partition("=")
        try:
            scope_dim = Scope(dim)
            value = unescape(segment)
        except ValueError:
            return None
        if not sep or (dims and _DIM_ORDER[scope_dim] <= _DIM_ORDER[dims[-1]]):
            return None  # keys list dimensions once each, in canonical order
        dims.append(scope_dim)
        values.append(value)
        hashed.append(segment.startswith("#"))
    return ParsedKey(limit, tuple(dims), tuple(values), tuple(hashed), bucket)


#: The one wildcard of a key pattern (see :func:`key_pattern`).
WILDCARD = "*"
_GLOB_SPECIAL = frozenset("*?[]\\^")


def key_pattern(limit: str, dims: Dimensions, values: Mapping[Scope, str], bucket: str) -> str:
    """A pattern for the keys of ``limit`` in ``bucket`` whose scope has ``values``.

    A dimension missing from ``values`` matches any value (``*``). The fixed
    parts are escaped keys, so they hold none of Redis's glob characters: the
    pattern means the same to Redis ``SCAN MATCH`` and to :func:`pattern_regex`.

    >>> key_pattern("per_tool", (Scope.USER, Scope.TOOL), {Scope.USER: "a:b"}, "20261129")
    'mcpbg:v1:per_tool:user=a%3Ab,tool=*:20261129'
    """
    if not dims:
        scope = GLOBAL_SCOPE
    else:
        scope = ",".join(
            f"{d.value}={escape(values[d]) if d in values else WILDCARD}" for d in dims
        )
    pattern = counter_key(limit, scope, bucket)
    literal = pattern.replace(WILDCARD, "")
    if any(c in _GLOB_SPECIAL for c in literal):
        raise ValueError(f"a key pattern cannot hold glob characters: {pattern!r}")
    return pattern


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of a :func:`key_pattern` (``*``: any run of characters)."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split(WILDCARD)), re.DOTALL)
