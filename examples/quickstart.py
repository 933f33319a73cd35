"""A simulated agent burst against a governed tool, on the embedded backend.

Three agents call tools in a loop at machine speed. Per-user burst caps and
daily quotas refuse the runaway one, every completed call is metered in USD
from the model's token usage, and the global spend breaker trips and sheds
everyone once the day's budget is gone. No servers needed:

    python examples/quickstart.py [--redis redis://localhost:6379/0]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter

from mcp_budget_governor import (
    Backend,
    Context,
    FailMode,
    Governor,
    Limit,
    MemoryBackend,
    Policy,
    PriceTable,
    Scope,
    Unit,
    Window,
    format_usd,
    usd,
)

MODEL = "claude-sonnet-4-5"

POLICY = Policy.of(
    Limit("per_user_calls", cap=200, window=Window.DAY, scope=Scope.USER),
    Limit("burst", cap=20, window=Window.MINUTE, scope=Scope.USER),
    Limit("per_user_tool", cap=60, window=Window.HOUR, scope=(Scope.USER, Scope.TOOL)),
    Limit("per_user_spend", cap=usd(2), window=Window.DAY, scope=Scope.USER, unit=Unit.USD_MICROS),
    Limit(
        "global_spend",
        cap=usd(5),
        window=Window.DAY,
        unit=Unit.USD_MICROS,
        breaker=True,
        gated=False,
        fail_mode=FailMode.CLOSED,
    ),
)

# Each agent: calls per simulated second, and prompt tokens per call.
AGENTS = {"alice": (0.2, 2_000), "bob": (0.5, 6_000), "runaway-loop": (4.0, 12_000)}
TOOLS = ("search", "fetch", "summarise")
SIMULATED_SECONDS = 8 * 60


class SimClock:
    """Simulated time starting now, so minute windows roll over in a blink."""

    def __init__(self) -> None:
        # From the next whole minute, so every run tells the same story.
        self.now = float(int(time.time() // 60 + 1) * 60)

    def __call__(self) -> float:
        return self.now


async def one_call(gov: Governor, rng: random.Random, user: str, prompt: int) -> str:
    ctx = Context(user=user, tool=rng.choice(TOOLS), session=f"{user}-s1")
    decision = await gov.check(ctx)
    if not decision.admitted:
        return f"refused {decision.status} {decision.reason}"
    # ... the tool's work runs here; then what it cost is metered, always.
    usage = {"input_tokens": prompt + rng.randrange(500), "output_tokens": rng.randrange(200, 900)}
    await gov.meter_tokens("per_user_spend", MODEL, ctx=ctx, **usage)
    await gov.meter_tokens("global_spend", MODEL, ctx=ctx, **usage)
    return "admitted"


async def simulate(gov: Governor, clock: SimClock) -> tuple[Counter[str], float | None]:
    rng = random.Random(7)
    outcomes: Counter[str] = Counter()
    owed = dict.fromkeys(AGENTS, 0.0)
    tripped_at = None
    start = clock.now
    for second in range(SIMULATED_SECONDS):
        clock.now = start + second
        for user, (rate, prompt) in AGENTS.items():
            owed[user] += rate
            while owed[user] >= 1:
                owed[user] -= 1
                outcome = await one_call(gov, rng, user, prompt)
                outcomes[f"{user}|{outcome}"] += 1
                if tripped_at is None and "global" in outcome:
                    tripped_at = second / 60
    return outcomes, tripped_at


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", help="run against this Redis instead of in-process counters")
    args = parser.parse_args()
    clock = SimClock()
    backend: Backend
    if args.redis:
        from mcp_budget_governor import RedisBackend

        backend = RedisBackend.from_url(args.redis)
    else:
        backend = MemoryBackend(clock=clock)
    prices = PriceTable.builtin()
    async with Governor(POLICY, backend, prices=prices, clock=clock) as gov:
        outcomes, tripped_at = await simulate(gov, clock)
        rows = [["user", "outcome", "calls"]]
        rows += [[*key.split("|"), str(n)] for key, n in sorted(outcomes.items())]
        print(
            "Policy: 20 calls/minute per user (429), $2/day per user (402), "
            "a $5/day global breaker (503)."
        )
        print(f"\nCalls by outcome over {SIMULATED_SECONDS // 60} simulated minutes\n")
        print(table(rows))
        print("\nCounters now\n")
        rows = [["limit", "scope", "used", "cap"]]
        for user in AGENTS:
            ctx = Context(user=user)
            calls, spend = POLICY["per_user_calls"], POLICY["per_user_spend"]
            used = await gov.usage(calls.name, ctx)
            rows.append([calls.name, f"user={user}", str(used), str(calls.cap)])
            used = await gov.usage(spend.name, ctx)
            rows.append(
                [spend.name, f"user={user}", f"${format_usd(used)}", f"${format_usd(spend.cap)}"]
            )
        spent = await gov.usage("global_spend")
        cap = POLICY["global_spend"].cap
        rows.append(["global_spend", "global", f"${format_usd(spent)}", f"${format_usd(cap)}"])
        print(table(rows))
        tripped = spent >= cap
        when = f" after {tripped_at:.1f} minutes" if tripped_at is not None else ""
        state = f"TRIPPED{when}: every caller is shed until the day ends" if tripped else "ok"
        print(f"\nModel {MODEL} priced from {prices.version}; global breaker {state}.")


if __name__ == "__main__":
    asyncio.run(main())
