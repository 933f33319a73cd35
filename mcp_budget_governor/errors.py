"""Exceptions raised by the governor, and the :class:`Decision` a refusal carries.

Every input error names the field and the offending value, so a bad policy or
a bad call fails loudly at the point where it can be fixed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from .redaction import redact


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class GovernorError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidInputError(GovernorError, ValueError):
    """A value given to the governor is not acceptable.

    ``field`` names what was wrong (``"Limit('burst').cap"``, ``"amount"``) and
    ``value`` holds what was given.
    """

    def __init__(self, field: str, value: Any, problem: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        super().__init__(f"{field}: {problem} (got {_show(value)})")


class SettingsError(InvalidInputError):
    """One or more ``MCPBG_*`` settings (or their options) are bad: every one is named.

    ``errors`` holds one :class:`InvalidInputError` per bad setting; ``field``,
    ``value`` and ``problem`` are the first one's.

    >>> str(SettingsError([InvalidInputError("a", 1, "too small")]))
    'a: too small (got 1)'
    >>> str(SettingsError([InvalidInputError("a", 1, "x"), InvalidInputError("B", "y", "z")]))
    "2 bad settings: a: x (got 1); B: z (got 'y')"
    """

    def __init__(self, errors: Sequence[InvalidInputError]) -> None:
        if not errors:
            raise ValueError("SettingsError needs at least one error")
        self.errors = tuple(errors)
        first = self.errors[0]
        self.field, self.value, self.problem = first.field, first.value, first.problem
        text = "; ".join(str(e) for e in self.errors)
        if len(self.errors) > 1:
            text = f"{len(self.errors)} bad settings: {text}"
        Exception.__init__(self, text)


class PolicyError(InvalidInputError):
    """A policy or limit definition is invalid."""


class UnknownLimitError(PolicyError, KeyError):
    """A name given for a limit is not one of the policy's: a :class:`PolicyError`,
    and a ``KeyError`` as a lookup by name."""

    __str__ = Exception.__str__  # the message, not KeyError's repr of it


class MissingScopeError(InvalidInputError, KeyError):
    """A context lacks a value of the scope a named limit counts per: the counter to
    charge or read cannot be named. Also a ``KeyError``."""

    __str__ = Exception.__str__


class UnknownModelError(GovernorError, LookupError):
    """No price is known for a model: pricing it at zero would disable the budget.

    ``dated``: where a builtin table's prices come from and the date they hold
    (``genai-prices 0.2.5 prices as of 2026-12-07``), so a missing model is
    traceable to the data that lacks it.
    """

    def __init__(self, model: str, known: int = 0, dated: str | None = None) -> None:
        self.model = model
        hint = f" ({known} models known)" if known else " (the price table is empty)"
        if dated and known:
            hint = f" ({known} models known, {dated})"
        super().__init__(
            f"model: no price for {_show(model)}{hint}; add one with "
            f"PriceTable.with_price({model!r}, input_per_mtok, output_per_mtok)"
        )


class NoPriceTableError(GovernorError, RuntimeError):
    """A model call was to be priced by a governor made without a price table."""


class BackendUnavailableError(GovernorError, ConnectionError):
    """The shared counter store could not be reached within the timeout.

    :meth:`redis` builds it with the one wording of "Redis unreachable".
    ``BackendUnavailable(limit_name, cause)`` (the reference package's form)
    names the fail-closed limit that could not be read and keeps the ``cause``;
    both are None on the one-message form.

    >>> e = BackendUnavailableError("spend", ConnectionError("down"))
    >>> e.limit_name, str(e)
    ('spend', "limit 'spend' fails closed and its counters cannot be reached: down")
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        self.cause = cause
        self._limit: str | None = None
        if cause is not None:
            self._limit = message
            message = f"limit {message!r} fails closed and its counters cannot be reached: {cause}"
        super().__init__(message)

    @property
    def limit_name(self) -> str | None:
        """The fail-closed limit that could not be read (None: not said)."""
        return self._limit

    @classmethod
    def redis(cls, cause: BaseException, url: str | None = None) -> BackendUnavailableError:
        """Redis did not answer (``cause``); ``url``, when given, is shown redacted.

        >>> str(BackendUnavailableError.redis(OSError("refused")))
        'redis unreachable: refused'
        >>> str(BackendUnavailableError.redis(OSError("refused"), "redis://:pw@h:6379/0"))
        'redis redis://***@h:6379/0 unreachable: refused'

        A ``cause`` that already is one is returned as it is (said once, not nested).
        """
        if isinstance(cause, BackendUnavailableError):
            return cause
        if url is None:
            return cls(f"redis unreachable: {cause}")
        return cls(f"redis {redact(url)} unreachable: {cause}")


class BackendBusyError(GovernorError):
    """The counter store answers but is overloaded: no free connection, a lock queue or
    a statement past its bound on a live server. Not an outage: no fail mode applies,
    the check is refused (503, ``budget_unavailable:<store> busy``) and nothing is
    charged.

    >>> str(BackendBusyError("postgres", "no connection free within 5.0s"))
    'postgres busy: no connection free within 5.0s'
    """

    def __init__(self, store: str, detail: str) -> None:
        self.store = store
        super().__init__(f"{store} busy: {detail}")


class EpochMissingError(BackendUnavailableError):
    """The counter store restarted empty: its counters must be rebuilt from the ledger
    before anything is applied to, or admitted from, them."""


class CounterOverflowError(GovernorError, OverflowError):
    """A charge would leave the range a counter is counted exactly in: refused, nothing written.

    ``limit`` names the limit (the counter ``key`` belongs to it), ``amount``
    the charge; ``bound`` is the largest magnitude a counter's parts and total
    may reach (``counters.MAX_COUNTER``).
    """

    def __init__(self, limit: str, amount: int, key: str, bound: int) -> None:
        self.limit = limit
        self.amount = amount
        self.key = key
        self.bound = bound
        super().__init__(
            f"limit {limit!r}: charging {amount} would take counter {_show(key)} past "
            f"+-{bound}, the largest total counted exactly; nothing was charged"
        )


class EventRefusedError(GovernorError, ValueError):
    """A store refused to apply the ledger event at ``offset``, having written nothing of
    the batch: its sums would leave the exact range, or take a counter below zero.
    ``reason`` says which; the projection dead-letters that one event and goes on."""

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        self.reason = reason
        super().__init__(f"event at offset {offset} refused: {reason}")


#: The prefix of a refusal's RFC 9457 (7807) problem ``type``, then its kind
#: (``limit-exceeded``, ``budget-exceeded``, ``budget-unavailable``). An identifier, not a
#: page: the reserved ``.invalid`` domain (RFC 2606) resolves nowhere, so no client
#: follows it; the kinds are described in docs/migrating.md.
PROBLEM_TYPES = "https://mcp-budget-governor.invalid/problems/"


class LimitExceeded(GovernorError):
    """A call was refused; ``decision`` says by which limit and until when.

    Every refusal is one, so ``except LimitExceeded`` catches them all (as in
    mcp-budget-governor 0.1.0); the subclasses say why the service, not the
    caller, is the cause: :class:`BudgetExceeded` (a tripped breaker, 503) and
    :class:`BudgetUnavailable` (fail-closed counters or the ledger unreachable,
    503). Plain ``LimitExceeded``: a caller over its quota (429) or spend limit
    (402), or a caller the policy refuses unnamed (403).

    ``LimitExceeded(decision)`` builds the class the decision calls for
    (:meth:`Decision.refusal_type`). The reference package's form,
    ``LimitExceeded(limit_name, retry_after=..., message=, total=, cap=)``,
    builds the refusal of a limit by hand (429; 503 for ``BudgetExceeded``).
    """

    status: int = 429
    title: str = "Limit exceeded"
    slug: str = "limit-exceeded"

    def __new__(cls, decision: Any, *args: Any, **kwargs: Any) -> LimitExceeded:
        if cls is LimitExceeded and not isinstance(decision, str):
            cls = decision.refusal_type()
        return super().__new__(cls)

    def __init__(
        self,
        decision: Decision | str,
        *,
        retry_after: int | None = None,
        message: str | None = None,
        total: int | None = None,
        cap: int | None = None,
    ) -> None:
        self.total = total
        self.cap = cap
        if isinstance(decision, str):
            decision = Decision(
                admitted=False,
                limit=decision,
                status=self.status,
                retry_after=retry_after,
                reason=f"{EXCEEDED}:{decision}",
            )
            if message is None:
                message = self._default_message(decision.limit or "", retry_after)
        self.decision = decision
        super().__init__(decision.reason if message is None else message)

    def _default_message(self, limit: str, retry_after: int | None) -> str:
        wait = "" if retry_after is None else f"; retry in {retry_after}s"
        return f"limit {limit!r} exceeded{wait}"

    @property
    def status_code(self) -> int:
        """The HTTP status of the refusal (``decision.status``)."""
        return self.decision.status

    @property
    def limit_name(self) -> str | None:
        """The refusing limit's name (``decision.limit``)."""
        return self.decision.limit

    @property
    def retry_after(self) -> int | None:
        """Seconds until retrying can succeed; None on a 402 (``decision.retry_after``)."""
        return self.decision.retry_after

    def to_problem_detail(self, instance: str | None = None) -> dict[str, Any]:
        """The refusal as an RFC 9457 (7807) problem object of plain JSON types.

        >>> LimitExceeded("calls", retry_after=30).to_problem_detail("/t")["instance"]
        '/t'
        """
        out: dict[str, Any] = {
            "type": PROBLEM_TYPES + self.slug,
            "title": self.title,
            "status": self.status_code,
            "detail": str(self),
            "limit": self.limit_name,
            "retry_after": self.retry_after,
        }
        for name, value in (("total", self.total), ("cap", self.cap), ("instance", instance)):
            if value is not None:
                out[name] = value
        return out


class BudgetExceeded(LimitExceeded):
    """A tripped breaker sheds every caller (503): the service is the cause, not you.

    ``except BudgetExceeded`` catches only these (after it, ``except
    LimitExceeded`` the caller's own refusals)."""

    status = 503
    title = "Budget exceeded"
    slug = "budget-exceeded"

    def _default_message(self, limit: str, retry_after: int | None) -> str:
        wait = "" if retry_after is None else f"; retry in {retry_after}s"
        return f"service temporarily unavailable: budget {limit!r} is spent{wait}"


class BudgetUnavailable(LimitExceeded, BackendUnavailableError):
    """Refused because a fail-closed limit's counters (or the ledger) cannot be
    reached (503, retry soon); also a :class:`BackendUnavailableError`."""

    status = 503
    title = "Budget unavailable"
    slug = "budget-unavailable"


# The answer to a check (decision.py re-exports it), here because a refusal carries one
# and builds one by hand, while Decision.refusal_type names the refusal's class.

#: Reason prefixes: a limit's counter refused, or could not be read (fail-closed).
EXCEEDED = "budget_exceeded"
UNAVAILABLE = "budget_unavailable"
#: The reason when the ledger cannot record new work.
LEDGER_UNAVAILABLE = "ledger_unavailable"

_NO_HEADROOM: Mapping[str, int] = MappingProxyType({})


def _no_headroom() -> Mapping[str, int]:
    return _NO_HEADROOM


@dataclass(frozen=True, slots=True)
class Lease:
    """The slots an admitted call holds on concurrency caps: lease ``id`` in each
    lease set of ``keys`` (``keys.lease_key``), given back by
    :meth:`Governor.release` (``Governor.admitted`` does it on exit)."""

    id: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    """Admit or refuse, and why.

    - ``limit``: the refusing limit's name (None when admitted).
    - ``status``: 200 when admitted, else 429 (quota), 402 (spend), 503
      (breaker or unreachable counters), 403 (an unnamed caller the policy
      refuses, reason ``caller_unidentified``), or the limit's override.
    - ``retry_after``: seconds until retrying can succeed; None on a 402,
      because waiting a few seconds never restores a spend cap and an SDK
      would retry in a loop (``resets_at`` still says when the window ends).
    - ``over``: shadow-mode (``OnExceed.ALERT``) limits this call went over.
    - ``degraded``: the shared counters were unreachable and process-local
      fallback counters decided.
    - ``remaining``: per limit the check read (gated limits and breakers),
      what can still be charged before it is exhausted, after this call's
      charge; empty when no counter answered. Not part of equality.
    - ``lease``: the concurrency-cap leases an admitted call holds (None when
      the policy has no concurrency cap for it). Not part of equality.
    """

    admitted: bool
    limit: str | None = None
    status: int = 200
    retry_after: int | None = None
    resets_at: datetime | None = None
    reason: str = "ok"
    over: tuple[str, ...] = field(default=())
    degraded: bool = False
    remaining: Mapping[str, int] = field(default_factory=_no_headroom, compare=False)
    lease: Lease | None = field(default=None, compare=False)
    #: What an admission reserved with it (Governor.admitted(hold=)): the reservation's
    #: event id and its slots, for the integrations' Reservations to settle.
    held: Any = field(default=None, compare=False, repr=False)

    @property
    def allowed(self) -> bool:
        """``admitted``, under the name mcp-budget-governor 0.1.0 used."""
        return self.admitted

    def refusal_type(self) -> type[LimitExceeded]:
        """The exception class a refusal with this decision raises.

        Every one is a :class:`LimitExceeded`. A refusal by a limit's counter
        with status 503 sheds everyone (a breaker): :class:`BudgetExceeded`;
        unreachable fail-closed counters or ledger: :class:`BudgetUnavailable`;
        anything else (a quota, a spend limit, an unnamed caller) plain
        :class:`LimitExceeded`.
        """
        reason = self.reason
        if reason.startswith(EXCEEDED):
            return BudgetExceeded if self.status == 503 else LimitExceeded
        if reason.startswith(UNAVAILABLE) or reason == LEDGER_UNAVAILABLE:
            return BudgetUnavailable
        return LimitExceeded

    def raise_for_status(self) -> Decision:
        """Raise :class:`LimitExceeded` (the class :meth:`refusal_type` names) if
        refused; return self otherwise."""
        if not self.admitted:
            raise LimitExceeded(self)
        return self

    def __bool__(self) -> bool:
        return self.admitted

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers a refusal should carry (``Retry-After`` where it helps)."""
        out: dict[str, str] = {}
        if self.retry_after is not None and not self.admitted:
            out["Retry-After"] = str(self.retry_after)
        return out


# The names of mcp-budget-governor 0.1.0 (the reference package), on our classes;
# docs/migrating.md lists where they differ.
BudgetGovernorError = GovernorError
BackendUnavailable = BackendUnavailableError
UnknownModel = UnknownModelError
