"""The faust engine is an optional extra: the rest installs and works without it.

- The other extras resolve without faust-streaming (pip's resolver, dry run).
- With ``faust`` unimportable, the default engine projects exactly, and
  ``mcpbg worker --engine faust`` says which extra to install (exit 2, no traceback).
- The engine is a setting of the table: a bad one is named with its variable.
- ``attach`` mounts the projection agent in an existing faust app.

The exactly-once suite runs on both engines: ``both_engines`` in
tests/test_stream_worker.py, test_stream_rebuild.py and test_stream_soak.py.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mcp_budget_governor.errors import SettingsError
from mcp_budget_governor.stream.config import WorkerConfig
from testing.services import tansu_binary
from testing.stream_support import (
    CLI,
    Stream,
    assert_exact,
    backend,
    engine,
    kafka,
    names,
    stream,
    workers,
    workload,
)

pytest.importorskip("mcp_budget_governor.stream.worker", reason="the worker needs the stream extra")

__all__ = ["backend", "engine", "kafka", "names", "stream", "workers"]  # fixtures, used by name

ROOT = Path(__file__).resolve().parent.parent
needs_faust = pytest.mark.skipif(
    importlib.util.find_spec("faust") is None, reason="the faust engine needs the faust extra"
)


def block_faust(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Child processes cannot import faust (a module of that name that refuses)."""
    blocked = tmp_path / "no-faust"
    (blocked / "faust").mkdir(parents=True)
    (blocked / "faust" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'faust' (blocked by the test)\")\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(blocked))


def test_the_engine_is_a_checked_setting() -> None:
    assert WorkerConfig("kafka://k:9092", "redis://r:6379/0").engine == "aiokafka"
    config = WorkerConfig.from_env({"MCPBG_ENGINE": "faust"}, kafka_url="k:9092",
                                   redis_url="redis://r:6379/0")  # fmt: skip
    assert config.engine == "faust"
    with pytest.raises(
        SettingsError, match=r"MCPBG_ENGINE: one of aiokafka, faust \(got 'flink'\)"
    ):
        WorkerConfig.from_env({"MCPBG_ENGINE": "flink"}, kafka_url="k:9092",
                              redis_url="redis://r:6379/0")  # fmt: skip


def test_without_faust_the_faust_engine_names_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block_faust(tmp_path, monkeypatch)
    run = subprocess.run(
        [*CLI, "worker", "--engine", "faust", "--kafka-url", "kafka://127.0.0.1:9",
         "--redis-url", "redis://127.0.0.1:9/0"],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "install the faust extra: pip install 'mcpbg[faust]'" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.skipif(tansu_binary() is None, reason="no local Kafka-protocol broker (tansu)")
async def test_without_faust_the_default_engine_projects_exactly(
    stream: Stream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block_faust(tmp_path, monkeypatch)
    async with stream.governor() as gov:
        await workload(gov, 300, random.Random(11))
    worker = stream.start_worker()
    records = await stream.caught_up()
    assert await assert_exact(stream.backend, records) == len(records)
    assert worker.terminate() == 0, worker.tail()
    assert "faust" not in worker.text().lower()


@pytest.mark.slow
def test_the_other_extras_resolve_without_faust(tmp_path: Path) -> None:
    """pip's resolver, as on a fresh machine (``--ignore-installed``), installs nothing of
    faust's for every extra but ``faust`` and ``dev``. (``dev`` holds faust-streaming too:
    the suite's own venv proves the two fit, with faust's click<8.4.)"""
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
         "--report", str(report), ".[stream,redis,kafka,duckdb,demo,fastmcp]"],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=600,
    )  # fmt: skip
    if run.returncode != 0 and "Could not find a version" in run.stderr + run.stdout:
        pytest.skip(f"no package index reachable: {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert {"aiokafka", "redis", "duckdb", "fastmcp"} <= names, names
    assert not {"faust-streaming", "mode-streaming", "venusian"} & names, names


@needs_faust
async def test_attach_mounts_the_projection_in_an_existing_faust_app() -> None:
    import faust

    from mcp_budget_governor.stream.faust_app import FaustProjection, attach, tuned_transport

    app = faust.App("their-app", broker="kafka://127.0.0.1:9", web_enabled=False)

    @app.agent(app.topic("their-topic"))
    async def theirs(stream: faust.StreamT[bytes]) -> None:  # an agent of their own
        async for _ in stream:
            pass

    config = WorkerConfig("kafka://127.0.0.1:9", "redis://127.0.0.1:9/0", topic="t.ledger",
                          group="g", fetch_max_wait_ms=40)  # fmt: skip
    projection = attach(app, config)
    assert isinstance(projection, FaustProjection)
    topics = {agent.name: agent.channel.get_topic_name() for agent in app.agents.values()}
    assert topics["g.projector"] == "t.ledger"
    assert len(topics) == 2
    # The aiokafka consumer faust's consumer thread creates carries the worker's fetch wait.
    thread = app.consumer._thread  # type: ignore[attr-defined]
    assert thread._create_worker_consumer(app.transport)._fetch_max_wait_ms == 40
    assert not isinstance(app.transport, tuned_transport(40))  # a class per call
