"""The answer to a check."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from .errors import BudgetExceeded


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
    """

    admitted: bool
    limit: str | None = None
    status: int = 200
    retry_after: int | None = None
    resets_at: datetime | None = None
    reason: str = "ok"
    over: tuple[str, ...] = field(default=())
    degraded: bool = False

    def raise_for_status(self) -> Decision:
        """Raise :class:`BudgetExceeded` if refused; return self otherwise."""
        if not self.admitted:
            raise BudgetExceeded(self)
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


ADMITTED = Decision(admitted=True)


def at(epoch: float | None) -> datetime | None:
    """An epoch instant as an aware UTC datetime."""
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)
