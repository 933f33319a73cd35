"""``mcpbg reconcile``: compare every live counter with the ledger; ``--fix`` repairs drift.

Exit code 0 when every counter equals the ledger's total for it, every
run-time cap, plan assignment and grant is what the ledger's changes leave
(Redis, Redis Cluster and Postgres), and no in-flight amount is orphaned, 1 when any
counter or run-time entry drifts or any in-flight
entry older than ``--older-than`` has no event in the ledger (the tables name
each key; also with ``--fix``, which repairs drift in the counters (Redis, or
Postgres with ``--postgres URL``) and settles
orphans by appending ``recovered`` events to the ledger, projected by the
worker: a later run then exits 0), 2 for bad input, an unreachable Redis or
broker, an empty or corrupt ledger. Exact while a worker runs
(``projections/reconcile.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..numbers import whole_argument
from ..settings import SETTINGS
from .counters_args import add_counters_options, counters_store
from .ledger_args import (
    DEFAULT_TOPIC,
    add_ledger_options,
    add_option,
    open_ledger_from,
    setting,
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "reconcile",
        help="compare every live counter with the ledger; exit 1 on drift; --fix repairs",
        description="Committed amounts are compared with the ledger's charges at offsets up to "
        "each partition's applied watermark, read in one atomic snapshot, so a running "
        "worker causes no false drift. In-flight amounts are shown, not compared.",
    )
    add_counters_options(p)
    add_ledger_options(p)
    p.add_argument(
        "--fix",
        action="store_true",
        help="add the difference to each drifting counter (and drop stale in-flight entries), "
        "put back the run-time caps, plan assignments and grants the ledger gives; "
        "settle orphaned in-flight amounts with recovery events appended to the ledger",
    )
    p.add_argument(
        "--older-than",
        type=whole_argument(),
        default=None,
        metavar="SECONDS",
        help="an in-flight entry with no ledger event is orphaned past this age "
        "(default 600; longer than any outbox backlog or worker lag you expect)",
    )
    add_option(
        p,
        "kafka_url",
        "with --fix: the broker to append recovery events to, kafka://host:port; "
        "without it, --ledger-dir's file ledger is appended to",
    )
    add_option(p, "topic", "the ledger topic")
    p.add_argument(
        "--show", type=whole_argument(), default=100, help="drifting keys listed (default 100)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import InvalidInputError
    from ..projections.counters.rebuild import open_store
    from ..projections.ledger_view import open_reservations
    from ..projections.reconcile import DEFAULT_ORPHAN_AGE, limit_meta, reconcile
    from .render import console, print_table

    if args.show < 0:
        raise InvalidInputError("--show", args.show, "0 or more")
    older_than = DEFAULT_ORPHAN_AGE if args.older_than is None else args.older_than
    if older_than < 0:
        raise InvalidInputError("--older-than", older_than, "seconds, 0 or more")
    name, url = counters_store(args)
    store = "postgres" if name == "postgres_url" else "redis"
    client = open_store(url, cluster=True)  # first: a bad URL is the error to see
    try:
        con = open_ledger_from(args)
    except BaseException:
        client.close()
        raise
    unfixable: list[Any] = []
    recovered = 0
    try:
        result = reconcile(con, client, fix=args.fix, older_than=older_than)
        # The records the projection refused (dead letters): never counted, never billed.
        dead = con.execute(
            'SELECT partition_name, "offset", id, reason FROM dead_letters ORDER BY 1, 2'
        ).fetchall()
        if args.fix and result.orphans:
            holds = open_reservations(con, int(result.now))
            recovered, unfixable = _settle(args, result.orphans, limit_meta(con), holds)
    finally:
        client.close()
        con.close()
    if args.json:
        json.dump(
            {
                "compared": result.compared,
                "in_flight": result.in_flight,
                "watermarks": result.watermarks,
                "fixed": result.fixed,
                "seen_restored": result.seen_restored,
                "orphaned_by_unit": result.orphaned_by_unit(),
                "recovered": recovered,
                "orphans": [
                    {
                        "key": o.key,
                        "event_id": o.event_id,
                        "amount": o.amount,
                        "unit": o.unit,
                        "age_seconds": o.age,
                        "settled": args.fix and o not in unfixable,
                    }
                    for o in result.orphans
                ],
                "drift": [
                    {
                        "key": d.key,
                        "redis": d.redis,
                        "ledger": d.ledger,
                        "drift": d.drift,
                        "in_flight": d.in_flight,
                        "stale_in_flight": d.stale,
                    }
                    for d in result.drifts
                ],
                "dead_letters": [
                    {"partition": p, "offset": o, "id": i, "reason": r} for p, o, i, r in dead
                ],
                "run_time_fixed": result.changes_fixed,
                "run_time_unreadable": result.changes_unreadable,
                "run_time_drift": [
                    {
                        "kind": c.kind,
                        "key": c.key,
                        "field": c.field,
                        store: c.store,
                        "ledger": c.ledger,
                    }
                    for c in result.change_drifts
                ],
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
    else:
        if result.drifts:
            print_table(
                f"drift: {len(result.drifts):,} of {result.compared:,} counters"
                + (" (fixed)" if result.fixed else ""),
                ["key", store, "ledger", "drift", "in-flight", "stale in-flight"],
                [
                    [d.key, d.redis, d.ledger, f"{d.drift:+d}", d.in_flight, d.stale]
                    for d in result.drifts[: args.show]
                ],
                numeric=[store, "ledger", "drift", "in-flight", "stale in-flight"],
            )
            if len(result.drifts) > args.show:
                console().print(f"... and {len(result.drifts) - args.show:,} more (--show N)")
            if result.seen_restored:  # Redis Cluster: what a failover lost of the seen sets
                console().print(
                    f"seen ids put back: {result.seen_restored:,} (a retry of those events "
                    "at a new offset is skipped, as before the failover)"
                )
        else:
            console().print(
                f"no drift: {result.compared:,} counters equal the ledger "
                f"(in flight: {result.in_flight:,})"
            )
        _print_changes(args, result, store)
        _print_orphans(args, result, recovered, unfixable, older_than)
        if dead:
            print_table(
                f"dead letters: {len(dead):,} records the projection refused (not counted, "
                "not billed)",
                ["partition", "offset", "event id", "reason"],
                [[p, o, i or "-", r] for p, o, i, r in dead[: args.show]],
                numeric=["offset"],
            )
    return 1 if result.drifts or result.change_drifts or result.orphans else 0


def _print_changes(args: argparse.Namespace, result: Any, store: str) -> None:
    """The run-time caps, assignments and grants that differ from the ledger (if any)."""
    from .render import console, print_table

    if result.changes_unreadable:
        console().print(
            f"warning: run-time caps, plans and grants not compared: "
            f"{result.changes_unreadable:,} run-time changes are in archive segments older "
            "than the change column (replay with --source kafka to restore them)"
        )
    drifts = result.change_drifts
    if not drifts:
        return
    print_table(
        f"run-time drift: {len(drifts):,} caps, plan assignments or grants differ from "
        "the ledger" + (" (put back)" if result.changes_fixed else ""),
        ["kind", "key", "field", store, "ledger"],
        [
            [c.kind, c.key, c.field, c.store or "(none)", c.ledger or "(none)"]
            for c in drifts[: args.show]
        ],
    )
    if len(drifts) > args.show:
        console().print(f"... and {len(drifts) - args.show:,} more (--show N)")


def _print_orphans(
    args: argparse.Namespace, result: Any, recovered: int, unfixable: list[Any], older_than: int
) -> None:
    from .render import console, print_table

    if not result.orphans:
        console().print(f"no orphaned in-flight amounts (older than {older_than:,} s)")
        return
    ids = {o.event_id for o in result.orphans}
    print_table(
        f"orphaned in flight: {len(result.orphans):,} entries of {len(ids):,} operations "
        f"older than {older_than:,} s, with no ledger event",
        ["key", "event id", "age s", "amount", "unit"],
        [
            [o.key, o.event_id, o.age, o.amount, o.unit or "? (unknown)"]
            for o in result.orphans[: args.show]
        ],
        numeric=["age s", "amount"],
    )
    if len(result.orphans) > args.show:
        console().print(f"... and {len(result.orphans) - args.show:,} more (--show N)")
    totals = ", ".join(
        f"{amount:,} {unit}" if unit != "?" else f"{amount:,} of unknown unit"
        for unit, amount in result.orphaned_by_unit().items()
    )
    console().print(f"orphaned per unit: {totals}")
    if args.fix:
        line = f"settled: {recovered:,} recovery events appended to the ledger"
        if unfixable:
            line += (
                f"; not settled: {len(unfixable):,} entries (no ledger event names the limit, "
                "or a refund no open reservation covers)"
            )
        console().print(line)


def _settle(
    args: argparse.Namespace, orphans: list[Any], meta: Any, holds: Any
) -> tuple[int, list[Any]]:
    """Append one recovery event per orphaned id to the ledger; (appended, unfixable)."""
    import asyncio

    from ..errors import InvalidInputError
    from ..projections.reconcile import recovery_entries

    entries, unfixable = recovery_entries(orphans, meta, holds)
    if not entries:
        return 0, unfixable
    kafka_url, ledger_dir = setting(args, "kafka_url"), setting(args, "ledger_dir")
    if kafka_url is None and ledger_dir is None:
        raise InvalidInputError(
            "--kafka-url",
            None,
            "required by --fix to settle orphans: the ledger to append recovery events to "
            f"(or set {SETTINGS['kafka_url'].env}, or give --ledger-dir for the file ledger)",
        )
    asyncio.run(_append(kafka_url, setting(args, "topic"), ledger_dir, entries))
    return len(entries), unfixable


async def _append(
    kafka_url: str | None, topic: str | None, ledger_dir: str | None, entries: list[Any]
) -> None:
    import tempfile

    from ..ledger import Ledger

    ledger: Ledger
    if kafka_url is not None:
        from ..producers.kafka_ledger import KafkaLedger

        # Its own outbox, and each event acknowledged by the broker before this returns:
        # "settled" means on the topic, not in a folder nobody ships.
        ledger = KafkaLedger.from_url(
            kafka_url,
            topic=topic or DEFAULT_TOPIC,
            source="/mcpbg/reconcile",
            outbox_dir=tempfile.mkdtemp(prefix="mcpbg-reconcile-outbox-"),
            durability="acked",
            create_topic=False,
        )
    else:
        from ..producers.file_ledger import FileLedger

        assert ledger_dir is not None
        ledger = FileLedger(ledger_dir, source="/mcpbg/reconcile", fsync="always")
    try:
        for entry in entries:
            await ledger.append(entry)
    finally:
        await ledger.aclose()
