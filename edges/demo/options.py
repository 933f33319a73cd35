"""What the demo is told (``mcpbg demo``'s options) and what it reports: below both
the run (runner) and its report (report), which each take them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mcp_budget_governor import Backend

from . import scenario

DEFAULT_OUT = Path("mcpbg-demo")


@dataclass
class DemoOptions:
    """How to run the demo; see ``mcpbg demo --help``."""

    out: Path = DEFAULT_OUT
    redis_url: str | None = None
    postgres_url: str | None = None
    kafka_url: str | None = None
    topic: str | None = None
    seed: int = 7
    seconds: int = scenario.SIMULATED_SECONDS
    #: then serve the console on the demo's own counters and ledger (``--serve``)
    serve: bool = False
    host: str = "127.0.0.1"
    port: int = 8900


@dataclass
class DemoResult:
    """What happened, for the report and for tests."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    calls: int = 0
    tripped_at: float | None = None
    spent: int = 0
    events: int = 0
    focus_file: Path | None = None
    report_file: Path | None = None
    #: the counters the demo charged, for ``mcpbg demo --serve``
    backend: Backend | None = None
