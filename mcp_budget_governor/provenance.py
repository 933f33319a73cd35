"""Whether a ledger charge is one a governor could have produced.

The ledger topic is input too: anyone who can write to it could otherwise aim
a schema-valid charge at the projection's own keys (watermarks, seen-id sets,
the epoch marker), give a counter an expiry Redis refuses (the apply script
would stop half way through a batch), shorten a counter's life (a budget reset
for free) or meter a negative amount (room for free). A charge is accepted
only if it has the shape the planning rules give it:

- its key is a counter key (:func:`keys.parse_key`, never a ``mcpbg:v1:_*``
  key) of the charge's own limit and bucket, whose scope values are the
  event's context (the key :func:`keys.counter_key` makes of them);
- its bucket is a real bucket of the charge's window (:func:`windows.bucket_of`),
  that had begun at the event's time (and, for the kinds a governor writes at
  once, had not yet ended);
- its expiry is the one :meth:`windows.Bucket.expire_at` gives: the bucket's
  end plus grace, exactly; for a session, at most the event's time plus the
  session TTL (and no earlier than a check planned in the same minute gives);
- its amount is non-zero, with the sign of the event's kind (:data:`SIGNS`);
- no limit is charged twice by one event;
- a closing event (settled, released) that charges nothing names the
  reservation it closes (:func:`closing_problem`).

Pure (no I/O): the fast decoder of the stream worker and the pydantic models
of :mod:`.events` both call :func:`event_problem`, so the two cannot disagree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from . import bounds
from .errors import _show
from .keys import MAX_BUCKET_CHARS, MAX_KEY_CHARS, ParsedKey, escape, parse_key
from .ledger import EntryType
from .memo import BytesCache, text_bytes
from .windows import SESSION_TTL_SECONDS, Bucket, Window, bucket_of


class Sign(Enum):
    """The amounts an event kind may carry."""

    NONE = "no charges"
    POSITIVE = "positive"
    NEGATIVE = "negative"
    NONZERO = "non-zero"


#: What each kind's charges may be, as the governor writes them: a check, a
#: meter and a reservation add; a release returns the whole estimate; a
#: settlement moves the estimate to the real cost either way; a refusal charges
#: nothing. A new kind must say here what it carries (a test holds the two).
SIGNS: Mapping[EntryType, Sign] = {
    EntryType.ADMITTED: Sign.POSITIVE,
    EntryType.REJECTED: Sign.NONE,
    EntryType.METERED: Sign.POSITIVE,
    EntryType.RESERVED: Sign.POSITIVE,
    EntryType.SETTLED: Sign.NONZERO,
    EntryType.RELEASED: Sign.NEGATIVE,
    # ``mcpbg reconcile --fix``: the in-flight amounts of a lost event, of any kind.
    EntryType.RECOVERED: Sign.NONZERO,
    # Run-time changes carry a change, never a charge (a grant is not spend).
    EntryType.CAP_SET: Sign.NONE,
    EntryType.CAP_UNSET: Sign.NONE,
    EntryType.PLAN_ASSIGNED: Sign.NONE,
    EntryType.GRANTED: Sign.NONE,
    EntryType.RESET: Sign.NONE,
}
#: The kinds that close a reservation: every reservation ends with exactly one,
#: naming it in ``reservation``. A settlement whose delta is zero (the estimate
#: stood, or was exact) charges nothing: its charges are empty, never a zero
#: amount, so the projection touches no counter for it (the reserved event's own
#: charge already moves the estimate from in flight to committed) and the
#: non-zero rule above keeps holding for every charge that exists.
CLOSING_KINDS = frozenset({EntryType.SETTLED, EntryType.RELEASED})
_EVENT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: The kinds that carry a ``change`` (and only they do).
CHANGE_KINDS = frozenset(
    {
        EntryType.CAP_SET,
        EntryType.CAP_UNSET,
        EntryType.PLAN_ASSIGNED,
        EntryType.GRANTED,
        EntryType.RESET,
    }
)
_ASSIGNMENT = re.compile(
    r"(?:tenant|user)=(?:[A-Za-z0-9_.\-]|%[0-9A-F]{2})+|(?:tenant|user)=#[0-9a-f]{64}"
)


def change_problem(
    kind: EntryType,
    limit: str,
    key: str,
    field: str,
    amount: int,
    until: int,
    plan: str | None,
    *,
    time: float,
    context: Mapping[str, str | None],
) -> str | None:
    """Why a run-time change cannot be one a governor wrote (None: it can be).

    Caps name their limit's caps hash and a scope segment of that limit's
    shape; assignments the plans hash and a ``tenant=``/``user=`` field;
    grants and resets a counter key of their limit, with its expiry. Every
    number is in its range (:mod:`.bounds`): a cap's ``until`` is 0 or a time
    before year 9999, a grant's or reset's is its counter's expiry (the
    bucket's end plus grace; for a session, at most a session's life past the
    event). The scope it changes is the event's context: a change made for one
    user never reaches another's counter.
    """
    from .caps import PLANS_KEY, caps_key

    if kind in (EntryType.CAP_SET, EntryType.CAP_UNSET):
        if key != caps_key(limit):
            return f"data.change.key: {_show(key)} is not the caps hash of {limit!r}"
        parsed = parse_key(f"mcpbg:v1:{limit}:{field}:x")
        if parsed is None or field == "global":
            return f"data.change.field: {_show(field)} is not a scope value"
        if kind is EntryType.CAP_UNSET and (amount or until):
            return "data.change: an unset carries no cap"
        if until and (why := bounds.problem("until", until)) is not None:
            return f"data.change.until: {why} (got {until})"
        return _scope_problem(parsed, context, "data.change.field")
    if kind is EntryType.PLAN_ASSIGNED:
        if key != PLANS_KEY:
            return f"data.change.key: {_show(key)} is not the plans hash"
        if _ASSIGNMENT.fullmatch(field) is None:
            return f"data.change.field: {_show(field)} is not tenant=<v> or user=<v>"
        if amount or until:
            return "data.change: an assignment carries no amount"
        dim, _, value = field.partition("=")
        mine = context.get(dim)
        if mine is None or escape(mine) != value:
            return f"data.change.field: {_show(field)} is not this event's {dim}"
        return None
    parsed = parse_key(key)
    if parsed is None or parsed.limit != limit:
        return f"data.change.key: {_show(key)} is not a counter of {limit!r}"
    if until <= 0 or plan is not None or field:
        return "data.change: a grant or reset names a counter and its expiry only"
    why = bounds.problem("grant" if kind is EntryType.GRANTED else "reset", amount)
    if why is not None:
        return f"data.change.amount: {why} (got {amount})"
    bucket = _bucket_of_label(parsed.bucket)
    if bucket is None:
        return f"data.change.key: {_show(key)} is in no window's bucket"
    if bucket.end is None:
        latest = math.ceil(time) + SESSION_TTL_SECONDS + 1
        if not 0 < until <= latest:
            return f"data.change.until: {until} is not a session counter's expiry (<= {latest})"
    elif until != bucket.expire_at(0):
        return (
            f"data.change.until: {until} is not its counter's expiry "
            f"(the bucket's end plus grace, {bucket.expire_at(0)})"
        )
    return _scope_problem(parsed, context, "data.change.key")


def _bucket_of_label(label: str) -> Bucket | None:
    """The bucket a counter key's label names, whichever window it is of."""
    if len(label) > MAX_BUCKET_CHARS:
        return None
    for window in Window:
        found = bucket_of(window, label)
        if found is not None:
            return found
    return None


def _scope_problem(parsed: ParsedKey, context: Mapping[str, str | None], where: str) -> str | None:
    """Why the scope values of ``parsed`` are not the event's context (None: they are)."""
    for dim, value, hashed in zip(parsed.dims, parsed.values, parsed.hashed, strict=True):
        mine = context.get(dim.value)
        if dim.value == "session" and context.get("session_root") is not None:
            mine = context.get("session_root")
        if mine is None or (escape(mine) != value if hashed else mine != value):
            return f"{where}: names {dim.value} {_show(value)}, not this event's"
    return None


#: How far past its event time a recovery may set a session counter's expiry: the
#: counter it settles may have been written (and its expiry pushed) long after.
RECOVERED_SESSION_SECONDS = 400 * 86_400
#: Kinds written in the same instant as their charges were planned (a check's
#: plan is reused for the rest of its minute); a settlement or a release reuses
#: the reservation's counter, planned when the reservation began.
_PLANNED_NOW = frozenset({EntryType.ADMITTED, EntryType.METERED, EntryType.RESERVED})


@dataclass(frozen=True, slots=True)
class CounterShape:
    """What a charge's key and bucket say, independent of the event carrying it.

    ``scope`` holds ``(dimension name, value, hashed)`` per scope dimension of
    the key, ready for the per-event check (which runs for every charge).
    """

    key: ParsedKey
    bucket: Bucket
    scope: tuple[tuple[str, str, bool], ...]


# Shapes of recent charges; keys are bounded (MAX_KEY_CHARS) before they are kept.
_SHAPES: BytesCache[tuple[str, str, str, str, int], CounterShape | str] = BytesCache(8 << 20)


def counter_shape(
    limit: str, window: str, bucket: str, key: str, expire_at: int
) -> CounterShape | str:
    """The parts of a charge that do not depend on its event, or why they are wrong."""
    cache_key = (key, limit, window, bucket, expire_at)
    hit = _SHAPES.get(cache_key)
    if hit is not None:
        return hit
    shape = _counter_shape(limit, window, bucket, key, expire_at)
    if len(key) <= MAX_KEY_CHARS and len(bucket) <= MAX_BUCKET_CHARS and len(limit) <= 64:
        _SHAPES.put(cache_key, shape, text_bytes(key, limit, window, bucket))
    return shape


def _counter_shape(
    limit: str, window: str, bucket: str, key: str, expire_at: int
) -> CounterShape | str:
    if len(key) > MAX_KEY_CHARS:
        return f"key is {len(key)} characters, longer than any counter key ({MAX_KEY_CHARS})"
    parsed = parse_key(key)
    if parsed is None:
        return f"key {_show(key)} is not a counter key (mcpbg:v1:<limit>:<scope>:<bucket>)"
    if parsed.limit != limit:
        return f"key {_show(key)} is a counter of limit {parsed.limit!r}, not of {limit!r}"
    if parsed.bucket != bucket:
        return f"key {_show(key)} is in bucket {parsed.bucket!r}, not in {_show(bucket)}"
    try:
        kind = Window(window)
    except ValueError:
        return f"window {_show(window)} is not a window"
    period = bucket_of(kind, bucket) if len(bucket) <= MAX_BUCKET_CHARS else None
    if period is None:
        return f"bucket {_show(bucket)} is not a {kind.value} bucket"
    if period.end is not None:
        want = period.expire_at(0)
        if expire_at != want:
            return f"expire_at {expire_at} is not its bucket's end plus grace ({want})"
    scope = tuple(
        (d.value, v, h) for d, v, h in zip(parsed.dims, parsed.values, parsed.hashed, strict=True)
    )
    return CounterShape(parsed, period, scope)


def charge_problem(
    kind: EntryType,
    time: float,
    context: Mapping[str, str | None],
    shape: CounterShape,
    amount: int,
    expire_at: int,
) -> str | None:
    """Why a charge of an event cannot be a governor's (None: it can be).

    ``shape`` is what :func:`counter_shape` found for it; ``context`` the
    event's context by dimension name (``user``, ``tenant``...).
    """
    sign = SIGNS[kind]
    if (
        sign is Sign.NONE
        or amount == 0
        or (sign is Sign.POSITIVE and amount < 0)
        or (sign is Sign.NEGATIVE and amount > 0)
    ):
        return f"amount {amount}: the charges of {kind.value} events are {sign.value}"
    for dim, value, hashed in shape.scope:
        mine = context.get(dim)
        if dim == "session" and context.get("session_root") is not None:
            mine = context.get("session_root")  # a fork counts on its root's counter
        if mine is None and hashed and kind is EntryType.RECOVERED:
            continue  # a recovery's context comes from its keys: a hashed value has none
        if mine is None or (escape(mine) != value if hashed else mine != value):
            return f"key {_show(shape.key.key)} is not the counter of this event's {dim}"
    period = shape.bucket
    if period.start is None:  # a session: its counter lives on after each write
        latest = math.ceil(time) + SESSION_TTL_SECONDS + 1  # +1: the time's microseconds
        if kind is EntryType.RECOVERED:
            latest = math.ceil(time) + RECOVERED_SESSION_SECONDS
        earliest = math.floor(time / 60) * 60 + SESSION_TTL_SECONDS
        if expire_at > latest or (kind in _PLANNED_NOW and expire_at < earliest):
            return f"expire_at {expire_at} is not a session's ({earliest}..{latest})"
        return None
    assert period.end is not None
    if time < period.start or (kind in _PLANNED_NOW and time > period.end):
        return f"bucket {period.label!r} does not hold the event's time"
    return None


def closing_problem(
    kind: EntryType, event_id: str, reservation: str | None, charged: bool
) -> str | None:
    """Why a closing event's link to its reservation cannot be a governor's (None: fine).

    A settlement or release that charges nothing (``charged`` False: a zero
    delta) is only the record that its reservation ended, so it must say which
    one: ``reservation`` is an event id (a UUID, as :func:`ledger.new_id`
    makes) and not the event's own. One with charges is checked by its charges
    (older ledgers wrote those without insisting on the link).
    """
    if kind not in CLOSING_KINDS or charged:
        return None
    if reservation is None:
        return f"data.reservation: a {kind.value} event without charges names its reservation"
    if len(reservation) != 36 or _EVENT_ID.fullmatch(reservation) is None:
        return f"data.reservation: {_show(reservation)} is not a reserved event's id"
    if reservation == event_id:
        return "data.reservation: an event cannot close itself"
    return None


def event_problem(
    kind: EntryType,
    time: float,
    context: Mapping[str, str | None],
    charges: Sequence[tuple[str, str, str, str, int, int]],
    *,
    event_id: str = "",
    reservation: str | None = None,
) -> str | None:
    """Why an event's charges cannot be a governor's, naming the first bad one; None if fine.

    ``charges`` are ``(limit, window, bucket, key, amount, expire_at)``;
    ``event_id`` and ``reservation`` the event's own id and the reservation it
    names (:func:`closing_problem`).
    """
    if charges and SIGNS[kind] is Sign.NONE:
        return f"data.charges: {kind.value} events carry no charges"
    problem = closing_problem(kind, event_id, reservation, bool(charges))
    if problem is not None:
        return problem
    limits: set[str] = set()
    for i, (limit, window, bucket, key, amount, expire_at) in enumerate(charges):
        if limit in limits:
            return f"data.charges.{i}: limit {limit!r} is charged twice"
        limits.add(limit)
        shape = counter_shape(limit, window, bucket, key, expire_at)
        problem = (
            shape
            if isinstance(shape, str)
            else charge_problem(kind, time, context, shape, amount, expire_at)
        )
        if problem is not None:
            return f"data.charges.{i}: {problem}"
    return None
