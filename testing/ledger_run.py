"""A governed run on a real Redis or Postgres, projected and archived as the worker does it.

The workload the ledger view, replay, reconcile and costs suites share
(:func:`mixed_run`): a Governor with a ledger, its events projected by the real
:class:`Projector` with the real :class:`Archiver` as its archive hook, including
redelivered batches, overlapping archive segments and a producer duplicate; then
the counters and watermarks it left, more events after it (:func:`extend`), and
``mcpbg`` run in process (:func:`run_cli`).
"""

from __future__ import annotations

import contextlib
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    LimitExceeded,
    Policy,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.cli import main
from mcp_budget_governor.events import LedgerEvent, encode, parse
from mcp_budget_governor.ledger import partition_key
from mcp_budget_governor.ledger import partition_of as partition_index
from mcp_budget_governor.prices import PriceTable
from mcp_budget_governor.producers.memory_ledger import MemoryLedger
from mcp_budget_governor.stream.archiver import Archiver
from mcp_budget_governor.stream.projector import Projector
from testing.stores import backend_for
from testing.stores import live_counters as live_counters  # re-exported for the suites
from testing.stores import watermarks as watermarks
from testing.stream_support import policy as stream_policy
from testing.stream_support import tenants_per_partition

TOPIC = "mcpbg.ledger"
PARTITIONS = 3
SOURCE = "/mcpbg/test"


#: Three tenants, one on each partition (the ledger partitions by tenant).
TENANTS = tenants_per_partition(PARTITIONS, 1, "t")


def policy() -> Policy:
    """The stream workloads' policy with a tighter burst, more tenant spend and a
    monthly user spend (testing/stream_support.py ``policy``)."""
    user_spend = Limit(
        "user_spend",
        cap=usd(20),
        window=Window.MONTH,
        unit=Unit.USD_MICROS,
        scope=Scope.USER,
        gated=False,
    )
    return stream_policy(user_spend, burst=6, spend=usd(50))


class Clock:
    """Governor time: starts ``back`` seconds ago and steps, so events span a few minutes."""

    def __init__(self, now: float, back: float, step: float) -> None:
        self.t = now - back
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


async def workload(gov: Governor, n: int, rng: random.Random, users: str = "u") -> None:
    """Checks (some refused), metered USD, metered model calls, reservations settled or released."""
    for _ in range(n):
        ctx = Context(user=f"{users}{rng.randrange(6)}", tenant=rng.choice(TENANTS), tool="search")
        op = rng.random()
        if op < 0.5:
            await gov.check(ctx)
        elif op < 0.7:
            await gov.meter("spend", rng.randrange(1, 40_000), ctx)
        elif op < 0.85:
            await gov.meter_tokens(
                "user_spend",
                rng.choice(["gpt-4o", "claude-haiku-4-5"]),
                input_tokens=rng.randrange(100, 5000),
                output_tokens=rng.randrange(10, 800),
                cache_read_tokens=rng.choice([0, 50]),
                ctx=ctx,
            )
        else:
            with contextlib.suppress(LimitExceeded):  # any refusal (402 here), as in 0.1.0
                async with gov.reserved("spend", 25_000, ctx) as r:
                    if rng.random() < 0.3:
                        r.release()
                    else:
                        r.actual = rng.randrange(0, 50_000)


@dataclass
class Run:
    """What a mixed run produced: the raw events per partition, in offset order."""

    archive: Path
    partitions: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)

    def events(self) -> list[tuple[int, int, bytes]]:
        return [(p, o, raw) for p, recs in sorted(self.partitions.items()) for o, raw in recs]

    def unique(self, *, upto: dict[int, int] | None = None) -> list[LedgerEvent]:
        """The events, each id once (first offset wins); with ``upto``, only those at or
        before each partition's offset."""
        out: list[LedgerEvent] = []
        seen: set[str] = set()
        for p, offset, raw in self.events():
            if upto is not None and offset > upto.get(p, -1):
                continue
            event = parse(raw)
            if event.id not in seen:
                seen.add(event.id)
                out.append(event)
        return out

    def totals(self, *, upto: dict[int, int] | None = None) -> dict[str, int]:
        """Independent of DuckDB: the sum per key, each event id once (first offset wins)."""
        out: dict[str, int] = defaultdict(int)
        for event in self.unique(upto=upto):
            for c in event.data.charges:
                out[c.key] += c.amount
        return dict(out)


def partition_of(raw: bytes) -> int:
    ctx = parse(raw).data.context
    return partition_index(partition_key(ctx.tenant, ctx.user), PARTITIONS)


async def mixed_run(
    redis_url: str, tmp_path: Path, *, n: int = 400, seed: int = 1, project: bool = True
) -> Run:
    """A governed workload on the store at ``redis_url`` (Redis or Postgres), projected
    and archived like the worker does it.

    Batches of 40 per partition; the second batch of each partition is
    delivered again shifted by 20 (overlapping segments, a redelivery), and
    the first event of partition 0 is appended again at the end (a producer
    retry at a new offset). ``project=False`` leaves everything in flight.
    """
    import time

    backend = backend_for(redis_url)
    await backend.mark_ready("test")
    ledger = MemoryLedger()
    gov = Governor(
        policy(),
        backend,
        ledger=ledger,
        prices=PriceTable.builtin(),
        clock=Clock(time.time(), back=180, step=180 / n),
    )
    await workload(gov, n, random.Random(seed))
    run = Run(tmp_path / "archive")
    for entry in ledger.entries:
        raw = encode(entry, SOURCE)
        p = partition_of(raw)
        records = run.partitions.setdefault(p, [])
        records.append((len(records), raw))
        run.ids.append(entry.id)
    first = run.partitions[0][0][1]
    run.partitions[0].append((len(run.partitions[0]), first))  # a producer retry
    if project:
        archiver = Archiver(run.archive, topic=TOPIC)
        projector = Projector(backend, TOPIC, dlq=lambda letter: None, archive=archiver.write_batch)
        for p, records in sorted(run.partitions.items()):
            for start in range(0, len(records), 40):
                await projector.apply_batch(p, records[start : start + 40])
                if start == 40:  # redelivered after a "rebalance", batched differently
                    await projector.apply_batch(p, records[start - 20 : start + 20])
    await backend.aclose()
    return run


async def extend(
    redis_url: str, run: Run, n: int, seed: int, *, back: float = 30, users: str = "u"
) -> dict[int, list[tuple[int, bytes]]]:
    """New governed events after the run (the hot path writes them in flight in the store),
    appended at the next offsets of their partitions; returns them per partition."""
    import time

    backend = backend_for(redis_url)
    ledger = MemoryLedger()
    gov = Governor(
        policy(), backend, ledger=ledger, prices=PriceTable.builtin(),
        clock=Clock(time.time(), back=back, step=back / n),
    )  # fmt: skip
    await workload(gov, n, random.Random(seed), users)
    await backend.aclose()
    new: dict[int, list[tuple[int, bytes]]] = {}
    for entry in ledger.entries:
        raw = encode(entry, SOURCE)
        p = partition_of(raw)
        records = run.partitions[p]
        records.append((len(records), raw))
        new.setdefault(p, []).append(records[-1])
    return new


async def run_time_changes(
    redis_url: str, run: Run, *, tenant: str = TENANTS[0]
) -> dict[int, list[tuple[int, bytes]]]:
    """Run-time changes after the run, appended like :func:`extend` (not applied): caps set
    (two, one unset again), a plan assignment and one undone, two grants and a reset
    of the current day's counters of ``tenant`` and user ``u1``."""
    import time

    from mcp_budget_governor import Plan

    base = policy()
    plans = [Plan("pro", caps={"burst": 60})]
    with_plans = Policy.of(*base.limits, plans=plans)
    backend = backend_for(redis_url)
    ledger = MemoryLedger()
    gov = Governor(with_plans, backend, ledger=ledger, clock=time.time)
    await gov.set_cap("tenant_calls", 5_000, tenant=tenant, actor="ops", reason="trial")
    await gov.set_cap("burst", 9, user="u1", until=time.time() + 86_400)
    await gov.set_cap("daily", 90, user="u2")
    await gov.unset_cap("daily", user="u2")
    await gov.assign_plan("pro", user="u1", actor="ops")
    await gov.assign_plan("pro", tenant=tenant)
    await gov.assign_plan(None, tenant=tenant)
    await gov.grant("tenant_calls", 40, tenant=tenant, reason="goodwill")
    await gov.grant("tenant_calls", 2, tenant=tenant)
    await gov.grant("daily", 7, user="u1")
    await gov.reset("daily", user="u3")
    await backend.aclose()
    new: dict[int, list[tuple[int, bytes]]] = {}
    for entry in ledger.entries:
        raw = encode(entry, SOURCE)
        p = partition_of(raw)
        records = run.partitions.setdefault(p, [])
        records.append((len(records), raw))
        new.setdefault(p, []).append(records[-1])
    return new


async def project(redis_url: str, run: Run, new: dict[int, list[tuple[int, bytes]]]) -> None:
    """Apply (and archive) ``new`` records of ``run`` into the store, as the worker does."""
    backend = backend_for(redis_url)
    archiver = Archiver(run.archive, topic=TOPIC)
    projector = Projector(backend, TOPIC, dlq=lambda letter: None, archive=archiver.write_batch)
    for p, records in sorted(new.items()):
        await projector.apply_batch(p, records)
    await backend.aclose()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``mcpbg *argv`` in this process: its exit code, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
