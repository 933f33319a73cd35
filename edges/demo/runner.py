"""The demo run: a governed FastMCP server, agents bursting at it, the report.

:func:`run` builds the pieces for the chosen mode (embedded by default:
in-process counters, a :class:`FileLedger` folder and its in-process
:class:`FileProjector`; ``redis_url`` puts the counters in Redis,
``kafka_url`` the ledger on Kafka), drives the agents through a FastMCP
``Client`` over the in-memory transport on a simulated clock, narrating each
agent's reaction to a refusal as it happens; :mod:`.report` prints the rest
(the opening lines, the budgets table, a DuckDB cost summary over the ledger)
and writes the FOCUS file.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastmcp import Client, FastMCP
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

from mcp_budget_governor import Backend, Context, Governor, InvalidInputError, PriceTable
from mcp_budget_governor.ledger import Ledger
from mcp_budget_governor.money import format_dollars
from mcp_budget_governor.projections.counters.memory import MemoryBackend
from mcp_budget_governor.urls import redact as redact_url

from . import report, scenario
from .options import DEFAULT_OUT as DEFAULT_OUT
from .options import DemoOptions as DemoOptions
from .options import DemoResult as DemoResult
from .scenario import (
    AGENTS,
    FLAT_PRICES,
    MODEL,
    POLICY,
    SPEND_LIMITS,
    Agent,
    Refusal,
    SimClock,
)

#: Written into the output folder, so a later run knows it may replace it.
MARKER = ".mcpbg-demo"


@dataclass
class AgentState:
    """What one agent is doing: waiting out a retry hint, or stopped for the day."""

    owed: float = 0.0
    wait_until: float = 0.0
    stopped: str | None = None


# -- the governed server ------------------------------------------------------


def identify(context: Any) -> Context:
    """Who is calling: the demo's agents name their user and tenant in the request ``_meta``."""
    meta: dict[str, Any] = {}
    fctx = getattr(context, "fastmcp_context", None)
    request = getattr(fctx, "request_context", None) if fctx is not None else None
    if request is not None and isinstance(request.meta, dict):
        meta = request.meta
    user, tenant = meta.get("user"), meta.get("tenant")
    session = meta.get("session")
    return Context(
        user=user if isinstance(user, str) else None,
        tenant=tenant if isinstance(tenant, str) else None,
        session=session if isinstance(session, str) else None,
    )


def build_server(governor: Governor) -> FastMCP:
    """The demo's MCP server: three tools behind :class:`BudgetMiddleware`.

    ``search`` and ``fetch`` declare a fixed price per call in their ``meta``;
    ``summarise`` calls a model (simulated) whose token usage the ``cost``
    callback prices with the governor's price table.
    """
    from mcp_budget_governor.integrations.fastmcp import META_KEY, BudgetMiddleware

    server = FastMCP("mcpbg-demo")
    server.add_middleware(BudgetMiddleware(governor, identify=identify, cost=tool_cost(governor)))

    def price(tool: str) -> dict[str, Any]:
        return {META_KEY: {"cost": FLAT_PRICES[tool], "limit": list(SPEND_LIMITS)}}

    @server.tool(meta=price("search"))
    def search(query: str) -> str:
        """Search the web (simulated)."""
        return f"10 results for {query!r}"

    @server.tool(meta=price("fetch"))
    def fetch(url: str) -> str:
        """Fetch a page (simulated)."""
        return f"<html>{url}</html>"

    @server.tool
    def summarise(text_tokens: int, seed: int) -> dict[str, Any]:
        """Summarise a document with a model (simulated): returns the summary and token usage."""
        input_tokens, output_tokens = scenario.summary_tokens(text_tokens, seed)
        return {
            "summary": f"{output_tokens} tokens of summary",
            "usage": {
                "model": MODEL,
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
            },
        }

    return server


def tool_cost(governor: Governor) -> Any:
    """The ``cost`` callback: a model call's tokens metered on every spend limit at once.

    It meters through :meth:`Governor.meter_tokens` itself, so each ledger
    event carries the model, the token counts and the price-table version
    (the FOCUS file splits the cost into input and output token meters), and
    returns no charges for the middleware to add. A result without token
    usage returns None: the tool's ``meta`` price stands.
    """

    from mcp_budget_governor.integrations.flow import governed_context

    async def cost(context: Any, result: Any) -> dict[str, int] | None:
        usage = _usage_of(result)
        if usage is None:
            return None
        # The caller exactly as the middleware checked it (identified, with the tool).
        ctx = governed_context()
        # One event charging every spend limit: one cost, counted once by the ledger.
        await governor.meter_tokens(
            SPEND_LIMITS,
            str(usage["model"]),
            input_tokens=int(usage["input_tokens"]),
            output_tokens=int(usage["output_tokens"]),
            ctx=ctx,
        )
        return {}

    return cost


def _usage_of(result: Any) -> dict[str, Any] | None:
    structured = getattr(result, "structured_content", None)
    if isinstance(structured, dict):
        usage = structured.get("usage")
        if isinstance(usage, dict):
            return usage
    return None


# -- the run ------------------------------------------------------------------


def prepare_out(out: Path) -> None:
    """Make ``out`` a fresh folder; a previous demo's output (with the marker) is replaced.

    A folder that holds anything else is refused (exit code 2), never deleted.
    """
    if out.exists():
        if not out.is_dir():
            raise InvalidInputError("--out", str(out), "exists and is not a folder")
        if any(out.iterdir()):
            if not (out / MARKER).exists():
                raise InvalidInputError(
                    "--out", str(out), "is not empty and not a previous demo's output folder"
                )
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("output of `mcpbg demo`: replaced by the next run\n")


async def run(options: DemoOptions, console: Console) -> DemoResult:
    """Run the demo end to end and print its report; returns what happened."""
    out = options.out
    clock = SimClock(duration=options.seconds)
    backend = _backend(options, clock)
    # The services first: a wrong URL fails in one line before anything is written.
    await _reachable(options, backend)
    prepare_out(out)
    prices = PriceTable.builtin()
    topic = options.topic or f"mcpbg.demo.{uuid.uuid4().hex[:8]}"
    ledger = _ledger(options, out, topic)
    report.intro(console, options, out, topic, prices)
    result = DemoResult()
    async with Governor(POLICY, backend, ledger=ledger, prices=prices, clock=clock) as governor:
        projector = _projector(options, out, backend)
        await _simulate(governor, clock, options, console, result, projector)
        result.events = await _project(options, out, backend, ledger, topic, projector, console)
        await report.budgets(console, governor, result, clock.now)
    report.costs(console, options, out)
    result.focus_file = report.write_focus(console, options, out, clock.now)
    result.report_file = report.write_html(console, options, out)
    result.backend = backend
    report.closing(console, result, out, serving=options.serve)
    return result


def _backend(options: DemoOptions, clock: SimClock) -> Backend:
    if options.postgres_url:
        from mcp_budget_governor.projections.counters.postgres import PostgresBackend

        return PostgresBackend.from_url(options.postgres_url, timeout=5.0)
    if options.redis_url:
        from mcp_budget_governor.projections.counters.redis import RedisBackend

        return RedisBackend.from_url(options.redis_url, timeout=5.0)
    if options.serve:
        return KeptMemoryBackend(clock=clock)
    return MemoryBackend(clock=clock)


class KeptMemoryBackend(MemoryBackend):
    """The in-process counters ``--serve`` hands to the console. A closed
    :class:`MemoryBackend` forgets its counters, and the demo's governor closes its
    backend on the way out: this one keeps them, so the console's budgets and breaker
    cards show what the demo charged."""

    async def aclose(self) -> None:
        return None


async def _reachable(options: DemoOptions, backend: Backend) -> None:
    """Raise :class:`InvalidInputError` naming the option of a service that does not answer."""
    if options.postgres_url:
        from mcp_budget_governor.projections.counters.postgres import migrate

        try:  # one connection, not the pool (whose retries would log each attempt)
            await migrate(options.postgres_url, connect_timeout=5)
        except Exception as exc:  # any failure to answer means the URL is unusable here
            await backend.aclose()
            raise InvalidInputError(
                "--postgres", redact_url(options.postgres_url), f"no answer ({exc})"
            ) from None
    if options.redis_url:
        client: Any = getattr(backend, "client", None)
        try:
            await client.ping()
        except Exception as exc:  # any failure to answer means the URL is unusable here
            await backend.aclose()
            raise InvalidInputError(
                "--redis", redact_url(options.redis_url), f"no answer ({exc})"
            ) from None
    if options.kafka_url:
        from mcp_budget_governor.producers.kafka_ledger import parse_bootstrap

        try:
            bootstrap = parse_bootstrap(options.kafka_url)
        except InvalidInputError as exc:
            raise InvalidInputError("--kafka", redact_url(options.kafka_url), exc.problem) from None
        host, _, port = bootstrap.split(",")[0].rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5.0)
        except (OSError, ValueError, TimeoutError) as exc:
            raise InvalidInputError(
                "--kafka", redact_url(options.kafka_url), f"no answer ({exc})"
            ) from None
        writer.close()
        await writer.wait_closed()


def _ledger(options: DemoOptions, out: Path, topic: str) -> Ledger:
    if options.kafka_url:
        from mcp_budget_governor.producers.kafka_ledger import KafkaLedger

        return KafkaLedger.from_url(options.kafka_url, topic=topic, outbox_dir=out / "outbox")
    from mcp_budget_governor.producers.file_ledger import FileLedger

    # The demo writes thousands of events in seconds: fsync once at the end.
    return FileLedger(out / "ledger", source="/mcpbg/demo", fsync="never")


def _projector(options: DemoOptions, out: Path, backend: Backend) -> Any:
    if options.kafka_url:
        return None  # projected from the topic after the run (see _project)
    from mcp_budget_governor.producers.file_ledger import FileProjector

    return FileProjector(out / "ledger", backend)


@contextlib.asynccontextmanager
async def _clients(server: FastMCP) -> AsyncIterator[dict[str, Client[Any]]]:
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, Client[Any]] = {}
        for agent in AGENTS:
            clients[agent.user] = await stack.enter_async_context(Client(server))
        yield clients


async def _simulate(
    governor: Governor,
    clock: SimClock,
    options: DemoOptions,
    console: Console,
    result: DemoResult,
    projector: Any,
) -> None:
    rng = random.Random(options.seed)
    states = {agent.user: AgentState() for agent in AGENTS}
    told: set[tuple[str, str]] = set()
    server = build_server(governor)
    progress = Progress(
        TextColumn("[bold]simulated {task.fields[clock]}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[stats]}"),
        console=console,
        transient=False,
    )

    def say(text: str) -> None:
        progress.console.print(f"  [dim]{scenario.clock_label(clock.elapsed)}[/dim]  {text}")

    async with _clients(server) as clients:
        with progress:
            task = progress.add_task("burst", total=options.seconds, clock="00:00", stats="")
            for second in range(options.seconds):
                clock.advance_to(second)
                for agent in AGENTS:
                    state = states[agent.user]
                    state.owed += agent.rate
                    while state.owed >= 1:
                        state.owed -= 1
                        if state.stopped or clock.now < state.wait_until:
                            continue  # a polite agent waiting or stopped makes no call
                        refusal = await _call(clients[agent.user], agent, rng, result)
                        if refusal is not None:
                            _react(agent, state, refusal, clock, told, say, result)
                if projector is not None and second % 30 == 29:
                    await projector.catch_up()
                admitted = sum(n for (_, what), n in result.outcomes.items() if what == "admitted")
                spent = result.spent = await governor.usage("global_spend")
                progress.update(
                    task,
                    advance=1,
                    clock=scenario.clock_label(second + 1),
                    stats=f"{result.calls:,} calls, {admitted:,} admitted, "
                    f"{result.calls - admitted:,} refused, {format_dollars(spent)} spent",
                )


async def _call(
    client: Client[Any], agent: Agent, rng: random.Random, result: DemoResult
) -> Refusal | None:
    tool = rng.choice(agent.tools)
    args = scenario.arguments(agent, tool, rng)
    meta = {"user": agent.user, "tenant": agent.tenant, "session": f"{agent.user}-1"}
    reply = await client.call_tool(tool, args, meta=meta, raise_on_error=False)
    result.calls += 1
    if not reply.is_error:
        result.outcomes[(agent.user, "admitted")] += 1
        return None
    text = " ".join(getattr(block, "text", "") for block in reply.content)
    refusal = scenario.read_refusal(text)
    if refusal is None:
        raise RuntimeError(f"{tool} failed for {agent.user}: {text}")
    result.outcomes[(agent.user, refusal.reason)] += 1
    return refusal


def _react(
    agent: Agent,
    state: AgentState,
    refusal: Refusal,
    clock: SimClock,
    told: set[tuple[str, str]],
    say: Any,
    result: DemoResult,
) -> None:
    breaker = refusal.reason.startswith("budget_exceeded:global")
    if breaker and result.tripped_at is None:
        result.tripped_at = clock.elapsed
        say(
            "[bold red]global breaker tripped[/]: today's spend reached "
            f"{format_dollars(POLICY['global_spend'].cap)}; every caller is now shed (503)"
        )
    first = (agent.user, refusal.reason) not in told
    told.add((agent.user, refusal.reason))
    hint = f", retry in {refusal.retry_after:,} s" if refusal.retry_after is not None else ""
    if agent.polite:
        if refusal.retry_after is not None and not breaker and refusal.status != 402:
            state.wait_until = clock.now + refusal.retry_after
            action = f"waits {refusal.retry_after} s"
        else:
            state.stopped = refusal.reason
            action = "stops for today"
        if first:
            say(f"{agent.user}: refused {_status(refusal)} {refusal.reason}{hint} -> {action}")
    elif first:
        say(
            f"{agent.user}: refused {_status(refusal)} {refusal.reason}{hint} "
            "-> ignores it and keeps calling (refusals charge nothing)"
        )


def _status(refusal: Refusal) -> str:
    return "" if refusal.status is None else str(refusal.status)


async def _project(
    options: DemoOptions,
    out: Path,
    backend: Backend,
    ledger: Ledger,
    topic: str,
    projector: Any,
    console: Console,
) -> int:
    """Bring the projection up to date; returns how many ledger events it holds."""
    if projector is not None:
        await projector.catch_up()
        count = sum(1 for _ in projector.log.read(None))
        how = "(in process, FileProjector)"
        applied = projector.applied
    else:
        count, applied = await _project_topic(options, out, backend, ledger, topic)
        how = f"(read back from Kafka topic {topic}, archived as Parquet in {out / 'archive'})"
    left = await _in_flight(backend)
    state = "nothing left in flight" if left == 0 else f"{left:,} still in flight"
    console.print(
        f"\nProjection: {applied:,} of {count:,} ledger events applied to the counters {how}; "
        f"{state}."
    )
    return count


async def _in_flight(backend: Backend) -> int:
    """What the counters still hold in flight: 0 once the projection has caught up."""
    keys = await backend.counter_keys(100_000)
    return sum([(await backend.state(key)).in_flight for key in keys])


async def _project_topic(
    options: DemoOptions, out: Path, backend: Backend, ledger: Ledger, topic: str
) -> tuple[int, int]:
    """Read the whole topic back, archive it and apply it: (events read, applied)."""
    from mcp_budget_governor.producers.kafka_ledger import KafkaLedger, parse_bootstrap
    from mcp_budget_governor.stream.archiver import Archiver
    from mcp_budget_governor.stream.projector import to_applied
    from mcp_budget_governor.stream.topic_reader import read_topic

    assert isinstance(ledger, KafkaLedger)
    if not await ledger.flush(30.0):
        raise RuntimeError("Kafka did not acknowledge every ledger event within 30 s")
    records = await read_topic(parse_bootstrap(options.kafka_url or ""), topic)
    if not records.caught_up:
        raise RuntimeError(f"could not read Kafka topic {topic} to its end")
    archiver = Archiver(out / "archive", topic=topic)
    by_partition: dict[int, list[Any]] = {}
    for record in records:
        by_partition.setdefault(record.partition, []).append(record)
    applied = 0
    for partition, items in sorted(by_partition.items()):
        items.sort(key=lambda r: r.offset)
        # Archived before it is applied, as the stream worker does.
        archiver.write_batch(partition, [(r.offset, r.event) for r in items])
        applied += await backend.apply(
            f"{topic}:{partition}", [to_applied(r.event, r.offset) for r in items]
        )
    return len(records), applied


def main_sync(options: DemoOptions, console: Console) -> DemoResult:
    """Run :func:`run` in a fresh event loop (then :func:`serve`, with ``options.serve``)."""

    async def main() -> DemoResult:
        result = await run(options, console)
        if options.serve:
            await serve(options, result)
        return result

    return asyncio.run(main())


async def serve(options: DemoOptions, result: DemoResult) -> None:
    """The console (``mcpbg serve``) on the demo's own data, its counters, ledger and
    policy, behind fresh random tokens; prints a one-time login link."""
    import secrets

    from mcp_budget_governor.console.api import Console as AdminConsole
    from mcp_budget_governor.console.api import serve_console
    from mcp_budget_governor.console.auth import Tokens

    backend = result.backend
    if backend is None or options.redis_url or options.postgres_url:
        backend = _backend(options, SimClock())  # the demo closed its client with it
    archived = options.kafka_url is not None
    admin = AdminConsole(
        POLICY,
        backend,
        Tokens(secrets.token_hex(16), secrets.token_hex(16)),
        archive_dir=str(options.out / "archive") if archived else None,
        ledger_dir=None if archived else str(options.out / "ledger"),
        governor=Governor(POLICY, backend),
    )
    try:
        await serve_console(admin, options.host, options.port, name="demo")
    finally:
        await backend.aclose()
