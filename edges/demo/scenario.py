"""What the demo simulates: the policy, the agents, the tools and the clock.

Everything here is data and small pure rules; :mod:`.runner` drives it.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

from mcp_budget_governor import FailMode, Limit, Policy, Scope, Unit, Window, usd
from mcp_budget_governor.money import format_dollars

#: The model the ``summarise`` tool "calls"; its tokens are priced by the price table.
MODEL = "claude-sonnet-4-5"

#: The limits every cost is metered to (money spent counts against each).
SPEND_LIMITS = ("per_user_spend", "per_tenant_spend", "global_spend")

#: Fixed per-call prices of the tools that call no model, in USD micros.
FLAT_PRICES = {"search": usd(0.004), "fetch": usd(0.001)}

POLICY = Policy.of(
    Limit("burst", cap=20, window=Window.MINUTE, scope=Scope.USER),
    Limit("per_user_calls", cap=400, window=Window.DAY, scope=Scope.USER),
    Limit(
        "per_user_spend", cap=usd(1.5), window=Window.DAY, scope=Scope.USER, unit=Unit.USD_MICROS
    ),
    Limit(
        "per_tenant_spend",
        cap=usd(2.5),
        window=Window.DAY,
        scope=Scope.TENANT,
        unit=Unit.USD_MICROS,
    ),
    Limit(
        "global_spend",
        cap=usd(4.5),
        window=Window.DAY,
        unit=Unit.USD_MICROS,
        breaker=True,
        gated=False,
        fail_mode=FailMode.CLOSED,
    ),
)
"""Quotas (429), spend caps (402) per user and tenant, and a global breaker (503)."""

#: How long the simulated burst lasts, in simulated seconds.
SIMULATED_SECONDS = 8 * 60


@dataclass(frozen=True, slots=True)
class Agent:
    """A simulated agent: who it acts for and how it calls tools.

    ``rate`` is calls per simulated second; ``prompt`` the typical prompt size
    (tokens) of its ``summarise`` calls; ``tools`` its tool mix (repeats weigh
    a tool more). A ``polite`` agent honours refusals: it waits out a retry
    hint and stops when told its budget is spent; the others keep calling.
    """

    user: str
    tenant: str
    rate: float
    prompt: int
    tools: tuple[str, ...]
    polite: bool = True


AGENTS = (
    Agent("alice", "acme", 0.2, 3_000, ("search", "fetch", "summarise")),
    Agent("bob", "acme", 0.45, 8_000, ("search", "summarise", "summarise")),
    Agent("carol", "globex", 0.4, 6_000, ("fetch", "search", "summarise")),
    Agent("runaway-loop", "globex", 4.0, 12_000, ("summarise", "search"), polite=False),
)


def arguments(agent: Agent, tool: str, rng: random.Random) -> dict[str, object]:
    """The arguments of one simulated call (seeded: every run tells the same story)."""
    if tool == "summarise":
        return {"text_tokens": agent.prompt + rng.randrange(1_000), "seed": rng.randrange(1 << 30)}
    if tool == "fetch":
        return {"url": f"https://example.com/doc/{rng.randrange(1000)}"}
    return {"query": f"{agent.user} question {rng.randrange(1000)}"}


def summary_tokens(text_tokens: int, seed: int) -> tuple[int, int]:
    """The (input, output) tokens a simulated summarisation uses: prompt plus
    instructions in, a few hundred tokens out."""
    return text_tokens + 350, 200 + seed % 700


class SimClock:
    """Simulated time, so minute windows roll over in a blink.

    It starts on a whole minute (every run then tells the same story) and moves only
    when :meth:`advance_to` is called. Given ``duration`` and no ``start``, it starts
    that long before now, so the story (refusals, the breaker's trip, the ledger's
    times) lies in the past, never in the future; but not before today's UTC
    midnight, so today's budgets hold the whole story (a run in a day's first minutes
    ends those minutes ahead).
    """

    def __init__(self, start: float | None = None, *, duration: float = 0.0) -> None:
        if start is None:
            now = time.time()
            start = max((now - duration) // 60 * 60, now // 86_400 * 86_400)
        self.start = float(int(start // 60) * 60)
        self.now = self.start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, elapsed: float) -> None:
        """Set the time to ``elapsed`` simulated seconds after the start."""
        self.now = self.start + elapsed

    @property
    def elapsed(self) -> float:
        """Simulated seconds since the start."""
        return self.now - self.start


_REASON = re.compile(r"\b(budget_[a-z_]+):([A-Za-z0-9_+.-]+/[a-z]+)")
_RETRY = re.compile(r"\bretry_after=(\d+)s\b")
_STATUS = re.compile(r"\bstatus=(\d{3})\b")


@dataclass(frozen=True, slots=True)
class Refusal:
    """What an agent reads from a refused call: the reason, status and retry hint."""

    reason: str
    status: int | None
    retry_after: int | None


def read_refusal(message: str) -> Refusal | None:
    """The refusal an error message carries, None when it is not a budget refusal.

    >>> read_refusal("budget_exceeded:user/minute limit=burst status=429 retry_after=17s. ...")
    Refusal(reason='budget_exceeded:user/minute', status=429, retry_after=17)
    >>> read_refusal("budget_unavailable:global/day limit=spend status=503 retry_after=1s.").reason
    'budget_unavailable:global/day'
    >>> read_refusal("tool crashed") is None
    True
    """
    found = _REASON.search(message)
    if found is None:
        return None
    status = _STATUS.search(message)
    retry = _RETRY.search(message)
    return Refusal(
        f"{found.group(1)}:{found.group(2)}",
        int(status.group(1)) if status else None,
        int(retry.group(1)) if retry else None,
    )


def describe(policy: Policy) -> str:
    """The policy in one line for people: each limit's cap, window, scope and refusal status."""
    parts = []
    for limit in policy:
        cap = format_dollars(limit.cap) if limit.unit is Unit.USD_MICROS else f"{limit.cap}"
        cap = cap.removesuffix("0000").removesuffix("00") if cap.startswith("$") else cap
        kind = "breaker" if limit.breaker else f"per {limit.scope_label}"
        parts.append(f"{cap}/{limit.window.value} {kind} ({limit.refusal_status})")
    return ", ".join(parts)


def clock_label(elapsed: float) -> str:
    """``mm:ss`` of simulated time.

    >>> clock_label(372)
    '06:12'
    """
    minutes, seconds = divmod(int(elapsed), 60)
    return f"{minutes:02d}:{seconds:02d}"
