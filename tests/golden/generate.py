"""Generate the golden vectors that pin the counter-key contract.

Keys, buckets, expiries, escaping, dollar conversions, prices and script
digests are a contract: a change silently resets every live budget (or makes
two replicas of different versions disagree). ``tests/test_golden.py`` checks
the committed ``vectors.json`` against the code. Regenerate only for an
intended change, and then bump the key prefix version (``mcpbg:v1``):

    python tests/golden/generate.py > tests/golden/vectors.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import UTC, datetime
from typing import Any

from mcp_budget_governor import Context, Limit, Policy, PriceTable, Scope, Unit, Window, usd
from mcp_budget_governor.keys import escape
from mcp_budget_governor.lua import SCRIPTS, source
from mcp_budget_governor.planning import reason, slot

INSTANTS = [
    "2026-11-29T19:14:37Z",
    "2026-12-31T23:59:59Z",
    "2027-01-01T00:00:00Z",
    "2026-03-08T07:30:00Z",  # New York spring-forward day
    "2024-02-29T12:00:00Z",
]
#: Instants for the calendar windows only (DAY, WEEK, MONTH), with the first context.
CALENDAR_INSTANTS = [
    # Billing days and ISO weeks around the 2026 DST changes (Berlin, New York).
    "2026-03-28T23:30:00Z",  # Sun 00:30 in Berlin (CET), before the spring-forward
    "2026-03-29T22:30:00Z",  # Mon 00:30 in Berlin (CEST)
    "2026-10-25T23:30:00Z",  # Mon 00:30 in Berlin (CET again)
    "2026-11-02T04:59:59Z",  # Sun 23:59:59 in New York (EST): the week's last second
    "2026-03-15T03:59:59Z",  # Sat 23:59:59 in New York (EDT), March 14: before a billing day
    "2026-03-15T04:00:00Z",  # March 15 00:00 in New York (EDT)
    "2026-02-28T05:00:00Z",  # Feb 28 00:00 in New York: day 30/31 periods start
    "2027-12-31T12:00:00Z",  # ISO week 52 of 2027 (week-year = year here)
    "2026-12-31T12:00:00Z",  # ISO week 53 of 2026
]
LIMITS = [
    Limit("global_calls", cap=10, window=Window.MINUTE),
    Limit("burst", cap=30, window=Window.MINUTE, scope=Scope.USER),
    Limit("hourly", cap=30, window=Window.HOUR, scope=(Scope.TOOL, Scope.USER)),
    Limit("per_user_calls", cap=2000, window=Window.DAY, scope=Scope.USER),
    Limit(
        "tenant_month", cap=usd(100), window=Window.MONTH, scope=Scope.TENANT, unit=Unit.USD_MICROS
    ),
    Limit("agent_session", cap=100, window=Window.SESSION, scope=Scope.AGENT),
    Limit("user_week", cap=700, window=Window.WEEK, scope=Scope.USER),
    Limit("billing_15", cap=usd(100), window=Window.MONTH, unit=Unit.USD_MICROS, anchor_day=15),
    Limit(
        "billing_31",
        cap=usd(100),
        window=Window.MONTH,
        scope=Scope.TENANT,
        unit=Unit.USD_MICROS,
        anchor_day=31,
        anchors={"acme": 20, "x,y": 1},
    ),
    Limit(
        "everything",
        cap=5,
        window=Window.DAY,
        scope=(Scope.TENANT, Scope.USER, Scope.AGENT, Scope.SESSION, Scope.TOOL),
    ),
]
CONTEXTS = [
    Context(user="u_42", tenant="acme", tool="search", session="s-1", agent="coder"),
    Context(user="a:b", tenant="x,y", tool="{tag}", session="new\nline", agent="é ü 漢字"),
    Context(user="", tenant="%41", tool="#hash", session="=", agent="x" * 300),
]
ESCAPES = [
    "plain",
    "a:b",
    "a,b=c",
    "{x}",
    "%",
    "#",
    "new\nline",
    "tab\t",
    "é",
    "漢字",
    "🙂",
    "",
    " ",
    "x" * 64,
    "y" * 193,
    "z" * 10_000,
]
USD = ["0", "0.000001", "0.0000001", "0.05", "1", "25", "3.14159265", "0.1", "1e-7", "9000"]
PRICES = PriceTable().with_price("m", 3, 15, cache_read_per_mtok="0.3", cache_write_per_mtok="3.75")
PRICE_CASES = [
    (0, 0, 0, 0),
    (1, 0, 0, 0),
    (0, 1, 0, 0),
    (3200, 850, 0, 0),
    (10_000, 500, 8_000, 0),
    (10_000, 500, 0, 2_000),
    (10_000, 500, 6_000, 4_000),
    (7, 3, 1, 1),
    (1_000_000, 1_000_000, 0, 0),
]


CALENDAR = (Window.DAY, Window.WEEK, Window.MONTH)


def epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).timestamp()


#: Cap resolution cases (caps.resolve; lua/charge.lua effective_cap mirrors it): the
#: policy's value cap, a run-time cap (cap, until relative to now; 0 = for good),
#: the run-time assignments by field, the policy's assignment, the plans' caps, a grant.
CAP_CASES: list[dict[str, Any]] = [
    {"value_cap": None, "runtime": None, "assigned": {}, "file_plan": None, "grant": 0},
    {"value_cap": 50, "runtime": None, "assigned": {}, "file_plan": "pro", "grant": 0},
    {"value_cap": 50, "runtime": [70, 0], "assigned": {}, "file_plan": None, "grant": 0},
    {"value_cap": 50, "runtime": [70, 3600], "assigned": {}, "file_plan": None, "grant": 5},
    {"value_cap": 50, "runtime": [70, -3600], "assigned": {}, "file_plan": None, "grant": 0},
    {"value_cap": None, "runtime": None, "assigned": {}, "file_plan": "pro", "grant": 0},
    {"value_cap": None, "runtime": None, "assigned": {"tenant=acme": "free"},
     "file_plan": "pro", "grant": 0},
    {"value_cap": None, "runtime": None,
     "assigned": {"tenant=acme": "free", "user=u_42": "team"}, "file_plan": None, "grant": 3},
    {"value_cap": None, "runtime": None, "assigned": {"user=u_42": "gold"},
     "file_plan": "pro", "grant": 0},
    {"value_cap": None, "runtime": [0, 0], "assigned": {}, "file_plan": "pro", "grant": 9},
]  # fmt: skip
CAP_PLANS = [["free", 10], ["pro", 100], ["team", 40]]
CAP_DEFAULT = 25


def cap_vectors() -> list[dict[str, Any]]:
    """Each case with its effective cap, grant and source at now = 10**9."""
    from mcp_budget_governor.caps import CapRef, effective

    now = 10**9
    out = []
    for case in CAP_CASES:
        runtime = case["runtime"]
        if runtime is not None:
            runtime = (runtime[0], now + runtime[1] if runtime[1] else 0)
        ref = CapRef(
            "mcpbg:v1:_caps:t",
            "tenant=acme,user=u_42",
            case["value_cap"],
            ("user=u_42", "tenant=acme"),
            case["file_plan"],
            tuple((name, cap) for name, cap in CAP_PLANS),
        )
        eff = effective(
            ref,
            CAP_DEFAULT,
            runtime=runtime,
            assigned=case["assigned"],
            grant=case["grant"],
            now=now,
        )
        source = eff.source if not eff.source.startswith("run-time until") else "run-time until"
        out.append({**case, "cap": eff.cap, "room": eff.room_cap, "source": source})
    return out


LEASE_LIMITS = [
    Limit("parallel", cap=5, scope=Scope.USER, unit=Unit.CONCURRENT),
    Limit("tenant_parallel", cap=50, scope=Scope.TENANT, unit=Unit.CONCURRENT),
    Limit("tool_parallel", cap=2, scope=(Scope.USER, Scope.TOOL), unit=Unit.CONCURRENT),
    Limit("all_parallel", cap=500, unit=Unit.CONCURRENT),
]


def lease_vectors() -> list[dict[str, Any]]:
    """Each concurrency cap's lease-set key and refusal reason per context (no bucket,
    no expiry: a lease set lives as long as its last lease)."""
    out = []
    for limit in LEASE_LIMITS:
        for i, ctx in enumerate(CONTEXTS):
            s = slot(limit, ctx, 0.0, UTC, 1, enforce=True)
            assert s is not None
            out.append({"limit": limit.name, "context": i, "key": s.key, "reason": reason(limit)})
    return out


def vectors() -> dict[str, Any]:
    keys = []
    for tz in (None, "America/New_York", "Asia/Kolkata", "Europe/Berlin"):
        policy = Policy(tuple(LIMITS), timezone=tz)
        for instant in INSTANTS + CALENDAR_INSTANTS:
            now = epoch(instant)
            for limit in policy:
                for i, ctx in enumerate(CONTEXTS):
                    if instant in CALENDAR_INSTANTS and (i or limit.window not in CALENDAR):
                        continue
                    s = slot(limit, ctx, now, policy.tz, 1, enforce=True)
                    assert s is not None
                    keys.append(
                        {
                            "tz": tz,
                            "at": instant,
                            "limit": limit.name,
                            "context": i,
                            "key": s.key,
                            "bucket": s.bucket.label,
                            "expire_at": s.expire_at,
                            "seconds_left": s.bucket.seconds_left(now),
                        }
                    )
    return {
        "keys": keys,
        "escape": {v if len(v) < 100 else f"{v[0]}*{len(v)}": escape(v) for v in ESCAPES},
        "usd": {v: usd(v) for v in USD},
        "prices": [
            {
                "tokens": list(c),
                "micros": PRICES.cost_micros(
                    "m",
                    input_tokens=c[0],
                    output_tokens=c[1],
                    cache_read_tokens=c[2],
                    cache_write_tokens=c[3],
                ),
            }
            for c in PRICE_CASES
        ],
        "scripts": {n: hashlib.sha1(source(n).encode()).hexdigest() for n in SCRIPTS},
        "caps": cap_vectors(),
        "leases": lease_vectors(),
    }


if __name__ == "__main__":
    json.dump(vectors(), sys.stdout, indent=1, ensure_ascii=True, sort_keys=True)
    sys.stdout.write("\n")
