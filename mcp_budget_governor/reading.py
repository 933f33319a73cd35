"""The Governor's read-only calls (``usage``, ``is_tripped``, ``status``): each reads
the counters in one round trip, writes nothing and appends no ledger event. With the
counters unreachable each limit's fail mode applies, against the caps last seen
(:class:`~mcp_budget_governor.outage.Outage`).
"""

from __future__ import annotations

from collections.abc import Sequence

from . import planning
from .context import Context
from .counters import Backend, CounterOp, fits
from .errors import BackendUnavailableError
from .limits import FailMode
from .outage import Outage, local
from .planning import Slot
from .policy import Policy

#: Put before a lease set's key, a counter key that never exists: where :func:`read`
#: resolves a concurrency cap's effective cap.
CAP_PROBE = "mcpbg:v1:_probe:"

#: One limit's row of ``Governor.status``.
Row = dict[str, int | bool | None]


def slot_of(policy: Policy, limit: str, ctx: Context, now: float) -> Slot:
    """The counter ``limit`` reads for ``ctx`` now; raises when ``ctx`` lacks its scope."""
    lim = policy[limit]
    s = planning.slot(lim, ctx, now, policy.tz, 0, enforce=False, policy=policy)
    if s is None:
        planning.require_keyed((lim,), ctx)
    assert s is not None
    return s


async def read(
    backend: Backend, outage: Outage, slots: Sequence[Slot]
) -> list[tuple[int | None, int]]:
    """The totals of ``slots`` and their effective caps with grants, writing nothing
    (outage charges not yet replayed are left for the next charge); unreachable
    counters: each limit's fail mode, against the caps last seen.

    One round trip: the admission script with every amount zero and nothing
    enforced reads each counter and resolves its cap as a check would (the
    same rule, one home), and writes nothing. A lease set's cap is resolved on
    a key that never exists (no counter, no grant); its calls in progress
    are read by ``in_progress``."""
    if not outage.degraded:
        probe = [
            CounterOp(CAP_PROBE + s.key if s.limit.concurrent else s.key, 0,
                      s.limit.cap, False, s.expire_at, s.ref)
            for s in slots
        ]  # fmt: skip
        try:
            result = await backend.charge(probe, want_used=True)
        except BackendUnavailableError:
            outage.mark_down()
        else:
            caps = result.caps or tuple(s.limit.cap for s in slots)
            return list(zip(result.used, caps, strict=True))
    for s in slots:
        if s.limit.fail_mode is FailMode.CLOSED:
            raise BackendUnavailableError(
                f"limit {s.limit.name!r} fails closed and its counters cannot be reached"
            )
    totals = await outage.fallback.usage([s.key for s in slots])
    return [
        (t if local(s.limit) else None, outage.caps_seen.get(s.key, s.limit.cap))
        for s, t in zip(slots, totals, strict=True)
    ]


async def usage(backend: Backend, outage: Outage, s: Slot) -> int:
    """What ``s`` has counted (committed + in-flight), after replaying outage charges."""
    await outage.flush(backend)
    if s.limit.concurrent:  # a concurrency cap: its calls in progress
        (held,) = await backend.in_progress([s.key])  # type: ignore[attr-defined]
        return int(held)
    (total,) = await backend.usage([s.key])
    return total


async def is_tripped(backend: Backend, outage: Outage, s: Slot) -> bool:
    """Whether ``s`` is exhausted (a concurrency cap: full, the next call is refused)."""
    ((total, cap),) = await read(backend, outage, (s,))
    if s.limit.concurrent:  # full: the next call is refused
        return not fits(await usage(backend, outage, s), 1, cap)
    return total is not None and not fits(total, 0, cap)


async def status(
    policy: Policy, backend: Backend, outage: Outage, ctx: Context, now: float
) -> dict[str, Row]:
    """Per limit whose scope ``ctx`` supplies, its row (see ``Governor.status``)."""
    tz = policy.tz
    every = [
        s
        for lim in policy.limits
        if (s := planning.slot(lim, ctx, now, tz, 0, enforce=False, policy=policy)) is not None
    ]
    answers = await read(backend, outage, every) if every else []
    report: dict[str, Row] = {}
    leases = [(s, cap) for s, (_, cap) in zip(every, answers, strict=True) if s.limit.concurrent]
    if leases:
        try:
            held = await backend.in_progress([s.key for s, _ in leases])  # type: ignore[attr-defined]
        except BackendUnavailableError:
            held = None
        for (s, cap), n in zip(leases, held or (), strict=False):
            # A concurrency cap is reached when one more call would not fit.
            report[s.limit.name] = _row(n, cap, 1, None)
    for s, (total, cap) in zip(every, answers, strict=True):
        if total is not None and not s.limit.concurrent:
            report[s.limit.name] = _row(total, cap, 0, s.bucket.seconds_left(now))
    return report


def _row(total: int, cap: int, more: int, resets_in: int | None) -> Row:
    return {
        "total": total,
        "cap": cap,
        "remaining": max(cap - total, 0),
        "exceeded": not fits(total, more, cap),
        "resets_in": resets_in,
    }
