"""``mcpbg worker`` settings: options over ``MCPBG_*`` variables, bad values named.

No services: these only build configurations and read the CLI's answers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp_budget_governor import GovernorError, InvalidInputError
from mcp_budget_governor.cli import main

worker = pytest.importorskip("mcp_budget_governor.stream.worker", reason="needs the stream extra")
WorkerConfig = worker.WorkerConfig

BASE = {"MCPBG_KAFKA_URL": "kafka://k1:9092,k2:9092", "MCPBG_REDIS_URL": "redis://r:6379/0"}


def test_environment_then_options() -> None:
    env = {
        **BASE,
        "MCPBG_TOPIC": "ledger",
        "MCPBG_BATCH_SIZE": "64",
        "MCPBG_BATCH_WAIT": "0.5",
        "MCPBG_FETCH_MAX_WAIT_MS": "20",
    }
    config = WorkerConfig.from_env(env, batch_size=128, group=None)
    assert config.bootstrap == "k1:9092,k2:9092"
    assert (config.topic, config.batch_size, config.batch_wait) == ("ledger", 128, 0.5)
    assert config.fetch_max_wait_ms == 20
    assert WorkerConfig.from_env(BASE).fetch_max_wait_ms == 50  # the default
    assert config.group == "mcpbg-projector"  # None means "not given": the default stays
    assert config.dlq_topic == "ledger.dlq"
    assert set(worker.ENV.values()) >= {
        "MCPBG_KAFKA_URL",
        "MCPBG_REDIS_URL",
        "MCPBG_TOPIC",
        "MCPBG_GROUP",
        "MCPBG_BATCH_SIZE",
    }


@pytest.mark.parametrize(
    ("env", "options", "field"),
    [
        ({}, {}, "kafka_url"),
        ({"MCPBG_KAFKA_URL": "k:9092"}, {}, "redis_url"),
        (BASE, {"kafka_url": "http://k:9092"}, "bootstrap"),
        (BASE, {"redis_url": "r:6379"}, "redis_url"),
        (BASE, {"batch_size": 0}, "batch_size"),
        (BASE, {"batch_wait": 0.0}, "batch_wait"),
        (BASE, {"fetch_max_wait_ms": 0}, "fetch_max_wait_ms"),
        (BASE, {"topic": ""}, "topic"),
        (BASE, {"heartbeat_interval_ms": 6000, "session_timeout_ms": 6000}, "heartbeat"),
        (BASE, {"progress_interval": -1.0}, "progress_interval"),
        (BASE, {"log_level": "chatty"}, "log_level"),
        ({**BASE, "MCPBG_BATCH_SIZE": "many"}, {}, "MCPBG_BATCH_SIZE"),
    ],
)
def test_bad_settings_name_the_field(
    env: dict[str, str], options: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        WorkerConfig.from_env(env, **options)


def test_cli_worker_reports_bad_input_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in worker.ENV.values():
        monkeypatch.delenv(name, raising=False)
    assert main(["worker", "--redis-url", "redis://r:6379/0"]) == 2
    assert "MCPBG_KAFKA_URL" in capsys.readouterr().err
    monkeypatch.setenv("MCPBG_KAFKA_URL", "k:9092")
    monkeypatch.setenv("MCPBG_REDIS_URL", "redis://r:6379/0")
    assert main(["worker", "--batch-size", "0"]) == 2
    assert "batch_size" in capsys.readouterr().err
    # The schema command is untouched by the worker's optional dependencies.
    assert main(["schema", "--type", "mcpbg.metered.v1"]) == 0


def test_the_worker_reads_a_policy_file_and_names_a_bad_one(tmp_path: Path) -> None:
    """MCPBG_POLICY is a TOML file (or module:attribute), through the one policy loader."""
    from mcp_budget_governor import Policy

    ProjectionWorker = worker.ProjectionWorker

    example = Path(__file__).parent.parent / "examples" / "policy.toml"
    projection = ProjectionWorker(
        WorkerConfig("kafka://127.0.0.1:9", "redis://127.0.0.1:9/0", policy=str(example))
    )
    assert projection._policy == Policy.from_file(example)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[limits]]\nname = "x"\ncap = 5\nwindow = "fortnight"\n')
    with pytest.raises(GovernorError, match=r"bad.toml:4: limits\[0\].window"):
        ProjectionWorker(
            WorkerConfig("kafka://127.0.0.1:9", "redis://127.0.0.1:9/0", policy=str(bad))
        )


@pytest.mark.parametrize(
    ("option", "value"),
    [("partitions", -1), ("partitions", True), ("concurrency", 0), ("concurrency", 2.0)],
)
def test_partitions_and_concurrency_are_checked(option: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=option):
        WorkerConfig("kafka://127.0.0.1:9", "redis://127.0.0.1:9/0", **{option: value})


def test_partitions_and_concurrency_come_from_the_environment() -> None:
    env = {**BASE, "MCPBG_PARTITIONS": "6", "MCPBG_CONCURRENCY": "3"}
    config = WorkerConfig.from_env(env)
    assert (config.partitions, config.concurrency) == (6, 3)
