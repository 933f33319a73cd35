"""Every ``MCPBG_*`` setting, declared once: name, variable, type, default and help.

The ``mcpbg`` commands, the stream worker and the example server read their
settings through :data:`SETTINGS`, so a variable means the same everywhere and
each default is written here only (help texts are built from it).
:func:`resolve` reads a group of settings (a value given in code or on the
command line wins over the variable) and reports every bad one at once.

>>> SETTINGS["batch_size"].env, SETTINGS["batch_size"].default
('MCPBG_BATCH_SIZE', 500)
>>> resolve(["batch_size", "topic"], {"MCPBG_BATCH_SIZE": "64"})
{'batch_size': 64, 'topic': 'mcpbg.ledger'}
>>> resolve(["batch_size", "batch_wait"], {"MCPBG_BATCH_SIZE": "many", "MCPBG_BATCH_WAIT": "-1"})
Traceback (most recent call last):
...
mcp_budget_governor.errors.SettingsError: 2 bad settings: MCPBG_BATCH_SIZE: expected an \
integer (got 'many'); MCPBG_BATCH_WAIT: expected seconds > 0 (got -1.0)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInputError, SettingsError
from .ledger import DEFAULT_TOPIC
from .urls import check_http_url, check_postgres_url, check_redis_url, parse_bootstrap

__all__ = ["PREFIX", "SETTINGS", "Setting", "checked", "env_value", "resolve"]

#: Every variable's name is this prefix and the setting's name in capitals.
PREFIX = "MCPBG_"

#: The levels ``log_level`` accepts (any case).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: A check: raises :class:`InvalidInputError` for a bad value (its field is replaced).
Check = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: ``name`` (the option ``--name-with-dashes``, the variable
    ``MCPBG_<NAME>``), its type (``str``, ``int`` or ``float``), its default
    (None: none, the reader requires it or goes without) and what it does."""

    name: str
    kind: type
    default: Any
    help: str
    check: Check | None = None

    @property
    def env(self) -> str:
        """The environment variable, ``MCPBG_<NAME>``."""
        return PREFIX + self.name.upper()

    @property
    def option(self) -> str:
        """The command-line option, ``--name-with-dashes``."""
        return "--" + self.name.replace("_", "-")

    def describe(self, text: str | None = None) -> str:
        """Help for the option: ``text`` (else :attr:`help`), the default, the variable.

        >>> SETTINGS["batch_wait"].describe()
        'seconds to wait for records when none are fetched (default 0.2; env MCPBG_BATCH_WAIT)'
        """
        shown = f"{self.default:g}" if isinstance(self.default, float) else self.default
        default = "" if self.default in (None, "") else f"default {shown}; "
        return f"{text or self.help} ({default}env {self.env})"

    def convert(self, raw: str) -> Any:
        """A variable's text as this setting's type; the error names the variable."""
        try:
            return self.kind(raw)
        except ValueError:
            expected = "an integer" if self.kind is int else "a number"
            raise InvalidInputError(self.env, raw, f"expected {expected}") from None


# -- checks -------------------------------------------------------------------


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> None:
    if not _integer(value) or value < 1:
        raise InvalidInputError("", value, "expected a positive integer")


def _non_negative_int(value: Any) -> None:
    if not _integer(value) or value < 0:
        raise InvalidInputError("", value, "expected an integer >= 0")


def _port(value: Any) -> None:
    if not _integer(value) or not 0 <= value <= 65535:
        raise InvalidInputError("", value, "expected a port 1-65535 (0: off)")


def _positive_seconds(value: Any) -> None:
    if not _number(value) or not math.isfinite(value) or not value > 0:
        raise InvalidInputError("", value, "expected seconds > 0")


def _seconds(value: Any) -> None:
    if not _number(value) or not math.isfinite(value) or not value >= 0:
        raise InvalidInputError("", value, "expected seconds >= 0")


def _poll_seconds(value: Any) -> None:
    if not _number(value) or not math.isfinite(value) or not 0 <= value <= 86_400:
        raise InvalidInputError("", value, "expected seconds from 0 to 86400")


#: The stream engines ``mcpbg worker --engine`` runs (the first is the default).
ENGINES = ("aiokafka", "faust")


def _engine(value: Any) -> None:
    if value not in ENGINES:
        raise InvalidInputError("", value, f"one of {', '.join(ENGINES)}")


def _not_empty(value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError("", value, "must not be empty")


def _log_level(value: Any) -> None:
    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise InvalidInputError("", value, f"one of {', '.join(LOG_LEVELS)}")


def _kafka_url(value: Any) -> None:
    try:
        parse_bootstrap(value)
    except InvalidInputError as exc:
        raise InvalidInputError("", value, f"not a Kafka bootstrap: {exc.problem}") from None


def _webhook(value: Any) -> None:
    if value != "":  # empty: no webhook
        check_http_url(value)


def _flag(value: Any) -> None:
    if value not in (0, 1):
        raise InvalidInputError("", value, "expected 0 or 1")


def _webhook_secret(value: Any) -> None:
    if value != "" and len(value) < 16:  # empty: unsigned
        raise InvalidInputError("", "…", "expected at least 16 characters")


def _redis_url(value: Any) -> None:
    check_redis_url(value)  # names --redis-url; resolve names the setting instead


def _postgres_url(value: Any) -> None:
    if value != "":  # empty: none (the counters are in Redis)
        check_postgres_url(value)


# -- the table ------------------------------------------------------------------

#: Every ``MCPBG_*`` setting by name (the order ``mcpbg worker --help`` shows).
SETTINGS: Mapping[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "kafka_url", str, None, "Kafka bootstrap, kafka://host:port[,host:port]", _kafka_url
        ),
        Setting("redis_url", str, None, "the counters' Redis, redis://host:port/db", _redis_url),
        Setting(
            "postgres_url",
            str,
            "",
            "the counters in Postgres instead of Redis, postgresql://user@host:port/db",
            _postgres_url,
        ),
        Setting(
            "topic",
            str,
            DEFAULT_TOPIC,
            "the ledger topic; dead letters go to <topic>.dlq",
            _not_empty,
        ),
        Setting(
            "group", str, "mcpbg-projector", "consumer group shared by the workers", _not_empty
        ),
        Setting("batch_size", int, 500, "most records applied in one Redis call", _positive_int),
        Setting(
            "batch_wait",
            float,
            0.2,
            "seconds to wait for records when none are fetched",
            _positive_seconds,
        ),
        Setting(
            "fetch_max_wait_ms",
            int,
            50,
            "how long the broker may hold a fetch that has no data yet",
            _positive_int,
        ),
        Setting("session_timeout_ms", int, 10_000, "group session timeout", _positive_int),
        Setting(
            "heartbeat_interval_ms",
            int,
            3_000,
            "group heartbeat interval (below the session timeout)",
            _positive_int,
        ),
        Setting(
            "progress_interval",
            float,
            10.0,
            "seconds between progress log lines, 0 for none",
            _seconds,
        ),
        Setting("redis_timeout", float, 5.0, "seconds one Redis call may take", _positive_seconds),
        Setting(
            "check_timeout",
            float,
            0.25,  # RedisBackend's default: past it, a check's limits follow their fail modes
            "seconds a governed check may wait for its store before its fail modes apply",
            _positive_seconds,
        ),
        Setting(
            "caps_refresh",
            float,
            1.0,
            "Redis Cluster: seconds a process compares with a run-time cap or plan assignment "
            "as last read before it reads it again (0: before every check)",
            _seconds,
        ),
        Setting(
            "topic_wait", float, 60.0, "seconds to wait at start for the topic to exist", _seconds
        ),
        Setting("log_level", str, "info", "debug, info, warning, error or critical", _log_level),
        Setting(
            "policy",
            str,
            "",
            "the policy: a .toml file or package.module:attribute (the worker alerts on it)",
        ),
        Setting(
            "alert_webhook",
            str,
            "",
            "http(s) URL each alert is POSTed to (CloudEvent JSON)",
            _webhook,
        ),
        Setting(
            "alert_forecast",
            int,
            0,
            "1: also alert, once per period, a counter projected to reach its cap before "
            "its period ends (limits with alert_at levels)",
            _flag,
        ),
        Setting("user", str, "", "mcpbg proxy over stdio: the local user (else the login name)"),
        Setting(
            "alert_webhook_secret",
            str,
            "",
            "the key that signs each webhook (HMAC-SHA256, docs/alerts.md), 16 characters or more",
            _webhook_secret,
        ),
        Setting("alert_topic", str, "mcpbg.alerts", "Kafka topic for alerts, '' for none"),
        Setting(
            "alert_keep",
            int,
            1000,
            "alerts the worker keeps in Redis (a capped stream) for mcpbg serve's /v1/alerts, "
            "0 for none",
            _non_negative_int,
        ),
        Setting(
            "archive_dir",
            str,
            "",
            "the Parquet archive (the worker writes it before each batch applies)",
        ),
        Setting(
            "archive_segment_mb",
            int,
            64,
            "compact a partition's small archive segments of one day once they hold this many "
            "MB (docs/ledger-format.md, Compaction)",
            _positive_int,
        ),
        Setting(
            "archive_segment_age",
            float,
            3600.0,
            "...or once the oldest of them is this many seconds old: about one file per "
            "partition per hour",
            _positive_seconds,
        ),
        Setting("metrics_port", int, 0, "serve Prometheus metrics on this port, 0 for off", _port),
        Setting(
            "partitions",
            int,
            0,
            "create the ledger topic with this many partitions if missing, 0 to wait for it",
            _non_negative_int,
        ),
        Setting(
            "concurrency", int, 1, "partitions whose batches are applied at once", _positive_int
        ),
        Setting(
            "engine",
            str,
            ENGINES[0],
            "the stream engine: aiokafka (a plain consumer loop) or faust (a faust-streaming "
            "app; the faust extra)",
            _engine,
        ),
        Setting(
            "faust_take_within",
            float,
            0.05,
            "faust engine: seconds a partial batch waits to fill (stream.take_events within)",
            _positive_seconds,
        ),
        Setting("ledger_dir", str, None, "the embedded mode's file-ledger folder"),
        Setting("outbox_dir", str, "mcpbg-outbox", "the ledger's durable local outbox folder"),
        Setting(
            "read_token",
            str,
            "",
            "mcpbg serve: bearer token for its read routes (the write token reads too)",
        ),
        Setting("read_token_file", str, "", "mcpbg serve: a file holding the read token"),
        Setting(
            "write_token",
            str,
            "",
            "mcpbg serve: bearer token for its write routes (caps, grants, resets)",
        ),
        Setting("write_token_file", str, "", "mcpbg serve: a file holding the write token"),
        Setting("serve_host", str, "127.0.0.1", "mcpbg serve: the address to listen on"),
        Setting("serve_port", int, 8900, "mcpbg serve: the port to listen on", _port),
        Setting(
            "policy_poll",
            float,
            5.0,
            "seconds between looks at the policy file for a change, 0: only on SIGHUP",
            _poll_seconds,
        ),
    )
}


def _relations(values: Mapping[str, Any], labels: Mapping[str, str]) -> list[InvalidInputError]:
    """Rules between settings (each already valid on its own)."""
    errors = []
    beat, session = values.get("heartbeat_interval_ms"), values.get("session_timeout_ms")
    if beat is not None and session is not None and beat >= session:
        errors.append(
            InvalidInputError(
                labels["heartbeat_interval_ms"],
                beat,
                f"must be below session_timeout_ms ({session})",
            )
        )
    return errors


def checked(name: str, value: Any) -> Any:
    """``value`` if it passes setting ``name``'s check, else an error naming ``name``
    (for a value given in code, such as a backend's keyword).

    >>> checked("caps_refresh", 0.5)
    0.5
    >>> checked("caps_refresh", -1)
    Traceback (most recent call last):
    ...
    mcp_budget_governor.errors.InvalidInputError: caps_refresh: expected seconds >= 0 (got -1)
    """
    check = SETTINGS[name].check
    if check is not None:
        try:
            check(value)
        except InvalidInputError as exc:
            raise InvalidInputError(name, exc.value, exc.problem) from None
    return value


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable of setting ``name`` as text; unset or blank: None.

    >>> env_value("topic", {"MCPBG_TOPIC": " ledger "}), env_value("topic", {})
    ('ledger', None)
    """
    raw = (os.environ if environ is None else environ).get(SETTINGS[name].env, "")
    return raw.strip() or None


def resolve(
    names: Iterable[str],
    environ: Mapping[str, str] | None = None,
    given: Mapping[str, Any] | None = None,
    *,
    required: Iterable[str] = (),
    options: bool = True,
) -> dict[str, Any]:
    """The value of each setting in ``names``, checked; every bad one in one error.

    A value in ``given`` (not None: an option, an argument) wins, else the
    variable from ``environ`` (default ``os.environ``; blank counts as unset)
    converted to the setting's type, else the default. Raises
    :class:`~mcp_budget_governor.errors.SettingsError` naming each bad
    setting with its value: the variable when the value came from one, else
    the setting's name; a missing ``required`` one says how to give it
    (``options=False``: the reader has no command-line options).
    """
    given = given or {}
    needed = set(required)
    values: dict[str, Any] = {}
    labels: dict[str, str] = {}
    errors: list[InvalidInputError] = []
    for name in names:
        setting = SETTINGS[name]
        label = name
        if given.get(name) is not None:
            value = given[name]
        elif (raw := env_value(name, environ)) is not None:
            label = setting.env
            try:
                value = setting.convert(raw)
            except InvalidInputError as exc:
                errors.append(exc)
                continue
        elif setting.default is None and name in needed:
            how = f"give {setting.option} or set {setting.env}" if options else f"set {setting.env}"
            errors.append(InvalidInputError(name if options else setting.env, None, how))
            continue
        else:
            value = setting.default
        if setting.check is not None and value is not None:
            try:
                setting.check(value)
            except InvalidInputError as exc:
                errors.append(InvalidInputError(label, exc.value, exc.problem))
                continue
        values[name] = value
        labels[name] = label
    errors += _relations(values, labels)
    if errors:
        raise SettingsError(errors)
    return values
