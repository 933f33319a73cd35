"""Ledger events: CloudEvents 1.0 in structured JSON, one per operation.

Any CloudEvents consumer can read the ledger. The envelope is ``specversion``,
``id`` (a UUIDv7, the idempotency key end to end), ``source``, ``type``
(``mcpbg.<kind>.v1``), ``time``, ``subject``, ``datacontenttype`` and ``data``.
``data`` carries the caller's context, the signed charges with the bucket and
counter key each falls in (computed by the producer from the event time), the
decision, and for metered model calls the token usage and price-table version.

The pydantic models below are the schema (``mcpbg schema`` prints it) and the
parser every consumer uses. The hot path does not build them: it encodes its
plain :class:`LedgerEntry` with :func:`encode`, whose output the models accept
(a property test holds the two together).

>>> from mcp_budget_governor.context import Context
>>> from mcp_budget_governor.ledger import EntryType, LedgerEntry
>>> entry = LedgerEntry("01938f5e-0000-7000-8000-000000000000", EntryType.ADMITTED,
...                     1764442477.0, Context(user="u_42"))
>>> parse(encode(entry, "/mcpbg/doc")).type
'mcpbg.admitted.v1'
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from functools import lru_cache
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from . import bounds
from .approval import Approval
from .bounds import LATEST_TIME
from .caps import Change, ChangeKind
from .context import Context, cacheable
from .errors import GovernorError
from .keys import PREFIX
from .ledger import EntryType, LedgerCharge, LedgerEntry, TokenUsage
from .limits import NAME_PATTERN
from .money import MAX_AMOUNT, Unit
from .provenance import CHANGE_KINDS, change_problem, event_problem
from .windows import Window

SPECVERSION = "1.0"
CONTENT_TYPE = "application/json"
SCHEMA_VERSION = "v1"

Amount = Annotated[int, Field(strict=True, ge=-MAX_AMOUNT, le=MAX_AMOUNT)]
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_AMOUNT)]
LimitName = Annotated[str, StringConstraints(pattern=f"^{NAME_PATTERN.pattern}$")]
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class MalformedEventError(GovernorError, ValueError):
    """A ledger record that is not a valid event; ``reason`` says why."""

    def __init__(self, reason: str, raw: bytes | str | None = None) -> None:
        self.reason = reason
        self.raw = raw
        super().__init__(reason)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EventContext(_Model):
    """Who the operation was for; any dimension may be unknown."""

    user: str | None = None
    tenant: str | None = None
    tool: str | None = None
    session: str | None = None
    agent: str | None = None
    #: The session a forked ``session`` descends from (its budget's key); absent
    #: when the session is its own root.
    session_root: str | None = None
    #: The hash of the call's tool and arguments (a loop guard's counter); absent
    #: when no limit counts identical calls.
    call: str | None = None

    @model_validator(mode="after")
    def _root_has_fork(self) -> EventContext:
        if self.session_root is not None and self.session is None:
            raise ValueError(f"session_root {self.session_root!r} needs a session")
        return self


class Charge(_Model):
    """A signed amount on one counter, in the bucket the event's time falls in."""

    limit: LimitName
    unit: Unit
    amount: Amount
    window: Window
    bucket: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    key: Annotated[str, StringConstraints(pattern=f"^{PREFIX}:")]
    expire_at: Annotated[int, Field(strict=True, gt=0)]

    @field_validator("unit")
    @classmethod
    def _spend(cls, unit: Unit) -> Unit:
        # A concurrency cap's leases never reach the ledger: no governor writes this.
        if unit is Unit.CONCURRENT:
            raise ValueError("a concurrency cap holds leases, never ledger charges")
        return unit


class Tokens(_Model):
    """The model call behind a metered cost, so the cost can be re-derived."""

    model: Annotated[str, StringConstraints(min_length=1)]
    input_tokens: Count
    output_tokens: Count
    cache_read_tokens: Count = 0
    cache_write_tokens: Count = 0
    price_version: str | None = None


class Spent(_Model):
    """An approval the admission spent: its one-time id and when it lapses. The
    projection restores its marker from here (``approval.spend_op``), so a store
    rebuilt from the ledger still refuses a second use."""

    limit: LimitName
    once: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
    until: Annotated[int, Field(strict=True, gt=0, le=LATEST_TIME)]


class Decided(_Model):
    """The governor's answer: refusing limit and status, shadow limits over, fail mode."""

    limit: LimitName | None = None
    status: Annotated[int, Field(strict=True, ge=100, le=599)] = 200
    over: tuple[LimitName, ...] = ()
    degraded: bool = False
    #: ``OnExceed.ASK`` limits the user approved going over (written only when any).
    approved: tuple[LimitName, ...] = ()
    #: The one-time approvals the admission spent (written only when any).
    spent: tuple[Spent, ...] = ()


class ChangeData(_Model):
    """A run-time change (``caps.Change``): who made it (``actor``), why (``reason``).

    ``key`` is the caps hash (cap_set, cap_unset), the plans hash
    (plan_assigned) or the counter (granted, reset); ``field`` the scope
    segment or ``tenant=``/``user=`` field; ``amount`` the cap, the grant
    added, or the grant a reset sets; ``until`` a cap's end (0: for good) or
    the counter's expiry; ``plan`` the assigned plan (None: back to the policy's).
    """

    limit: LimitName
    key: Annotated[str, StringConstraints(pattern=f"^{PREFIX}:", max_length=1024)]
    field: Annotated[str, StringConstraints(max_length=1024)] = ""
    amount: Count = 0
    until: Annotated[int, Field(strict=True, ge=0, le=LATEST_TIME)] = 0
    plan: LimitName | None = None
    actor: Annotated[str, StringConstraints(max_length=256)] = ""
    reason: Annotated[str, StringConstraints(max_length=1024)] = ""


class EventData(_Model):
    context: EventContext
    charges: tuple[Charge, ...] = ()
    decision: Decided = Decided()
    usage: Tokens | None = None
    reservation: str | None = None
    change: ChangeData | None = None


class _Event(_Model):
    specversion: Literal["1.0"]
    id: Annotated[str, StringConstraints(pattern=_UUID.pattern)]
    source: Annotated[str, StringConstraints(min_length=1)]
    time: datetime
    subject: str | None = None
    datacontenttype: Literal["application/json"] = "application/json"
    data: EventData

    def model_post_init(self, _: Any) -> None:
        # The topic is input: only charges a governor could have written (see provenance).
        charges = self.data.charges
        moment = self.time.timestamp()
        why = bounds.problem("time", math.floor(moment))
        if why is not None:
            raise PydanticCustomError("time", "time: {why} (got {at})", {"why": why, "at": moment})
        problem = event_problem(
            _KINDS[self.type],  # type: ignore[attr-defined]
            self.time.timestamp(),
            self.data.context.__dict__,
            [(c.limit, c.window.value, c.bucket, c.key, c.amount, c.expire_at) for c in charges],
            event_id=self.id,
            reservation=self.data.reservation,
        )
        kind = _KINDS[self.type]  # type: ignore[attr-defined]
        decision = self.data.decision
        if (
            problem is None
            and decision.spent
            and (
                kind is not EntryType.ADMITTED
                or not {s.limit for s in decision.spent} <= set(decision.approved)
            )
        ):
            problem = "data.decision.spent: only an admission spends its approvals"
        change = self.data.change
        if problem is None and (change is None) == (kind in CHANGE_KINDS):
            problem = (
                f"data.change: {kind.value} events carry a change"
                if change is None
                else f"data.change: {kind.value} events carry no change"
            )
        if problem is None and change is not None:
            problem = change_problem(
                kind,
                change.limit,
                change.key,
                change.field,
                change.amount,
                change.until,
                change.plan,
                time=self.time.timestamp(),
                context=self.data.context.__dict__,
            )
        if problem is not None:
            # A custom error: the reason reads as is, without pydantic's "Value error, ".
            raise PydanticCustomError("charge", "{problem}", {"problem": problem})


class AdmittedEvent(_Event):
    """A check admitted the call; its gated charges (calls) are here."""

    type: Literal["mcpbg.admitted.v1"]


class RejectedEvent(_Event):
    """A check or reservation refused the call; it charged nothing."""

    type: Literal["mcpbg.rejected.v1"]


class MeteredEvent(_Event):
    """What a completed call cost, always charged."""

    type: Literal["mcpbg.metered.v1"]


class ReservedEvent(_Event):
    """An estimate held before expensive work."""

    type: Literal["mcpbg.reserved.v1"]


class SettledEvent(_Event):
    """A reservation closed at its real cost; ``reservation`` links it. Its charges are the
    signed delta, none when the estimate stood or was exact (then the link is required)."""

    type: Literal["mcpbg.settled.v1"]


class ReleasedEvent(_Event):
    """A reservation returned whole (the work never ran)."""

    type: Literal["mcpbg.released.v1"]


class RecoveredEvent(_Event):
    """An operation Redis charged in flight whose own event never reached the ledger (its
    process died between the charge and the append), settled by ``mcpbg reconcile --fix``.

    It carries the lost event's ``id`` and time (from the UUIDv7) and the charges Redis
    holds in flight under that id, so the projection commits them exactly once: if the
    original turns up later it is a duplicate id, skipped like any redelivery (and the
    ledger view prefers the original's rows). The context is what the counter keys name.
    """

    type: Literal["mcpbg.recovered.v1"]

    def model_post_init(self, context: Any) -> None:
        if not self.data.charges:
            raise ValueError("a recovered event carries the charges it settles")
        super().model_post_init(context)  # and only charges a governor could have written


class CapSetEvent(_Event):
    """A run-time cap for one scope value of a limit (``mcpbg caps set``)."""

    type: Literal["mcpbg.cap_set.v1"]


class CapUnsetEvent(_Event):
    """A run-time cap removed: the policy's caps apply again (``mcpbg caps unset``)."""

    type: Literal["mcpbg.cap_unset.v1"]


class PlanAssignedEvent(_Event):
    """A tenant or user moved to a plan at run time (``mcpbg plans assign``)."""

    type: Literal["mcpbg.plan_assigned.v1"]


class GrantedEvent(_Event):
    """Extra room on one counter for its current period; not a refund (``mcpbg grant``)."""

    type: Literal["mcpbg.granted.v1"]


class ResetEvent(_Event):
    """One counter's room restored to its cap, its spend kept (``mcpbg reset``)."""

    type: Literal["mcpbg.reset.v1"]


EVENT_TYPES: tuple[type[_Event], ...] = (
    AdmittedEvent,
    RejectedEvent,
    MeteredEvent,
    ReservedEvent,
    SettledEvent,
    ReleasedEvent,
    RecoveredEvent,
    CapSetEvent,
    CapUnsetEvent,
    PlanAssignedEvent,
    GrantedEvent,
    ResetEvent,
)
LedgerEvent = Annotated[
    AdmittedEvent
    | RejectedEvent
    | MeteredEvent
    | ReservedEvent
    | SettledEvent
    | ReleasedEvent
    | RecoveredEvent
    | CapSetEvent
    | CapUnsetEvent
    | PlanAssignedEvent
    | GrantedEvent
    | ResetEvent,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[LedgerEvent] = TypeAdapter(LedgerEvent)


def type_name(kind: EntryType) -> str:
    """``mcpbg.metered.v1`` for ``EntryType.METERED``."""
    return f"mcpbg.{kind.value}.{SCHEMA_VERSION}"


_TYPE_NAMES = {kind: type_name(kind) for kind in EntryType}
_KINDS = {name: kind for kind, name in _TYPE_NAMES.items()}


def rfc3339(epoch: float) -> str:
    """Epoch seconds as the RFC 3339 UTC time of a CloudEvent, to the microsecond.

    The one formatter of event times: ledger events and alerts.

    >>> rfc3339(1764442477.25), rfc3339(-0.5)
    ('2025-11-29T18:54:37.250000Z', '1969-12-31T23:59:59.500000Z')
    """
    whole = math.floor(epoch)  # not int(): before 1970 the fraction still counts forward
    micros = round((epoch - whole) * 1_000_000)
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    return f"{_second(whole)}.{micros:06d}Z"


@lru_cache(maxsize=1024)
def _second(whole: int) -> str:
    return datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _subject(ctx: Context) -> str | None:
    for dim in ("user", "tenant", "agent", "session", "tool"):
        value = getattr(ctx, dim)
        if value is not None:
            return f"{dim}/{value}"
    return None


# The context and the charges of a hot caller repeat call after call (the
# governor reuses one plan per context and minute), so their JSON is made once
# and embedded as a pre-serialised fragment.
def _context_json(ctx: Context) -> tuple[orjson.Fragment, str | None]:
    # Only contexts short enough are kept: the cache stays small in bytes.
    return _cached_context_json(ctx) if cacheable(ctx) else _make_context_json(ctx)


@lru_cache(maxsize=4096)
def _cached_context_json(ctx: Context) -> tuple[orjson.Fragment, str | None]:
    return _make_context_json(ctx)


def _make_context_json(ctx: Context) -> tuple[orjson.Fragment, str | None]:
    fields = {
        "user": ctx.user,
        "tenant": ctx.tenant,
        "tool": ctx.tool,
        "session": ctx.session,
        "agent": ctx.agent,
    }
    if ctx.session_root is not None:  # written only when set: older events read the same
        fields["session_root"] = ctx.session_root
    if ctx.call is not None:  # likewise
        fields["call"] = ctx.call
    return orjson.Fragment(orjson.dumps(fields)), _subject(ctx)


@lru_cache(maxsize=4096)
def _charges_json(charges: tuple[LedgerCharge, ...]) -> orjson.Fragment:
    return orjson.Fragment(
        orjson.dumps(
            [
                {
                    "limit": c.limit,
                    "unit": c.unit.value,
                    "amount": c.amount,
                    "window": c.window.value,
                    "bucket": c.bucket,
                    "key": c.key,
                    "expire_at": c.expire_at,
                }
                for c in charges
            ]
        )
    )


def encode(entry: LedgerEntry, source: str) -> bytes:
    """One structured-mode CloudEvent as compact UTF-8 JSON, built without validation.

    orjson writes it, with the repeating parts cached: a few microseconds an
    event, and this runs once per governed call. A check's event (no usage, no
    reservation) of a cacheable context is joined from a cached template around
    its id and time: the same bytes, a fraction of the work.
    """
    if (
        entry.usage is None
        and entry.reservation is None
        and entry.change is None
        and not entry.approved
    ):
        key = (
            entry.context,
            id(entry.charges),
            entry.type,
            entry.limit,
            entry.status,
            entry.over,
            entry.degraded,
            source,
        )
        template = _TEMPLATES.get(key)
        if template is None or template[0] is not entry.charges:
            # Only contexts short enough are kept: the cache stays small in bytes.
            template = _template(entry, source, key) if cacheable(entry.context) else None
        if template is not None and _PLAIN_ID.fullmatch(entry.id) is not None:
            _, mid, tail = template
            return b"".join((_HEAD, entry.id.encode(), mid, rfc3339(entry.time).encode(), tail))
    return orjson.dumps(_event(entry, source, entry.id, rfc3339(entry.time)))


# The templates of check events, keyed by everything but the id and the time; the
# charges by identity (the governor reuses one tuple per context and minute), the
# entry keeping that tuple alive, so its id cannot be reused while it is cached.
_TEMPLATES: dict[tuple[Any, ...], tuple[tuple[LedgerCharge, ...], bytes, bytes]] = {}
_TEMPLATES_MAX = 4096
_HEAD = b'{"specversion":"1.0","id":"'
_TIME = b',"time":"'
# An id spliced in as is must need no JSON escaping: a UUID (what new_id makes).
_PLAIN_ID = re.compile(r"[0-9a-fA-F-]{1,64}")


def _template(
    entry: LedgerEntry, source: str, key: tuple[Any, ...]
) -> tuple[tuple[LedgerCharge, ...], bytes, bytes] | None:
    """The event's JSON split around an empty id and time: (charges, mid, tail)."""
    blank = orjson.dumps(_event(entry, source, "", ""))
    if not blank.startswith(_HEAD + b'"'):  # pragma: no cover - the envelope's order is fixed
        return None
    # The first ',"time":"' after the id: the source and type before it are JSON
    # strings, whose quotes are escaped, so it cannot occur inside them.
    at = blank.index(_TIME, len(_HEAD)) + len(_TIME)
    template = (entry.charges, blank[len(_HEAD) : at], blank[at:])
    if len(_TEMPLATES) >= _TEMPLATES_MAX:
        _TEMPLATES.clear()
    _TEMPLATES[key] = template
    return template


def _event(entry: LedgerEntry, source: str, event_id: str, time: str) -> dict[str, Any]:
    context, subject = _context_json(entry.context)
    usage = entry.usage
    event: dict[str, Any] = {
        "specversion": SPECVERSION,
        "id": event_id,
        "source": source,
        "type": _TYPE_NAMES[entry.type],
        "time": time,
        "subject": subject,
        "datacontenttype": CONTENT_TYPE,
        "data": {
            "context": context,
            "charges": _charges_json(entry.charges),
            "decision": {
                "limit": entry.limit,
                "status": entry.status,
                "over": entry.over,
                "degraded": entry.degraded,
            },
            "usage": None
            if usage is None
            else {
                "model": usage.model,
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "cache_read_tokens": usage.cache_read_tokens,
                "cache_write_tokens": usage.cache_write_tokens,
                "price_version": usage.price_version,
            },
            "reservation": entry.reservation,
        },
    }
    if entry.approved:  # written only when any: other events read as before
        event["data"]["decision"]["approved"] = entry.approved
        # An approval.Approval carries its one-time id: the projection marks it spent.
        spent = [
            {"limit": a, "once": a.once, "until": a.until}
            for a in entry.approved
            if isinstance(a, Approval)
        ]
        if spent:
            event["data"]["decision"]["spent"] = spent
    change = entry.change
    if change is not None:  # only run-time changes carry one: other events keep their bytes
        event["data"]["change"] = {
            "limit": change.limit,
            "key": change.key,
            "field": change.field,
            "amount": change.amount,
            "until": change.until,
            "plan": change.plan,
            "actor": change.actor,
            "reason": change.reason,
        }
    return event


def parse(raw: bytes | str) -> LedgerEvent:
    """Parse and validate one event; raises :class:`MalformedEventError` with the reason."""
    try:
        return _ADAPTER.validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        # A charge problem names its place itself (data.charges.N: ...).
        reason = f"{where}: {first['msg']}" if where else first["msg"]
        raise MalformedEventError(reason, raw) from None


def to_entry(event: LedgerEvent) -> LedgerEntry:
    """The governor-side view of a parsed event (for projection and tools)."""
    d = event.data
    kind = EntryType(event.type.split(".")[1])
    return LedgerEntry(
        id=event.id,
        type=kind,
        time=event.time.timestamp(),
        context=Context(**d.context.model_dump()),
        charges=tuple(
            LedgerCharge(c.limit, c.unit, c.amount, c.window, c.bucket, c.key, c.expire_at)
            for c in d.charges
        ),
        limit=d.decision.limit,
        status=d.decision.status,
        over=d.decision.over,
        usage=None if d.usage is None else TokenUsage(**d.usage.model_dump()),
        degraded=d.decision.degraded,
        reservation=d.reservation,
        change=None if d.change is None else to_change(kind, d.change),
        approved=_approvals(d.decision),
    )


def _approvals(decision: Decided) -> tuple[str, ...]:
    """The approved limits' names, each one the admission spent as its Approval."""
    spent = {s.limit: Approval(s.limit, s.once, s.until) for s in decision.spent}
    return tuple(spent.get(name, name) for name in decision.approved)


def changes_of(event: LedgerEvent) -> tuple[Change, ...]:
    """The run-time change an event carries (cap, plan, grant, reset), as a 0/1-tuple."""
    change = event.data.change
    if change is None:
        return ()
    return (to_change(EntryType(event.type.split(".")[1]), change),)


def to_change(kind: EntryType, change: ChangeData) -> Change:
    """The change an event carries, as the counters store applies it."""
    return Change(
        ChangeKind(kind.value),
        change.limit,
        change.key,
        change.field,
        change.amount,
        change.until,
        change.plan,
        change.actor,
        change.reason,
    )


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of every event type, by type name."""
    out: dict[str, dict[str, Any]] = {}
    for model in EVENT_TYPES:
        schema = model.model_json_schema()
        name = model.model_fields["type"].annotation.__args__[0]  # type: ignore[union-attr]
        out[str(name)] = schema
    return out
