"""Generate the conformance vectors every non-Python client checks itself against.

The contract of a budget is neither language: the Lua scripts in ``lua/``, the
counter keys, buckets and expiries, integer USD micros, prices, the exact
arguments the admission script is called with, and the refusals agents read.
Every value here comes from calling the Python implementation itself (nothing
is re-derived), so a Python-side change that no other client mirrored changes
the vectors, fails ``tests/test_conformance.py`` until they are regenerated,
and then fails the TypeScript suite (``ts/test/conformance.test.ts``) until
TypeScript follows::

    python conformance/generate.py > conformance/vectors.json

The key, bucket, escape, money, price, script and cap sections are the golden
vectors of the Python suite (``tests/golden/generate.py``), taken whole; this
script adds the script calls (``charge``), the built-in price table, policy
files, refusals and the tool-price metadata of the integrations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from mcp_budget_governor import (  # noqa: E402
    Context,
    InvalidInputError,
    Policy,
    PriceTable,
    UnknownModelError,
    admin,
    planning,
    usd,
)
from mcp_budget_governor.caps import Change  # noqa: E402
from mcp_budget_governor.counters import Charge  # noqa: E402
from mcp_budget_governor.decision import Decision  # noqa: E402
from mcp_budget_governor.integrations.fastmcp import tool_estimate, tool_price  # noqa: E402
from mcp_budget_governor.integrations.flow import (  # noqa: E402
    REFUSAL_META_KEY,
    refusal_body,
    refusal_meta,
    refusal_text,
)
from mcp_budget_governor.lua import SCRIPTS, script_layout, source  # noqa: E402
from mcp_budget_governor.policy_file import PolicyFileError, loads  # noqa: E402
from mcp_budget_governor.repeats import call_hash, canonical_json  # noqa: E402

#: A fixed instant for the script calls: 2026-11-30T19:14:37Z.
NOW = 1_796_066_077.0


def golden() -> dict[str, Any]:
    """The Python suite's golden vectors (keys, buckets, escapes, usd, prices, caps)."""
    path = ROOT / "tests" / "golden" / "generate.py"
    spec = importlib.util.spec_from_file_location("mcpbg_golden_generate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out: dict[str, Any] = module.vectors()
    out["contexts"] = [_context(c) for c in module.CONTEXTS]
    out["limits"] = [_limit(lim) for lim in module.LIMITS]
    out["calendar_instants"] = module.CALENDAR_INSTANTS
    return out


def _context(ctx: Context) -> dict[str, str | None]:
    return {
        "user": ctx.user,
        "tenant": ctx.tenant,
        "tool": ctx.tool,
        "session": ctx.session,
        "agent": ctx.agent,
        "session_root": ctx.session_root,
        "call": ctx.call,
    }


def _limit(lim: Any) -> dict[str, Any]:
    return {
        "name": lim.name,
        "cap": lim.cap,
        "window": None if lim.window is None else lim.window.value,
        "scope": [d.value for d in lim.dimensions],
        "unit": lim.unit.value,
        "gated": lim.gated,
        "breaker": lim.breaker,
        "fail_mode": lim.fail_mode.value,
        "local_fallback": lim.local_fallback,
        "status": lim.status,
        "on_exceed": lim.on_exceed.value,
        "alert_at": list(lim.alert_at),
        "anchor_day": lim.anchor_day,
        "anchors": dict(lim.anchors),
        "caps": dict(lim.caps) if lim.caps else {},
        "tools": list(lim.tools),
    }


# -- policy files -------------------------------------------------------------

POLICIES: dict[str, str] = {
    "three_gated": """
[[limits]]
name = "burst"
cap = 30
window = "minute"
scope = "user"

[[limits]]
name = "per_user_calls"
cap = 2_000
window = "day"
scope = "user"

[[limits]]
name = "tenant_spend"
cap_usd = "100"
window = "month"
scope = "tenant"
""",
    "caps_and_plans": """
timezone = "America/New_York"

[[limits]]
name = "tenant_spend"
cap_usd = "100"
window = "month"
scope = "tenant"
anchor_day = 15
caps = { acme = "250.50", "x,y" = "1" }

[[limits]]
name = "user_calls"
cap = 100
window = "day"
scope = ["tool", "user"]

[[limits]]
name = "global_calls"
cap = 1000
window = "hour"

[plans.pro]
tenant_spend = "500"
user_calls = 1000

[plans.free]
user_calls = 10

[assign]
acme = "pro"
"user=u_42" = "free"
""",
    "breaker_and_shadow": """
anonymous = "shared"

[[limits]]
name = "global_spend"
cap_usd = "25"
window = "day"
breaker = true
gated = false
fail_mode = "closed"
alert_at = [50, 80, 100]

[[limits]]
name = "trial"
cap = 5
window = "week"
scope = "tenant"
on_exceed = "alert"

[[limits]]
name = "tokens"
cap = 50_000_000
unit = "tokens"
window = "month"
scope = "tenant"
status = 429
local_fallback = false
""",
    "concurrency": """
[[limits]]
name = "parallel"
cap = 5
unit = "concurrent"
scope = "user"

[[limits]]
name = "burst"
cap = 30
window = "minute"
scope = "user"
""",
    "refusals": """
[[limits]]
name = "burst"
cap = 30
window = "minute"
scope = "user"

[[limits]]
name = "user_spend"
cap_usd = "5"
window = "day"
scope = "user"

[[limits]]
name = "global_spend"
cap_usd = "25"
window = "month"
breaker = true
gated = false

[[limits]]
name = "parallel"
cap = 5
unit = "concurrent"
scope = "user"

[[limits]]
name = "custom"
cap = 5
window = "hour"
scope = "tenant"
status = 409
""",
    "session": """
[[limits]]
name = "agent_session"
cap = 100
window = "session"
scope = "agent"
""",
    # The loop guard (repeats.py): identical calls per session and minute, some tools only.
    "repeats": """
[[limits]]
name = "repeats"
cap = 3
window = "minute"
scope = ["session", "call"]
tools = ["search", "brave_*"]
""",
}

BAD_POLICIES: dict[str, str] = {
    "misspelt_key": '[[limits]]\nname = "a"\ncap = 1\nwidow = "day"\n',
    "unknown_window": '[[limits]]\nname = "a"\ncap = 1\nwindow = "fortnight"\n',
    "float_dollars": '[[limits]]\nname = "a"\ncap_usd = 0.1\nwindow = "day"\n',
    "negative_cap": '[[limits]]\nname = "a"\ncap = -1\nwindow = "day"\n',
    "bad_name": '[[limits]]\nname = "_a"\ncap = 1\nwindow = "day"\n',
    "duplicate": '[[limits]]\nname = "a"\ncap = 1\nwindow = "day"\n'
    '[[limits]]\nname = "a"\ncap = 2\nwindow = "day"\n',
    "no_limits": 'timezone = "UTC"\n',
    "bad_zone": 'timezone = "Mars/Olympus"\n[[limits]]\nname = "a"\ncap = 1\nwindow = "day"\n',
    "cap_and_cap_usd": '[[limits]]\nname = "a"\ncap = 1\ncap_usd = "1"\nwindow = "day"\n',
    "missing_window": '[[limits]]\nname = "a"\ncap = 1\n',
    "empty_scope": '[[limits]]\nname = "a"\ncap = 1\nwindow = "day"\nscope = []\n',
}


def policy_vectors() -> dict[str, Any]:
    good = {}
    for name, text in POLICIES.items():
        policy = loads(text, source=f"{name}.toml")
        good[name] = {
            "toml": text,
            "timezone": policy.timezone,
            "anonymous": policy.anonymous.value,
            "limits": [_limit(lim) for lim in policy],
            "plans": {p.name: dict(p.caps) for p in policy.plans},
            "assignments": dict(policy.assignments),
        }
    bad = {}
    for name, text in BAD_POLICIES.items():
        try:
            loads(text, source=f"{name}.toml")
        except PolicyFileError as exc:
            bad[name] = {"toml": text, "field": exc.field, "line": exc.line}
        else:  # pragma: no cover - a vector that stopped failing
            raise AssertionError(f"bad policy {name!r} loaded")
    return {"good": good, "bad": bad}


# -- the admission script's exact calls ---------------------------------------

#: (policy, context, what) per case: what the governor sends charge.lua.
CHARGE_CASES: list[dict[str, Any]] = [
    {"policy": "three_gated", "context": {"user": "u_42", "tenant": "acme"}, "call": "check"},
    {"policy": "three_gated", "context": {"user": "u_42"}, "call": "check"},
    {"policy": "three_gated", "context": {"user": "a:b,{c}", "tenant": "é漢🙂"}, "call": "check"},
    {"policy": "three_gated", "context": {"user": "u_42", "tenant": "acme"}, "call": "check",
     "ledger": True},
    {"policy": "three_gated", "context": {"user": "u_42", "tenant": "acme"}, "call": "check",
     "require_epoch": True},
    {"policy": "three_gated", "context": {"user": "u_42", "tenant": "acme"}, "call": "meter",
     "limit": "tenant_spend", "amount": 50_000},
    {"policy": "three_gated", "context": {"user": "u_42", "tenant": "acme"}, "call": "meter",
     "limit": "tenant_spend", "amount": 50_000, "ledger": True},
    {"policy": "caps_and_plans", "context": {"user": "u_42", "tenant": "acme", "tool": "search"},
     "call": "check"},
    {"policy": "caps_and_plans", "context": {"user": "u_7", "tenant": "x,y", "tool": "search"},
     "call": "check"},
    {"policy": "caps_and_plans", "context": {"user": "u_7", "tenant": "x,y", "tool": "search"},
     "call": "meter", "limit": "tenant_spend", "amount": 1},
    {"policy": "breaker_and_shadow", "context": {"user": "u_42", "tenant": "acme"},
     "call": "check"},
    {"policy": "concurrency", "context": {"user": "u_42"}, "call": "check", "lease": True},
    # A call waiting for a slot (Governor.check(wait=1.5)): its ticket is "<id>/<wait ms>".
    {"policy": "concurrency", "context": {"user": "u_42"}, "call": "check", "lease": True,
     "ticket": "0190f5a2-7e3b-7c1d-9f00-0000000000dd/1500"},
    {"policy": "session", "context": {"agent": "coder", "session": "s-1"}, "call": "check"},
    {"policy": "repeats", "context": {"session": "s-1", "tool": "brave_web",
                                      "call": "0123456789abcdef0123456789abcdef"}, "call": "check"},
    {"policy": "repeats", "context": {"session": "s-1", "tool": "fetch",
                                      "call": "0123456789abcdef0123456789abcdef"}, "call": "check"},
]  # fmt: skip
OP_ID = "0190f5a2-7e3b-7c1d-9f00-0000000000aa"
EVENT_ID = "0190f5a2-7e3b-7c1d-9f00-0000000000bb"
LEASE_ID = "0190f5a2-7e3b-7c1d-9f00-0000000000cc"
LEASE_TTL = 30.0


def charge_vectors() -> list[dict[str, Any]]:
    """Per case the exact EVALSHA command RedisBackend sends, and the arguments of
    PostgresBackend's mcpbg_charge (nothing reaches a server)."""
    import redis.asyncio as aioredis

    from mcp_budget_governor.projections.counters import postgres
    from mcp_budget_governor.projections.counters.redis import RedisBackend

    out = []
    for case in CHARGE_CASES:
        policy = loads(POLICIES[case["policy"]])
        ctx = Context(**case["context"])
        backend = RedisBackend(
            aioredis.Redis(), require_epoch=bool(case.get("require_epoch")),
            clock=lambda: NOW, coalesce=False,
        )  # fmt: skip
        ledger = bool(case.get("ledger"))
        event_id = EVENT_ID if ledger else None
        op_id = None if ledger else OP_ID
        if case["call"] == "check":
            ops = planning.check_plan(policy, ctx, NOW).ops
        else:
            pairs = planning.charge_pairs(policy, {case["limit"]: case["amount"]})
            ops = tuple(s.op for s in planning.meter_slots(pairs, ctx, NOW, policy.tz, policy))
        lease = LEASE_ID if case.get("lease") else None
        charge = Charge(ops, event_id, True, op_id, lease, LEASE_TTL, case.get("ticket"))
        args = backend.charge_args(charge)
        command = ["EVALSHA", backend._charge.sha] + [
            a.decode() if isinstance(a, bytes) else str(a) for a in args
        ]
        # The same charge on Postgres: mcpbg_charge's arguments, as PostgresBackend passes them.
        sql_params = postgres.charge_params(charge, require_epoch=bool(case.get("require_epoch")))
        out.append(
            {**case, "now": NOW, "ledger": ledger, "command": command, "sql": list(sql_params)}
        )
    return out


#: Checks that charge a fixed price with the admission (Governor.admitted(price=)):
#: one charge.lua call, the price's counters last, their in-flight amounts under the
#: cost event's id (ARGV[1] "<admission id> <cost id> <first cost counter>"). Kept
#: apart from ``charge``: Postgres and a cluster meter the price after the call.
PRICED_CASES: list[dict[str, Any]] = [
    # A gated spend limit: the price replaces the check's read of it, and refuses.
    {"policy": "three_gated", "context": {"user": "u_42", "tenant": "acme"},
     "price": {"tenant_spend": 10_000}, "ledger": True},
    {"policy": "three_gated", "context": {"user": "u_42", "tenant": "acme"},
     "price": {"tenant_spend": 10_000}},
    # Resolved caps (value caps, plans) and a price on a limit the check also counts.
    {"policy": "caps_and_plans", "context": {"user": "u_42", "tenant": "acme", "tool": "search"},
     "price": {"tenant_spend": 2_500, "global_calls": 1}, "ledger": True},
]  # fmt: skip
COST_ID = "0190f5a2-7e3b-7c1d-9f00-0000000000ee"


def priced_charge_vectors() -> list[dict[str, Any]]:
    """Per priced case the exact EVALSHA command RedisBackend sends; ``cost_from``: the
    index (from 0) of the first op of the cost event."""
    import redis.asyncio as aioredis

    from mcp_budget_governor.counters import with_cost
    from mcp_budget_governor.projections.counters.redis import RedisBackend

    out = []
    for case in PRICED_CASES:
        policy = loads(POLICIES[case["policy"]])
        ctx = Context(**case["context"])
        backend = RedisBackend(aioredis.Redis(), clock=lambda: NOW, coalesce=False)
        pairs = planning.charge_pairs(policy, case["price"])
        plan = planning.with_price(
            planning.check_plan(policy, ctx, NOW),
            planning.meter_slots(pairs, ctx, NOW, policy.tz, policy),
        )
        ledger = bool(case.get("ledger"))
        first = len(plan.slots) - plan.cost
        event_id = with_cost(EVENT_ID, COST_ID, first) if ledger else None
        args = backend.charge_args(Charge(plan.ops, event_id, True, None if ledger else OP_ID))
        command = ["EVALSHA", backend._charge.sha] + [
            a.decode() if isinstance(a, bytes) else str(a) for a in args
        ]
        out.append({**case, "now": NOW, "ledger": ledger, "cost_from": first,
                    "command": command})  # fmt: skip
    return out


def sql_vectors() -> dict[str, str]:
    """The statements PostgresBackend runs on the hot path, placeholders numbered as
    node-postgres numbers them ($1, $2, ...), casts and all."""
    from mcp_budget_governor.projections.counters import postgres

    def numbered(text: str) -> str:
        parts = text.split("%s")
        return "".join(p + (f"${i + 1}" if i < len(parts) - 1 else "") for i, p in enumerate(parts))

    return {"charge": numbered(postgres._CHARGE), "charge_many": numbered(postgres._CHARGE_MANY)}


def charge_many_vector() -> dict[str, Any]:
    """Every charge case without leases as one coalesced check batch, in order, and the
    first alone: the arguments of the mcpbg_charge_many calls PostgresBackend makes for
    them (array literals, as it sends them), caught before they reach a server."""
    from mcp_budget_governor.projections.counters import postgres

    cases, checks = [], []
    for i, case in enumerate(CHARGE_CASES):
        if case.get("lease") or case.get("require_epoch"):
            continue  # leases go to mcpbg_charge alone; the epoch flag is per batch
        policy = loads(POLICIES[case["policy"]])
        ctx = Context(**case["context"])
        if case["call"] == "check":
            ops = planning.check_plan(policy, ctx, NOW).ops
        else:
            pairs = planning.charge_pairs(policy, {case["limit"]: case["amount"]})
            ops = tuple(s.op for s in planning.meter_slots(pairs, ctx, NOW, policy.tz, policy))
        ledger = bool(case.get("ledger"))
        cases.append(i)
        checks.append((EVENT_ID if ledger else "", "" if ledger else OP_ID, ops))

    async def sent(batch: list[tuple[str, str, tuple[Any, ...]]]) -> list[Any]:
        backend = postgres.PostgresBackend("postgresql://conformance@127.0.0.1:1/none")
        caught: list[Any] = []

        async def call(params: Any) -> list[list[int]]:
            caught.extend(params)
            return [[0] for _ in batch]

        backend._charge_call = call  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        await backend.charge_many([
            postgres._Check(e, o, True, any(op.ref is not None for op in ops), ops,
                            loop.create_future(), 0.0)
            for e, o, ops in batch
        ])  # fmt: skip
        return caught

    return {
        "cases": cases,
        "sql": asyncio.run(sent(checks)),
        "sql_one": asyncio.run(sent(checks[:1])),
    }


# -- run-time changes -----------------------------------------------------------

#: Run-time changes (admin.py's builders, the governor's set_cap ... reset): per case
#: the call, the Change it builds, its context and the change.lua command; a bad one
#: the field its error names. ``used`` is what a reset read from the counter.
CHANGE_CASES: list[dict[str, Any]] = [
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": "acme"}, "cap": 300_000_000, "until": NOW + 86_400,
     "reason": "incident 42, a trial", "actor": "ops@acme"},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "user_calls",
     "scope": {"user": "a:b,{c}=é", "tool": "search"}, "cap": 7},
    {"policy": "caps_and_plans", "call": "unset_cap", "limit": "user_calls",
     "scope": {"user": "u_42", "tool": "x y"}, "actor": "ops"},
    {"policy": "caps_and_plans", "call": "assign_plan", "plan": "pro", "tenant": "x,y",
     "reason": "upgrade (!*'~)", "actor": "billing"},
    {"policy": "caps_and_plans", "call": "assign_plan", "plan": None, "user": "u_42"},
    {"policy": "caps_and_plans", "call": "grant", "limit": "tenant_spend",
     "scope": {"tenant": "acme"}, "amount": 5_000_000, "reason": "goodwill"},
    {"policy": "caps_and_plans", "call": "grant", "limit": "user_calls",
     "scope": {"user": "u_7", "tool": "search"}, "amount": 3},
    {"policy": "caps_and_plans", "call": "reset", "limit": "user_calls",
     "scope": {"tool": "search", "user": "u_7"}, "used": 42, "actor": "support"},
    {"policy": "concurrency", "call": "set_cap", "limit": "parallel", "scope": {"user": "u"},
     "cap": 2},
    # Bad input: one error naming the field, nothing built.
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "nope", "scope": {"tenant": "a"},
     "cap": 1},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"user": "u"}, "cap": 1},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "user_calls",
     "scope": {"user": "u"}, "cap": 1},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": ""}, "cap": 1},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": "a"}, "cap": -1},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": "a"}, "cap": 1.5},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": "a"}, "cap": 1, "until": NOW - 1},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": "a"}, "cap": 1, "reason": "x" * 1025},
    # until past the bounds table's last time (9999-01-01): refused at the door.
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": "a"}, "cap": 1, "until": 1e300},
    {"policy": "caps_and_plans", "call": "set_cap", "limit": "tenant_spend",
     "scope": {"tenant": "a"}, "cap": 1, "until": 253_402_300_799},
    {"policy": "caps_and_plans", "call": "assign_plan", "plan": "gold", "tenant": "a"},
    {"policy": "caps_and_plans", "call": "assign_plan", "plan": "pro", "tenant": "a",
     "user": "u"},
    {"policy": "caps_and_plans", "call": "assign_plan", "plan": "pro"},
    {"policy": "caps_and_plans", "call": "grant", "limit": "tenant_spend",
     "scope": {"tenant": "a"}, "amount": 0},
    {"policy": "caps_and_plans", "call": "grant", "limit": "global_calls", "scope": {},
     "amount": 1},
]  # fmt: skip


def _build_change(policy: Policy, case: dict[str, Any]) -> tuple[Change, Context]:
    who = {k: case[k] for k in ("reason", "actor") if k in case}
    call = case["call"]
    if call == "set_cap":
        return admin.cap_change(policy, case["limit"], case["scope"], case["cap"],
                                until=case.get("until"), now=NOW, **who)  # fmt: skip
    if call == "unset_cap":
        return admin.uncap_change(policy, case["limit"], case["scope"], **who)
    if call == "assign_plan":
        return admin.plan_change(policy, case["plan"], tenant=case.get("tenant"),
                                 user=case.get("user"), **who)  # fmt: skip
    if call == "grant":
        return admin.grant_change(policy, case["limit"], case["scope"], case["amount"], now=NOW,
                                  **who)  # fmt: skip
    return admin.grant_change(policy, case["limit"], case["scope"], None, now=NOW,
                              used=case["used"], **who)  # fmt: skip


def change_vectors() -> list[dict[str, Any]]:
    """Per case the Change, its context and the change.lua command (or the error's field)."""
    from mcp_budget_governor.projections.counters.redis import change_tokens

    sha = hashlib.sha1(source("change").encode()).hexdigest()
    out = []
    for case in CHANGE_CASES:
        policy = loads(POLICIES[case["policy"]])
        try:
            change, ctx = _build_change(policy, case)
        except InvalidInputError as exc:
            out.append({**case, "now": NOW, "error": exc.field})
            continue
        keys: list[str] = []
        tokens = change_tokens([change], keys, {})
        command = ["EVALSHA", sha, str(len(keys)), *keys, tokens, str(int(NOW * 1000))]
        fields = dataclasses.asdict(change)
        fields["kind"] = change.kind.value
        out.append({**case, "now": NOW, "change": fields, "context": _context(ctx),
                    "command": command})  # fmt: skip
    return out


# -- bounds -------------------------------------------------------------------

#: Numbers in and out of each row of the bounds table (mcp_budget_governor/bounds.py).
BOUND_CASES: list[tuple[str, Any]] = [
    ("until", 10**30), ("until", 1e300), ("until", 0), ("until", 1), ("until", 253_370_764_800),
    ("until", 253_370_764_801), ("until", 1.5), ("until", "5"), ("until", True),
    ("cap", -1), ("cap", 0), ("cap", 2**53 - 1), ("cap", 2**53), ("grant", 0), ("grant", 1),
    ("amount", -(2**53) + 1), ("amount", -(2**53)), ("time", -1), ("expire_at", 0),
]  # fmt: skip


def bounds_vectors() -> dict[str, Any]:
    """The table (kind -> [low, high, note]), each case's problem (None: in range), and the
    sum rule's answers; TypeScript declares the same table and is held to these."""
    from mcp_budget_governor import bounds

    table = {k: [b.low, b.high, b.note] for k, b in bounds.BOUNDS.items()}
    cases = [
        {"kind": kind, "value": value, "problem": bounds.problem(kind, value)}
        for kind, value in BOUND_CASES
    ]
    sums = [
        {"kind": kind, "total": total, "amount": amount,
         "problem": bounds.sum_problem(kind, total, amount)}
        for kind, total, amount in [("grant", 2**53 - 2, 1), ("grant", 2**53 - 1, 1),
                                    ("committed", 5, -6), ("committed", 5, -5)]
    ]  # fmt: skip
    return {"table": table, "cases": cases, "sums": sums}


# -- prices -------------------------------------------------------------------

#: Built-in models priced in the vectors (an id that moves out of genai-prices
#: only changes the vectors; the TypeScript table is the exported one).
PRICED = [
    ("claude-sonnet-4-5", 3200, 850, 0, 0),
    ("claude-sonnet-4-5", 300_000, 1000, 100_000, 50_000),
    ("gpt-4o", 10_000, 500, 8_000, 0),
    ("gpt-4o-mini", 1, 1, 0, 0),
    ("gemini-2.5-pro", 250_000, 10_000, 0, 0),
    ("GPT-4O", 7, 3, 0, 0),
]


def _rates(obj: Any) -> dict[str, str | None]:
    return {
        "input_per_mtok": str(obj.input_per_mtok),
        "output_per_mtok": str(obj.output_per_mtok),
        "cache_read_per_mtok": None
        if obj.cache_read_per_mtok is None
        else str(obj.cache_read_per_mtok),
        "cache_write_per_mtok": None
        if obj.cache_write_per_mtok is None
        else str(obj.cache_write_per_mtok),
    }


def price_vectors() -> dict[str, Any]:
    table = PriceTable.builtin()
    models = {}
    for name in sorted(table._prices):  # the whole table, as the TypeScript package ships it
        price = table._prices[name]
        models[name] = {
            **_rates(price),
            "tiers": [{"start": t.start, **_rates(t)} for t in price.tiers],
        }
    cases = []
    for model, inp, outp, read, write in PRICED:
        try:
            micros: int | None = table.cost_micros(
                model,
                input_tokens=inp,
                output_tokens=outp,
                cache_read_tokens=read,
                cache_write_tokens=write,
            )
        except UnknownModelError:
            micros = None
        cases.append({"model": model, "tokens": [inp, outp, read, write], "micros": micros})
    unknown = []
    for model in ("no-such-model-xyz", "gpt-4o-unknown-variant-zz"):
        try:
            table.cost_micros(model, input_tokens=1, output_tokens=1)
        except UnknownModelError as exc:
            # Without the builtin data's date (it changes daily; TypeScript's table has none).
            undated = UnknownModelError(exc.model, known=len(table))
            unknown.append({"model": model, "message": str(undated)})
    return {"version": table.version, "models": models, "cases": cases, "unknown": unknown}


# -- money --------------------------------------------------------------------

USD_MORE = ["0.0000005", "0.0000015", "12.34", "1.000001", "0.00000100001", "  2.5 ", "9007199254"]
USD_BAD = ["-1", "abc", "NaN", "Infinity", "9007199255", ""]


def usd_vectors() -> dict[str, Any]:
    good = {v: usd(v) for v in USD_MORE}
    bad = {}
    for v in USD_BAD:
        try:
            usd(v)
        except InvalidInputError as exc:
            bad[v] = {"field": exc.field, "problem": exc.problem}
    return {"good": good, "bad": bad}


# -- refusals -----------------------------------------------------------------


def refusal_vectors() -> list[dict[str, Any]]:
    """Decisions of every kind of refusal, and what an agent reads of each."""
    policy = loads(POLICIES["refusals"])
    ctx = Context(user="u_42", tenant="acme")
    decisions: list[tuple[str, Decision]] = []
    for lim in policy:
        s = planning.slot(lim, ctx, NOW, policy.tz, 1, enforce=True)
        assert s is not None
        decisions.append((f"refused:{lim.name}", planning.refused(s, NOW)))
        if lim.name == "burst":
            decisions.append(("unavailable:burst", planning.unavailable(s, 1.0)))
    repeats = loads(POLICIES["repeats"])
    looping = Context(session="s-1", tool="search", call=call_hash("search", {"q": "mcp"}))
    s = planning.slot(repeats["repeats"], looping, NOW, repeats.tz, 1, enforce=True)
    assert s is not None
    decisions.append(("refused:repeats", planning.refused(s, NOW)))
    decisions.append(("ledger_full", planning.ledger_full(1.0)))
    decisions.append(
        (
            "caller_unidentified",
            Decision(admitted=False, limit="burst", status=403, reason="caller_unidentified"),
        )
    )
    out = []
    for name, d in decisions:
        out.append(
            {
                "name": name,
                "limit": d.limit,
                "status": d.status,
                "retry_after": d.retry_after,
                "resets_at": None if d.resets_at is None else d.resets_at.timestamp(),
                "reason": d.reason,
                "headers": d.headers,
                "text": refusal_text(d),
                "body": refusal_body(d),
                "meta": {REFUSAL_META_KEY: refusal_meta(d)},
                "error": d.refusal_type().__name__,
            }
        )
    return out


# -- tool prices (the integrations' ``_meta.mcpbg``) ---------------------------

TOOL_META: list[dict[str, Any]] = [
    {"mcpbg": {"cost_usd": "0.01", "limit": "tenant_spend"}},
    {"mcpbg": {"cost": 3, "limit": ["per_user_calls"]}},
    {"mcpbg": {"estimate_usd": "0.05", "limit": "tenant_spend"}},
    {"mcpbg": {"cost_usd": "0.01", "estimate_usd": "0.05", "limit": "tenant_spend"}},
    {"other": 1},
    {"mcpbg": {"cost_usd": "0.01"}},
    {"mcpbg": {"cost_usd": "0.01", "limit": "nope"}},
    {"mcpbg": {"cost_usd": "0.01", "limit": "burst"}},
    {"mcpbg": {"cost_usd": "0.01", "limit": "tenant_spend", "extra": 1}},
    {"mcpbg": {"estimate_usd": 0.05, "limit": "tenant_spend"}},
]


def tool_meta_vectors() -> list[dict[str, Any]]:
    policy = loads(POLICIES["three_gated"])
    out = []
    for meta in TOOL_META:
        try:
            price = tool_price(policy, "search", meta)
            estimate = tool_estimate(policy, "search", meta)
        except InvalidInputError as exc:
            out.append({"meta": meta, "error": exc.field})
            continue
        out.append(
            {
                "meta": meta,
                "price": None if price is None else dict(price),
                "estimate": None if estimate is None else dict(estimate),
            }
        )
    return out


def call_hash_vectors() -> list[dict[str, Any]]:
    """The loop guard's hash of a call (repeats.py): tool, arguments, canonical JSON, hash."""
    cases: list[tuple[str, Any]] = [
        ("search", {"q": "mcp"}),
        ("search", {"n": 3, "q": "mcp"}),
        ("search", {"q": "mcp", "n": 3.0}),
        ("search", None),
        ("search", {}),
        ("fetch", {"url": "https://example.com/?a=1&b=2", "headers": {"Accept": "*/*"}}),
        ("t", {"nested": [1, 2.5, -0.25, True, False, None, [], {}], "é": "漢🙂", "a\u0000": ""}),
        ("t", {"b": 1, "a": 2, "B": 3, "_": 4, "ä": 5, "🙂": 6, "\uff21": 7}),
        ("t", {"big": 9007199254740991, "neg": -42, "small": 0.001, "exp": 1.5e300}),
        ("t", {"quote": 'say "hi"\n\ttab\\', "ctl": "\u0001\u001f\u007f"}),
    ]
    return [
        {"tool": t, "arguments": a, "canonical": canonical_json({} if a is None else a),
         "hash": call_hash(t, a)}
        for t, a in cases
    ]  # fmt: skip


def vectors() -> dict[str, Any]:
    out = golden()
    # "scripts" (golden) holds each script's SHA1, as EVALSHA runs it: its prelude (the
    # lib.lua lines of "prelude", 1-based inclusive ranges, each line with its "\n"),
    # the joiner, then its body. The TypeScript build assembles the same bytes from
    # these ranges, so the rule that picks them stays in lua/__init__.py.
    assert out["scripts"] == {n: hashlib.sha1(source(n).encode()).hexdigest() for n in SCRIPTS}
    out["script_layout"] = {
        "prefix": "lib.lua",
        "joiner": "\n",
        "names": list(SCRIPTS),
        "prelude": {n: [list(span) for span in script_layout(n)] for n in SCRIPTS},
    }
    out["policies"] = policy_vectors()
    out["charge"] = charge_vectors()
    out["charge_priced"] = priced_charge_vectors()
    out["sql"] = sql_vectors()
    out["charge_many"] = charge_many_vector()
    out["changes"] = change_vectors()
    out["bounds"] = bounds_vectors()
    out["builtin_prices"] = price_vectors()
    out["usd_more"] = usd_vectors()
    out["refusals"] = refusal_vectors()
    out["tool_meta"] = tool_meta_vectors()
    out["call_hash"] = call_hash_vectors()
    return out


def render() -> str:
    """The vectors as committed: sorted keys, ASCII, one trailing newline."""
    return json.dumps(vectors(), indent=1, ensure_ascii=True, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
