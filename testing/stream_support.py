"""What the stream-worker tests share: a broker, names, a governed workload, worker
subprocesses, and the checks "caught up" and "every counter exact".

A plain module (like ``services.py``): test files import the fixtures and helpers
they use, by name. "Caught up" is judged the way the design asks: the topic is
read back (the fetched highwater marks say where it ends), and the worker is done
when every partition's Redis watermark has reached the last valid event of that
partition. Then every counter touched must equal the sum of its ledger charges
(each event id once), with nothing left in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mcp_budget_governor import (
    Context,
    Governor,
    Limit,
    LimitExceeded,
    Policy,
    RedisBackend,
    Scope,
    Unit,
    Window,
    usd,
)
from mcp_budget_governor.events import LedgerEvent
from mcp_budget_governor.keys import WATERMARK_KEY
from mcp_budget_governor.ledger import partition_key, partition_of
from mcp_budget_governor.producers.kafka_ledger import KafkaLedger
from mcp_budget_governor.stream.topic_reader import TopicRecords, read_topic
from testing.services import KafkaService, start_kafka

REPO = Path(__file__).resolve().parent.parent
PARTITIONS = 3
#: How the tests run ``mcpbg``: this interpreter, ``-m`` (no console script needed).
CLI = (sys.executable, "-m", "mcp_budget_governor.cli")
GROUP_OPTS = ["--session-timeout-ms", "6000", "--heartbeat-interval-ms", "500"]
CATCH_UP = 60.0  # seconds a worker may take to project what it has been given

#: The worker's engines (``mcpbg worker --engine``); the exactly-once tests run on each.
ENGINES = ("aiokafka", "faust")

#: Parametrises a test over both engines (the fixture ``engine`` takes the value). The
#: faust variants are marked slow: a faust worker takes seconds longer to start and join.
both_engines = pytest.mark.parametrize(
    "engine",
    [
        pytest.param("aiokafka"),
        pytest.param(
            "faust",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(
                    importlib.util.find_spec("faust") is None,
                    reason="the faust engine needs the faust extra",
                ),
            ],
        ),
    ],
)


@pytest.fixture
def engine() -> str:
    """The engine of the workers a test starts: the default, unless ``both_engines``."""
    return ENGINES[0]


def tenants(partitions: int, at_least: int, prefix: str) -> list[str]:
    """At least ``at_least`` tenant names whose events land on every partition (the
    ledger keys by tenant)."""
    names: list[str] = []
    covered: set[int] = set()
    while len(names) < at_least or covered != set(range(partitions)):
        name = f"{prefix}{len(names)}"
        names.append(name)
        covered.add(partition_of(partition_key(name, None), partitions))
    return names


def tenants_per_partition(partitions: int, each: int, prefix: str) -> list[str]:
    """``each`` tenant names on every partition, grouped in partition order."""
    found: dict[int, list[str]] = {p: [] for p in range(partitions)}
    i = 0
    while any(len(names) < each for names in found.values()):
        name = f"{prefix}{i}"
        names = found[partition_of(partition_key(name, None), partitions)]
        if len(names) < each:
            names.append(name)
        i += 1
    return [name for p in range(partitions) for name in found[p]]


TENANTS = tenants(PARTITIONS, 6, "t")


def policy(*extra: Limit, burst: int = 8, spend: int = usd(20)) -> Policy:
    """The test workloads' policy: a user's burst and day, a tenant's calls and spend,
    then ``extra`` (the ledger runs add a monthly user spend, see testing/ledger_run.py)."""
    return Policy.of(
        Limit("burst", cap=burst, window=Window.MINUTE, scope=Scope.USER),
        Limit("daily", cap=400, window=Window.DAY, scope=Scope.USER),
        Limit("tenant_calls", cap=100_000, window=Window.DAY, scope=Scope.TENANT),
        Limit(
            "spend",
            cap=spend,
            window=Window.DAY,
            unit=Unit.USD_MICROS,
            scope=Scope.TENANT,
            gated=False,
        ),
        *extra,
    )


#: One global counter every partition charges, alerting every 10 %: two workers
#: splitting the partitions both see each level crossed. A worker subprocess loads it
#: with ``--policy testing.stream_support:ALERT_POLICY`` (the repository root is on
#: its ``PYTHONPATH``, see :func:`start_worker`).
ALERT_LEVELS = (10, 20, 30, 40, 50, 60, 70, 80, 90)
ALERT_POLICY = policy(Limit("all_calls", cap=100, window=Window.DAY, alert_at=ALERT_LEVELS))


async def workload(gov: Governor, n: int, rng: random.Random) -> None:
    """``n`` governed operations: checks (some refused), metered costs, reservations."""
    for _ in range(n):
        ctx = Context(user=f"u{rng.randrange(12)}", tenant=rng.choice(TENANTS))
        op = rng.random()
        if op < 0.55:
            await gov.check(ctx)
        elif op < 0.85:
            await gov.meter("spend", rng.randrange(1, 40_000), ctx)
        else:
            with contextlib.suppress(LimitExceeded):  # any refusal (402 here), as in 0.1.0
                async with gov.reserved("spend", 25_000, ctx) as r:
                    r.actual = rng.randrange(0, 50_000)


# -- services and processes ---------------------------------------------------


async def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    """A topic of ``partitions`` partitions (replication 1: one broker)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


@pytest.fixture(scope="module")
def kafka() -> Iterator[KafkaService]:
    svc = start_kafka()
    yield svc
    svc.stop()


@dataclass
class Names:
    topic: str
    group: str


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:10]
    return Names(f"ledger-{tag}", f"projector-{tag}")


class Worker:
    """One ``python -m mcp_budget_governor.cli worker`` subprocess and its log."""

    def __init__(self, name: str, log: Path, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        body = "\n".join(self.text().splitlines()[-lines:])
        return f"--- worker {self.name} (pid {self.proc.pid}, {state}) ---\n{body}"

    def resumed_at(self) -> dict[int, int] | None:
        """The offsets of the worker's last assignment ("resuming at p0@12, ..."), None before."""
        found = re.findall(r"projector: assigned [\d,]*; resuming at (.*)", self.text())
        if not found:
            return None
        return {int(p): int(o) for p, o in re.findall(r"p(\d+)@(\d+)", found[-1])}

    def assigned(self) -> set[int] | None:
        """The partitions of the worker's last assignment, None before the first."""
        found = re.findall(r"projector: assigned ([\d,]*); resuming", self.text())
        if not found:
            return None
        return {int(p) for p in found[-1].split(",") if p}

    def applied(self) -> int:
        """How many events the worker applied, from its last "stopped after" line."""
        return int(re.findall(r"stopped after \d+ records, (\d+) applied", self.text())[-1])

    def kill(self) -> None:
        """SIGKILL by pid, as a crash (or the OOM killer) would."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def terminate(self, within: float = 30.0) -> int:
        """SIGTERM, as an orchestrator stops a worker; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"worker {self.name} ignored SIGTERM for {within}s\n{self.tail()}")


def worker_logs(workers: Iterable[Worker]) -> str:
    return "\n".join(w.tail() for w in workers)


def worker_argv(
    topic: str,
    group: str,
    *extra: str,
    python: Sequence[str] = CLI,
) -> list[str]:
    """``mcpbg worker`` as a subprocess, in a group that notices a dead member quickly.

    ``python``: what runs the CLI (a profiling script, say) in place of ``python -m``.
    """
    return [
        *python, "worker",
        "--topic", topic,
        "--group", group,
        *GROUP_OPTS,
        *extra,
    ]  # fmt: skip


def worker_env(tmp: Path) -> dict[str, str]:
    """This environment without ``MCPBG_*`` settings; temp files under ``tmp``, so
    whatever a SIGKILLed worker leaves stays in the test's dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCPBG_")}
    env["TMPDIR"] = str(tmp)
    return env


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """Started workers; any still running at the end is killed by its pid."""
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


def start_worker(
    started: list[Worker],
    kafka: KafkaService,
    redis_url: str,
    names: Names,
    tmp_path: Path,
    *extra: str,
    env_extra: Mapping[str, str] | None = None,
) -> Worker:
    env = worker_env(tmp_path)
    env.update(env_extra or {})
    # Settings through the environment (as in a container), options for the rest.
    env.update(MCPBG_KAFKA_URL=f"kafka://{kafka.bootstrap}", MCPBG_REDIS_URL=redis_url)
    # --policy testing.stream_support:ALERT_POLICY names a module of this package.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    argv = worker_argv(
        names.topic, names.group,
        "--batch-size", "200",
        "--batch-wait", "0.1",
        "--progress-interval", "1",
        "--topic-wait", "20",
        *extra,
    )  # fmt: skip
    name = str(len(started))
    worker = Worker(name, tmp_path / f"worker-{name}.log", argv, env)
    started.append(worker)
    return worker


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend.from_url(redis_url, timeout=5.0)
    # An intact (empty) projection: these tests are about the live path; a Redis
    # without the marker would first be rebuilt (tests/test_stream_rebuild.py).
    await b.mark_ready("test")
    yield b
    await b.aclose()


@contextlib.asynccontextmanager
async def governor(
    kafka: KafkaService,
    backend: RedisBackend,
    topic: str,
    tmp_path: Path,
    rules: Policy | None = None,
) -> AsyncIterator[Governor]:
    """A Governor whose ledger is the topic; every event is acknowledged on exit."""
    ledger = KafkaLedger(
        kafka.bootstrap, topic=topic, partitions=PARTITIONS, outbox_dir=tmp_path / "outbox"
    )
    gov = Governor(rules or policy(), backend, ledger=ledger)
    try:
        yield gov
    finally:
        assert await ledger.flush(30.0), "the ledger did not ship every event"
        await ledger.aclose()


# -- checks -------------------------------------------------------------------


async def read_ledger(kafka: KafkaService, topic: str) -> TopicRecords:
    records = await read_topic(kafka.bootstrap, topic, on_malformed=lambda *_: None)
    assert records.caught_up, "the topic could not be read to its highwater marks"
    return records


async def watermarks(backend: RedisBackend, topic: str) -> dict[int, int]:
    """The Redis watermark (last applied offset) of each partition of ``topic``."""
    raw = await backend.client.hgetall(WATERMARK_KEY)
    prefix = f"{topic}:"
    fields = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    return {int(k[len(prefix) :]): v for k, v in fields.items() if k.startswith(prefix)}


async def applied_offsets(backend: RedisBackend, topic: str) -> int:
    """Offsets the counters hold (watermark + 1, summed): all records valid events."""
    return sum(v + 1 for v in (await watermarks(backend, topic)).values())


async def wait_watermarks(
    backend: RedisBackend,
    topic: str,
    records: TopicRecords,
    within: float,
    logs: Callable[[], str],
    poll: float = 0.1,
) -> None:
    """Until every partition's watermark is its last offset; on timeout, say which lag.

    The last offset of a valid event, or past it: the watermark also moves through
    dead letters that follow a partition's last event."""
    last: dict[int, int] = {}
    for r in records:
        last[r.partition] = max(last.get(r.partition, -1), r.offset)
    deadline = time.monotonic() + within
    while True:
        marks = await watermarks(backend, topic)
        if all(marks.get(p, -1) >= want for p, want in last.items()):
            return
        if time.monotonic() > deadline:
            lag = {
                p: f"watermark {marks.get(p, -1)}, last offset {want}, "
                f"{want - marks.get(p, -1)} behind"
                for p, want in sorted(last.items())
                if marks.get(p, -1) < want
            }
            pytest.fail(f"not caught up within {within:g}s; lagging: {lag}\n{logs()}")
        await asyncio.sleep(poll)


async def wait_caught_up(
    kafka: KafkaService,
    backend: RedisBackend,
    topic: str,
    workers: list[Worker],
    within: float = CATCH_UP,
) -> TopicRecords:
    """Read the topic, then wait until each partition's watermark is its last valid event."""
    records = await read_ledger(kafka, topic)
    await wait_watermarks(backend, topic, records, within, lambda: worker_logs(workers))
    return records


def unique_events(records: TopicRecords) -> list[LedgerEvent]:
    """Each event once: a producer retry may put the same event on the topic twice."""
    seen: set[str] = set()
    events = []
    for r in records:
        if r.event.id not in seen:
            seen.add(r.event.id)
            events.append(r.event)
    return events


def charge_totals(events: Iterable[LedgerEvent]) -> dict[str, int]:
    """The sum of the events' charges, per counter key."""
    totals: dict[str, int] = defaultdict(int)
    for event in events:
        for charge in event.data.charges:
            totals[charge.key] += charge.amount
    return totals


async def assert_exact(backend: RedisBackend, records: TopicRecords) -> int:
    """Conservation: each counter = the sum of its ledger charges, nothing in flight.

    Returns how many distinct events the records hold."""
    events = unique_events(records)
    totals = charge_totals(events)
    assert totals, "the workload charged nothing"
    for key, total in totals.items():
        state = await backend.state(key)
        assert (key, state.committed, state.in_flight, state.pending) == (key, total, 0, {})
    return len(events)


async def wait_for(
    condition: Callable[[], object], what: str, workers: list[Worker], within: float
) -> None:
    """Until ``condition()`` holds (awaited when it gives an awaitable), else fail with
    the workers' logs."""
    deadline = time.monotonic() + within
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within}s\n{worker_logs(workers)}")
        await asyncio.sleep(0.1)


async def wait_epoch(
    backend: RedisBackend, workers: list[Worker], within: float = CATCH_UP
) -> None:
    """Until the counters' epoch marker is set: a rebuild sets it after its last
    apply, so a watermark at the end can be seen a moment before the marker is."""
    await wait_for(backend.has_epoch, "the epoch marker", workers, within)


@dataclass
class Stream:
    """One test's broker, Redis, fresh topic and group, started workers and temp dir,
    with the helpers above bound to them."""

    kafka: KafkaService
    redis_url: str
    backend: RedisBackend
    names: Names
    workers: list[Worker]
    tmp_path: Path
    engine: str = ENGINES[0]

    @property
    def topic(self) -> str:
        return self.names.topic

    def governor(
        self, rules: Policy | None = None
    ) -> contextlib.AbstractAsyncContextManager[Governor]:
        """A Governor whose ledger is the topic (see :func:`governor`)."""
        return governor(self.kafka, self.backend, self.topic, self.tmp_path, rules)

    def start_worker(self, *extra: str, env: Mapping[str, str] | None = None) -> Worker:
        """A worker with options ``extra`` (and variables ``env``, not settings: test hooks)."""
        return start_worker(
            self.workers,
            self.kafka,
            self.redis_url,
            self.names,
            self.tmp_path,
            "--engine",
            self.engine,
            *extra,
            env_extra=env,
        )

    async def start_worker_taking_all(self, *extra: str, within: float = 30.0) -> Worker:
        """A worker started (``extra`` as for :meth:`start_worker`), once it holds every
        partition (a dead member holds its own until its session times out)."""
        worker = self.start_worker(*extra)
        await self.wait_for(
            lambda: worker.assigned() == set(range(PARTITIONS)),
            f"worker {worker.name} takes every partition",
            within,
        )
        return worker

    async def caught_up(self, within: float = CATCH_UP) -> TopicRecords:
        """The topic's records, once every worker-projected watermark reached its end."""
        return await wait_caught_up(self.kafka, self.backend, self.topic, self.workers, within)

    async def wait_for(self, condition: Callable[[], object], what: str, within: float) -> None:
        await wait_for(condition, what, self.workers, within)


@pytest.fixture
def stream(
    kafka: KafkaService,
    redis_url: str,
    backend: RedisBackend,
    names: Names,
    workers: list[Worker],
    tmp_path: Path,
    engine: str,
) -> Stream:
    """The fixtures a worker test uses, in one (the test module imports them all)."""
    return Stream(kafka, redis_url, backend, names, workers, tmp_path, engine)
