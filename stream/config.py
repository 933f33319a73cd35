"""What a stream worker needs, read from the settings table (``mcp_budget_governor.settings``).

Each field of :class:`WorkerConfig` is a setting of the table: its default,
its ``MCPBG_*`` variable, its check and its ``mcpbg worker`` option come from
there. Only the core is imported, so ``mcpbg --help`` can list the options
without the stream extra.

>>> config = WorkerConfig.from_env({"MCPBG_KAFKA_URL": "k:9092", "MCPBG_BATCH_SIZE": "64"},
...                                redis_url="redis://r:6379/0")
>>> config.bootstrap, config.batch_size, config.group
('k:9092', 64, 'mcpbg-projector')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mcp_budget_governor.settings import SETTINGS, env_value, resolve
from mcp_budget_governor.urls import parse_bootstrap

__all__ = ["ENV", "NAMES", "WorkerConfig"]


def _default(name: str) -> Any:
    return SETTINGS[name].default


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A worker's settings (the table's help says what each does); checked on creation,
    every bad one named at once. :meth:`from_env` reads the ``MCPBG_*`` variables."""

    kafka_url: str
    redis_url: str | None = None
    postgres_url: str = _default("postgres_url")
    topic: str = _default("topic")
    group: str = _default("group")
    batch_size: int = _default("batch_size")
    batch_wait: float = _default("batch_wait")
    fetch_max_wait_ms: int = _default("fetch_max_wait_ms")
    session_timeout_ms: int = _default("session_timeout_ms")
    heartbeat_interval_ms: int = _default("heartbeat_interval_ms")
    progress_interval: float = _default("progress_interval")
    redis_timeout: float = _default("redis_timeout")
    caps_refresh: float = _default("caps_refresh")
    topic_wait: float = _default("topic_wait")
    log_level: str = _default("log_level")
    policy: str = _default("policy")
    policy_poll: float = _default("policy_poll")
    alert_webhook: str = _default("alert_webhook")
    alert_webhook_secret: str = _default("alert_webhook_secret")
    alert_forecast: int = _default("alert_forecast")
    alert_topic: str = _default("alert_topic")
    alert_keep: int = _default("alert_keep")
    archive_dir: str = _default("archive_dir")
    archive_segment_mb: int = _default("archive_segment_mb")
    archive_segment_age: float = _default("archive_segment_age")
    metrics_port: int = _default("metrics_port")
    partitions: int = _default("partitions")
    concurrency: int = _default("concurrency")
    engine: str = _default("engine")
    faust_take_within: float = _default("faust_take_within")
    bootstrap: str = field(init=False, default="")

    def __post_init__(self) -> None:
        given = {name: getattr(self, name) for name in NAMES}
        resolve(NAMES, {}, given, required=_required(given, {}))
        object.__setattr__(self, "bootstrap", parse_bootstrap(self.kafka_url))

    @property
    def dlq_topic(self) -> str:
        """Where dead letters go: ``<topic>.dlq``."""
        from .projector import dead_letter_topic

        return dead_letter_topic(self.topic)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> WorkerConfig:
        """Settings from ``MCPBG_*`` variables, then ``overrides`` (not None) on top."""
        values = resolve(NAMES, environ, overrides, required=_required(overrides, environ))
        return cls(**values)


def _required(given: Mapping[str, Any], environ: Mapping[str, str] | None) -> tuple[str, ...]:
    """Kafka always; Redis unless the counters are in Postgres (``postgres_url``)."""
    postgres = given.get("postgres_url") or env_value("postgres_url", environ)
    return ("kafka_url",) if postgres else ("kafka_url", "redis_url")


#: The worker's settings, in the order ``mcpbg worker --help`` lists them.
NAMES: tuple[str, ...] = tuple(f.name for f in fields(WorkerConfig) if f.init)

#: The environment variable of each setting (an option of ``mcpbg worker`` wins over it).
ENV: Mapping[str, str] = {name: SETTINGS[name].env for name in NAMES}
