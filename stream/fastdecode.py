"""A fast, strict decoder of ledger records for the projection's hot path.

Full validation with the pydantic models of :mod:`mcp_budget_governor.events`
costs about 29 us per event, more than half of what projecting one costs. The
projection only needs the id, the time and each charge's key, amount and
expiry, but it must not apply a record the full parse would dead-letter, and
the dead letter must carry the full parse's reason. So :func:`decode` checks
the *whole* record against the same schema, with plain Python on the dict
``orjson`` returns, and accepts only the exact shape the producers write
(:func:`mcp_budget_governor.events.encode`): anything unusual (a time not in
``YYYY-MM-DDTHH:MM:SS.ffffffZ`` form, a float amount, an unknown field, a
boolean where an integer belongs...) returns None, and the caller falls back
to :func:`~mcp_budget_governor.events.parse`, whose verdict and reason then
stand. The rule the tests hold it to (a hypothesis property test over valid,
mutated and corrupted records):

    ``decode(raw)`` is not None  =>  ``parse(raw)`` succeeds, and
    ``to_applied(parse(raw), offset) == decode(raw, offset).event``.

Every check here is at least as strict as the model's; some are stricter
(they only cost a fall back to the full parse, never a different verdict).
Whether the charges are ones a governor could have produced is the one rule
of :mod:`mcp_budget_governor.provenance`, which the models apply too. The
caches here hold caller-chosen strings, so they are bounded in bytes
(:class:`~mcp_budget_governor.memo.BytesCache`), never just in entries.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any, NamedTuple

import orjson

from mcp_budget_governor.bounds import LATEST_TIME
from mcp_budget_governor.caps import Change, ChangeKind
from mcp_budget_governor.counters import AppliedCharge, AppliedEvent, hold_roles
from mcp_budget_governor.events import (
    ChangeData,
    Charge,
    Decided,
    EventContext,
    EventData,
    MeteredEvent,
    Tokens,
    type_name,
)
from mcp_budget_governor.keys import MAX_KEY_CHARS, PREFIX
from mcp_budget_governor.ledger import EntryType
from mcp_budget_governor.limits import NAME_PATTERN
from mcp_budget_governor.memo import BytesCache, text_bytes
from mcp_budget_governor.money import MAX_AMOUNT, Unit
from mcp_budget_governor.provenance import (
    CHANGE_KINDS,
    CounterShape,
    change_problem,
    charge_problem,
    closing_problem,
    counter_shape,
)
from mcp_budget_governor.windows import Window

__all__ = ["Decoded", "DecodedCharge", "decode"]


class DecodedCharge(NamedTuple):
    """What the alert evaluator reads of a charge (see ``alerts.ChargeRef``)."""

    limit: str
    bucket: str
    key: str
    amount: int
    expire_at: int


class Decoded(NamedTuple):
    """A record the fast path accepted: the event as ``apply`` takes it, and its charges."""

    event: AppliedEvent
    charges: tuple[DecodedCharge, ...]


_TYPES = frozenset(type_name(kind) for kind in EntryType)
_KINDS = {type_name(kind): kind for kind in EntryType}
_REJECTED = type_name(EntryType.REJECTED)
_RECOVERED = type_name(EntryType.RECOVERED)
# The field sets come from the pydantic models, the one definition of the schema:
# a field added there reaches this decoder's "exact shape" check too.
_TOP = frozenset(MeteredEvent.model_fields)
_DATA = frozenset(EventData.model_fields)
_CONTEXT = frozenset(EventContext.model_fields)
_CHARGE = frozenset(Charge.model_fields)
_DECISION = frozenset(Decided.model_fields)
_USAGE = frozenset(Tokens.model_fields)
_CHANGE = frozenset(ChangeData.model_fields)
_USAGE_COUNTS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")
# A concurrency cap's leases never reach the ledger (events.Charge refuses them too).
_UNITS = frozenset(u.value for u in Unit if u is not Unit.CONCURRENT)
_WINDOWS = frozenset(w.value for w in Window)
_KEY_PREFIX = f"{PREFIX}:"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _limit_ok(name: str) -> bool:
    # Length first: the cache below must never keep a megabyte name.
    return len(name) <= 64 and _name_ok(name)


@lru_cache(maxsize=4096)
def _name_ok(name: str) -> bool:
    return NAME_PATTERN.fullmatch(name) is not None


_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}")
_seconds: dict[str, int] = {}


def _epoch_second(text: str) -> int | None:
    """Epoch seconds of ``YYYY-MM-DDTHH:MM:SS`` in UTC, None when it is no valid time."""
    if _DATE.fullmatch(text) is None:
        return None
    try:
        moment = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
    return int(moment.replace(tzinfo=UTC).timestamp())


_EMPTY: list[Any] = []


def _usage_ok(usage: Any) -> bool:
    if usage is None:
        return True
    if type(usage) is not dict or not usage.keys() <= _USAGE:
        return False
    model = usage.get("model")
    if type(model) is not str or not model:
        return False
    if "input_tokens" not in usage or "output_tokens" not in usage:
        return False
    for name in _USAGE_COUNTS:
        value = usage.get(name, 0)
        if type(value) is not int or not 0 <= value <= MAX_AMOUNT:
            return False
    version = usage.get("price_version")
    return version is None or type(version) is str


def _decision_ok(decision: Any) -> bool:
    if type(decision) is not dict or not decision.keys() <= _DECISION:
        return False
    if "approved" in decision:
        return False  # an approval is rare: the full parse checks it
    limit = decision.get("limit")
    if limit is not None and (type(limit) is not str or not _limit_ok(limit)):
        return False
    status = decision.get("status", 200)
    if type(status) is not int or not 100 <= status <= 599:
        return False
    over = decision.get("over", _EMPTY)
    if over is not _EMPTY:
        if type(over) is not list:
            return False
        for name in over:
            if type(name) is not str or not _limit_ok(name):
                return False
    return type(decision.get("degraded", False)) is bool


# Charges repeat (the same counter, amount and expiry, call after call): the
# objects built for one are reused, 16 MiB of them at most.
_CACHE_SIZE = 65_536
_charges: BytesCache[
    tuple[str, str, str, str, int, int], tuple[DecodedCharge, AppliedCharge, CounterShape]
] = BytesCache(16 << 20)


def decode(raw: bytes, offset: int) -> Decoded | None:
    """The record at ``offset`` as ``apply`` takes it, or None: ask the full parse.

    None means only "not the common, clean shape": the record may still be a
    valid event (the full parse decides), and when it is not, the full parse
    gives the reason.
    """
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    # The envelope: required fields, types, no unknown field.
    if type(doc) is not dict or not doc.keys() <= _TOP:
        return None
    try:
        event_id = doc["id"]
        kind = doc["type"]
        source = doc["source"]
        stamp = doc["time"]
        data = doc["data"]
        version = doc["specversion"]
    except KeyError:
        return None
    if (
        version != "1.0"
        or type(version) is not str
        or type(event_id) is not str
        or len(event_id) != 36
        or _UUID.fullmatch(event_id) is None
        or type(kind) is not str
        or kind not in _TYPES
        or type(source) is not str
        or not source
        or type(stamp) is not str
        or type(data) is not dict
        or not data.keys() <= _DATA
    ):
        return None
    subject = doc.get("subject")
    if subject is not None and type(subject) is not str:
        return None
    if "datacontenttype" in doc and doc["datacontenttype"] != "application/json":
        return None
    # The exact form events.encode writes (YYYY-MM-DDTHH:MM:SS.ffffffZ); any other
    # RFC 3339 form goes to the full parse.
    if len(stamp) != 27 or stamp[19] != "." or stamp[26] != "Z":
        return None
    micros = stamp[20:26]
    if not (micros.isascii() and micros.isdigit()):
        return None
    second = _seconds.get(stamp[:19])
    if second is None:
        second = _epoch_second(stamp[:19])
        if second is None or not 0 <= second < LATEST_TIME:
            return None  # no time, or one out of range: the full parse says why
        if len(_seconds) >= _CACHE_SIZE:
            _seconds.clear()
        _seconds[stamp[:19]] = second
    # data: context (required), decision, usage, reservation, charges.
    context = data.get("context")
    if type(context) is not dict or not context.keys() <= _CONTEXT:
        return None
    for value in context.values():
        if value is not None and type(value) is not str:
            return None
    if context.get("session_root") is not None and context.get("session") is None:
        return None  # the model refuses a root without its fork: let it say so
    if "decision" in data and not _decision_ok(data["decision"]):
        return None
    if not _usage_ok(data.get("usage")):
        return None
    changes: tuple[Change, ...] = ()
    if "change" in data or _KINDS[kind] in CHANGE_KINDS:
        at = (second * 1_000_000 + int(micros)) / 1_000_000
        change = _change(_KINDS[kind], data.get("change"), at, context)
        if change is None:
            return None
        changes = (change,)
    reservation = data.get("reservation")
    if reservation is not None and type(reservation) is not str:
        return None
    raw_charges = data.get("charges", _EMPTY)
    if type(raw_charges) is not list:
        return None
    if raw_charges and kind == _REJECTED:
        return None  # the model refuses a rejection with charges
    if not raw_charges and kind == _RECOVERED:
        return None  # and a recovery without any
    if not raw_charges and closing_problem(_KINDS[kind], event_id, reservation, False):
        return None  # a zero-delta close without its reservation: the full parse says why
    decoded: list[DecodedCharge] = []
    applied: list[AppliedCharge] = []
    event_kind = _KINDS[kind]
    when: float | None = None
    limits: set[str] = set()
    for charge in raw_charges:
        if type(charge) is not dict or charge.keys() != _CHARGE:
            return None
        limit = charge["limit"]
        amount = charge["amount"]
        bucket = charge["bucket"]
        key = charge["key"]
        expire_at = charge["expire_at"]
        unit = charge["unit"]
        window = charge["window"]
        if (
            type(amount) is not int
            or type(expire_at) is not int
            or type(limit) is not str
            or type(bucket) is not str
            or type(key) is not str
            or type(unit) is not str
            or type(window) is not str
        ):
            return None
        if unit not in _UNITS or window not in _WINDOWS:
            return None
        cache_key = (key, limit, window, bucket, amount, expire_at)
        hit = _charges.get(cache_key)
        if hit is None:
            if (
                not _limit_ok(limit)
                or not -MAX_AMOUNT <= amount <= MAX_AMOUNT
                or not 1 <= len(bucket) <= 64
                or not key.startswith(_KEY_PREFIX)
                or len(key) > MAX_KEY_CHARS
                or not 0 < expire_at <= LATEST_TIME
            ):
                return None
            shape = counter_shape(limit, window, bucket, key, expire_at)
            if isinstance(shape, str):
                return None  # not a governor's charge: the full parse says why
            hit = (
                DecodedCharge(limit, bucket, key, amount, expire_at),
                AppliedCharge(key, amount, expire_at),
                shape,
            )
            _charges.put(cache_key, hit, text_bytes(key, limit, window, bucket) + 200)
        if when is None:
            when = (second * 1_000_000 + int(micros)) / 1_000_000
        if limit in limits or charge_problem(event_kind, when, context, hit[2], amount, expire_at):
            return None
        limits.add(limit)
        decoded.append(hit[0])
        applied.append(hit[1])
    # What datetime.timestamp() computes for an aware time: the same float, bit for bit.
    if when is None:
        when = (second * 1_000_000 + int(micros)) / 1_000_000
    charged = tuple(applied)
    opens, closes = hold_roles(event_kind.value, reservation, charged)
    return Decoded(
        AppliedEvent(offset, event_id, when, charged, changes, opens, closes), tuple(decoded)
    )


def _change(kind: EntryType, change: Any, time: float, context: dict[str, Any]) -> Change | None:
    """A run-time change of the exact shape events.encode writes, checked as the model
    checks it (provenance.change_problem); None: ask the full parse."""
    if kind not in CHANGE_KINDS or type(change) is not dict or change.keys() != _CHANGE:
        return None
    limit, key, field = change["limit"], change["key"], change["field"]
    amount, until, plan = change["amount"], change["until"], change["plan"]
    actor, reason = change["actor"], change["reason"]
    if (
        type(limit) is not str
        or not _limit_ok(limit)
        or type(key) is not str
        or not key.startswith(_KEY_PREFIX)
        or len(key) > 1024
        or type(field) is not str
        or len(field) > 1024
        or type(amount) is not int
        or not 0 <= amount <= MAX_AMOUNT
        or type(until) is not int
        or until < 0
        or (plan is not None and (type(plan) is not str or not _limit_ok(plan)))
        or type(actor) is not str
        or len(actor) > 256
        or type(reason) is not str
        or len(reason) > 1024
    ):
        return None
    if (
        change_problem(kind, limit, key, field, amount, until, plan, time=time, context=context)
        is not None
    ):
        return None
    return Change(ChangeKind(kind.value), limit, key, field, amount, until, plan, actor, reason)
