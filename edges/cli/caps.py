"""``mcpbg caps``, ``mcpbg plans``, ``mcpbg grant``, ``mcpbg reset``: budgets changed at run time.

``caps set LIMIT --tenant acme --cap-usd 100 [--until DATE]``, ``caps unset``,
``caps list``; ``plans assign --tenant acme pro``; ``grant LIMIT --user u_42
--usd 5 --reason ...``; ``reset LIMIT --user u_42 --reason ...``.

Each change is a ledger event (``--kafka-url``/``MCPBG_KAFKA_URL``, or the file
ledger of ``--ledger-dir``), applied by the projection on every replica; with
neither, it is written to the counters directly, in Redis (``--redis-url``) or
Postgres (``--postgres``) (deployments without a ledger). Bad input (unknown
limit, scope value or plan, a negative or fractional amount, an ``--until`` in
the past) is one line naming the option and the value, exit 2, and nothing is
written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import TYPE_CHECKING, Any

from .counters_args import add_counters_options
from .ledger_args import DEFAULT_TOPIC, add_option, policy_spec, setting

if TYPE_CHECKING:
    from ..governor import Governor
    from ..policy import Policy

_SCOPES = ("tenant", "user", "agent", "session", "tool")


def register(sub: Any) -> None:
    caps = sub.add_parser("caps", help="set, unset or list run-time caps per scope value")
    verbs = caps.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("set", help="give one scope value of LIMIT its own cap")
    _common(p, limit=True)
    p.add_argument("--cap-usd", help='the cap in dollars, e.g. "100" or "99.50" (money limits)')
    p.add_argument("--cap", help="the cap as a whole number (calls and tokens limits)")
    p.add_argument("--until", help="ISO date or time it lasts until (default: for good)")
    p.set_defaults(run=run_set)
    p = verbs.add_parser("unset", help="remove a run-time cap: the policy's caps apply again")
    _common(p, limit=True)
    p.set_defaults(run=run_unset)
    p = verbs.add_parser("list", help="run-time caps, plan assignments and grants, with reasons")
    add_option(p, "policy")
    add_counters_options(p)
    _api_option(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run_list)

    plans = sub.add_parser("plans", help="assign tenants or users to a plan at run time")
    verbs = plans.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("assign", help="move a tenant or a user to PLAN ('-': the policy's)")
    _common(p, limit=False)
    p.add_argument("plan", help="a plan of the policy, or - to unassign")
    p.set_defaults(run=run_assign)

    p = sub.add_parser("grant", help="extra room in the current period (spend unchanged)")
    _common(p, limit=True)
    p.add_argument("--usd", help="dollars to grant (money limits)")
    p.add_argument("--amount", help="calls or tokens to grant")
    p.set_defaults(run=run_grant)

    p = sub.add_parser("reset", help="restore the current period's room, keeping the spend")
    _common(p, limit=True)
    p.set_defaults(run=run_reset)


def _api_option(p: Any) -> None:
    from ..console.auth import variables

    p.add_argument(
        "--api",
        metavar="URL",
        help="talk to a running `mcpbg serve` at URL instead of Redis and the ledger "
        f"(token: {variables()})",
    )


def _common(p: Any, *, limit: bool) -> None:
    if limit:
        p.add_argument("limit", help="the limit's name")
    _api_option(p)
    add_option(p, "policy")
    add_counters_options(p)
    add_option(p, "kafka_url", "append the event to this broker")
    add_option(p, "topic")
    add_option(p, "ledger_dir", "append the event to this file ledger")
    for scope in _SCOPES if limit else ("tenant", "user"):
        p.add_argument(f"--{scope}", help=f"the {scope}")
    p.add_argument("--reason", default="", help="why (kept with the change)")
    p.add_argument("--actor", default="", help="who (default: $USER)")


def _scope(args: argparse.Namespace) -> dict[str, str]:
    return {s: getattr(args, s) for s in _SCOPES if getattr(args, s, None) is not None}


def _actor(args: argparse.Namespace) -> str:
    import getpass

    if args.actor:
        return str(args.actor)
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment
        return ""


async def _governor(args: argparse.Namespace, policy: Policy) -> Governor:
    """A governor over the counters (Redis or Postgres), appending to the ledger when one
    is named."""
    import tempfile

    from ..governor import Governor
    from ..ledger import Ledger
    from .counters_args import open_counters

    backend = open_counters(args)
    ledger: Ledger | None = None
    kafka_url, ledger_dir = setting(args, "kafka_url"), setting(args, "ledger_dir")
    if kafka_url is not None:
        from ..producers.kafka_ledger import KafkaLedger

        # Acknowledged by the broker before this returns: "done" means on the topic.
        ledger = KafkaLedger.from_url(
            kafka_url,
            topic=setting(args, "topic") or DEFAULT_TOPIC,
            source="/mcpbg/caps",
            outbox_dir=tempfile.mkdtemp(prefix="mcpbg-caps-outbox-"),
            durability="acked",
            create_topic=False,
        )
    elif ledger_dir is not None:
        from ..producers.file_ledger import FileLedger

        ledger = FileLedger(ledger_dir, source="/mcpbg/caps", fsync="always")
    return Governor(policy, backend, ledger=ledger)


def _policy(args: argparse.Namespace) -> Policy:
    from ..policy_file import load_policy

    return load_policy(policy_spec(args))


def _run(args: argparse.Namespace, make: Any) -> int:
    """Validate whole (nothing is opened before), then write the one change."""
    policy = _policy(args)
    change_args = make(policy)  # raises on bad input, before any connection

    async def go() -> Any:
        gov = await _governor(args, policy)
        try:
            return await change_args(gov)
        finally:
            await gov.aclose()

    change = asyncio.run(go())
    ledgered = setting(args, "kafka_url") or setting(args, "ledger_dir")
    where = "appended to the ledger" if ledgered else "written"
    print(f"{change.kind.value} {change.limit} {change.field or change.key}: {where}")
    return 0


def _api_write(args: argparse.Namespace, method: str, path: str, **fields: Any) -> int:
    """The change through ``mcpbg serve`` (which validates it with the same builders)."""
    from .api_client import send_json

    body = {
        "limit": args.limit,
        "scope": _scope(args),
        "reason": args.reason,
        "actor": _actor(args),
        **{k: v for k, v in fields.items() if v is not None},
    }
    change = send_json(args.api, method, path, body)
    where = change["field"] or change["key"]
    print(f"{change['kind']} {change['limit']} {where}: {change['where']}")
    return 0


def run_set(args: argparse.Namespace) -> int:
    if args.api:
        return _api_write(
            args, "POST", "/v1/caps", cap=args.cap, cap_usd=args.cap_usd, until=args.until
        )
    from .. import admin

    def make(policy: Policy) -> Any:
        cap = admin.parse_amount(
            policy, args.limit, ("--cap-usd", args.cap_usd), ("--cap", args.cap)
        )
        until = admin.parse_until(policy, args.until)
        admin.cap_change(policy, args.limit, _scope(args), cap, until=until, now=_now())
        return lambda gov: gov.set_cap(
            args.limit, cap, until=until, reason=args.reason, actor=_actor(args), **_scope(args)
        )

    return _run(args, make)


def run_unset(args: argparse.Namespace) -> int:
    if args.api:
        return _api_write(args, "DELETE", "/v1/caps")
    from .. import admin

    def make(policy: Policy) -> Any:
        admin.uncap_change(policy, args.limit, _scope(args))
        return lambda gov: gov.unset_cap(
            args.limit, reason=args.reason, actor=_actor(args), **_scope(args)
        )

    return _run(args, make)


def run_assign(args: argparse.Namespace) -> int:
    from .. import admin

    plan = None if args.plan == "-" else args.plan

    def make(policy: Policy) -> Any:
        admin.plan_change(policy, plan, tenant=args.tenant, user=args.user)
        return lambda gov: gov.assign_plan(
            plan, tenant=args.tenant, user=args.user, reason=args.reason, actor=_actor(args)
        )

    return _run(args, make)


def run_grant(args: argparse.Namespace) -> int:
    if args.api:
        return _api_write(args, "POST", "/v1/grants", amount=args.amount, usd=args.usd)
    from .. import admin

    def make(policy: Policy) -> Any:
        amount = admin.parse_amount(
            policy, args.limit, ("--usd", args.usd), ("--amount", args.amount)
        )
        admin.grant_change(policy, args.limit, _scope(args), amount, now=_now())
        return lambda gov: gov.grant(
            args.limit, amount, reason=args.reason, actor=_actor(args), **_scope(args)
        )

    return _run(args, make)


def run_reset(args: argparse.Namespace) -> int:
    if args.api:
        return _api_write(args, "POST", "/v1/resets")
    from .. import admin

    def make(policy: Policy) -> Any:
        admin.grant_change(policy, args.limit, _scope(args), None, now=_now(), used=0)
        return lambda gov: gov.reset(
            args.limit, reason=args.reason, actor=_actor(args), **_scope(args)
        )

    return _run(args, make)


def _now() -> float:
    import time as clock

    return clock.time()


def run_list(args: argparse.Namespace) -> int:
    from .render import print_table

    if getattr(args, "api", None):
        from .api_client import get_json

        rows = get_json(args.api, "/v1/caps")
    else:
        from ..projections.changes import change_rows
        from .counters_args import counters_store, open_counters

        policy = _policy(args)
        counters_store(args)  # a bad or missing URL is the error to see, before connecting

        async def read() -> list[dict[str, Any]]:
            backend = open_counters(args)
            try:
                return await change_rows(policy, backend)
            finally:
                await backend.aclose()

        rows = asyncio.run(read())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no run-time caps or plan assignments")
        return 0
    print_table(
        None,
        ["kind", "limit", "scope", "cap / plan / grant", "until / bucket", "who", "why"],
        [
            [
                r["kind"],
                r.get("limit", ""),
                r["scope"],
                r.get("shown", r.get("plan", "")),
                (r.get("until") or r.get("bucket") or "")
                + (" (expired)" if r.get("expired") else ""),
                r.get("actor", ""),
                r.get("reason", ""),
            ]
            for r in rows
        ],
    )
    return 0
