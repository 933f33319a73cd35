"""The one table of ``MCPBG_*`` settings: every reader uses it, every bad setting is named.

No services: these build configurations, parsers and the example server's
settings, and read the CLI's answers.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from mcp_budget_governor import InvalidInputError
from mcp_budget_governor.cli import ledger_args, main
from mcp_budget_governor.cli import worker as worker_cli
from mcp_budget_governor.errors import SettingsError
from mcp_budget_governor.ledger import DEFAULT_TOPIC
from mcp_budget_governor.settings import PREFIX, SETTINGS, resolve
from mcp_budget_governor.stream import config as worker_config

ROOT = Path(__file__).resolve().parent.parent
#: The folders of the package and the example server, whose code reads settings.
SOURCES = ["mcp_budget_governor", "producers", "stream", "projections", "examples"]
WorkerConfig = worker_config.WorkerConfig
BASE = {"MCPBG_KAFKA_URL": "kafka://k:9092", "MCPBG_REDIS_URL": "redis://r:6379/0"}


def load_example_server() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_server", ROOT / "examples/server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- every bad setting at once ---------------------------------------------------


def test_every_bad_setting_is_reported_at_once_with_its_variable_and_value() -> None:
    env = {
        "MCPBG_KAFKA_URL": "http://k:9092",
        "MCPBG_REDIS_URL": "redis://r:6379/0",
        "MCPBG_BATCH_SIZE": "many",
        "MCPBG_BATCH_WAIT": "-1",
        "MCPBG_LOG_LEVEL": "chatty",
        "MCPBG_TOPIC": "ledger",  # a good one is not named
    }
    with pytest.raises(SettingsError) as raised:
        WorkerConfig.from_env(env, concurrency=0)
    error = raised.value
    assert isinstance(error, InvalidInputError)  # what every caller already catches
    named = {(e.field, e.value) for e in error.errors}
    assert named == {
        ("MCPBG_KAFKA_URL", "http://k:9092"),
        ("MCPBG_BATCH_SIZE", "many"),
        ("MCPBG_BATCH_WAIT", -1.0),
        ("MCPBG_LOG_LEVEL", "chatty"),
        ("concurrency", 0),
    }
    text = str(error)
    assert text.startswith("5 bad settings: ") and "\n" not in text
    for field, value in named:
        assert f"{field}: " in text and repr(value) in text, (field, text)
    assert "MCPBG_TOPIC" not in text


def test_missing_and_related_settings_are_reported_together() -> None:
    with pytest.raises(SettingsError) as raised:
        resolve(
            ["kafka_url", "redis_url", "heartbeat_interval_ms", "session_timeout_ms"],
            {"MCPBG_HEARTBEAT_INTERVAL_MS": "9000", "MCPBG_SESSION_TIMEOUT_MS": "6000"},
            required=("kafka_url", "redis_url"),
        )
    fields = [e.field for e in raised.value.errors]
    assert fields == ["kafka_url", "redis_url", "MCPBG_HEARTBEAT_INTERVAL_MS"]
    assert "give --kafka-url or set MCPBG_KAFKA_URL" in str(raised.value)
    assert "must be below session_timeout_ms (6000)" in str(raised.value)


def test_a_redis_url_with_a_password_is_named_redacted() -> None:
    with pytest.raises(SettingsError) as raised:
        resolve(["redis_url"], {"MCPBG_REDIS_URL": "redis://:s3cret@r:99999/0"})
    assert "s3cret" not in str(raised.value) and "MCPBG_REDIS_URL" in str(raised.value)


def test_the_cli_worker_names_every_bad_setting_on_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mcp_budget_governor.stream.worker", reason="needs the stream extra")
    for name in worker_config.ENV.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MCPBG_REDIS_URL", "http://r:6379/0")
    monkeypatch.setenv("MCPBG_FETCH_MAX_WAIT_MS", "soon")
    assert main(["worker", "--batch-size", "0", "--partitions", "-2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("mcpbg worker: 5 bad settings: ")
    for name in (
        "kafka_url",
        "MCPBG_REDIS_URL",
        "MCPBG_FETCH_MAX_WAIT_MS",
        "batch_size",
        "partitions",
    ):
        assert name in err, (name, err)


def test_the_example_server_names_every_bad_setting_and_exits() -> None:
    server = load_example_server()
    with pytest.raises(SystemExit) as raised:
        server.build({"MCPBG_REDIS_URL": "ftp://r/0"})
    message = str(raised.value.code)
    assert message.startswith("examples/server.py: 2 bad settings: ")
    assert "MCPBG_REDIS_URL" in message and "'ftp://r/0'" in message
    assert "MCPBG_KAFKA_URL: set MCPBG_KAFKA_URL" in message


# -- each reader reads the table -------------------------------------------------


def test_the_worker_config_is_the_tables_declarations() -> None:
    from dataclasses import MISSING, fields

    declared = [f for f in fields(WorkerConfig) if f.init]
    assert tuple(f.name for f in declared) == worker_config.NAMES
    for f in declared:
        setting = SETTINGS[f.name]
        # A setting without a default is required, unless its field may be None
        # (redis_url: not needed when the counters are in Postgres).
        optional = f.type == f"{setting.kind.__name__} | None"
        assert f.type == setting.kind.__name__ or optional, f.name
        expected = (None if optional else MISSING) if setting.default is None else setting.default
        assert f.default == expected, f.name
    assert {n: f"{PREFIX}{n.upper()}" for n in worker_config.NAMES} == worker_config.ENV
    assert WorkerConfig("k:9092", "redis://r:6379/0").topic == DEFAULT_TOPIC


def test_the_cli_worker_options_and_their_help_come_from_the_table() -> None:
    assert worker_cli.OPTIONS == worker_config.NAMES
    sub = argparse.ArgumentParser().add_subparsers()
    worker_cli.register(sub)
    parser = sub.choices["worker"]
    actions = {a.dest: a for a in parser._actions if a.dest in SETTINGS}
    assert set(actions) == set(worker_config.NAMES)
    for name, action in actions.items():
        setting = SETTINGS[name]
        # The setting's option first; --postgres is the short form of --postgres-url.
        assert action.option_strings[:1] == [setting.option]
        assert action.option_strings[1:] == (["--postgres"] if name == "postgres_url" else [])
        assert action.type is setting.kind and action.default is None  # None: not given
        assert action.help == setting.describe()
        assert setting.env in setting.describe()
    assert "default 500;" in SETTINGS["batch_size"].describe()  # the default, written once


def test_the_other_commands_read_the_tables_variables_and_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(topic=None, archive_dir=None, ledger_dir=None)
    for name in ("topic", "archive_dir", "ledger_dir"):
        monkeypatch.delenv(SETTINGS[name].env, raising=False)
    assert ledger_args.setting(args, "topic") == SETTINGS["topic"].default == DEFAULT_TOPIC
    assert ledger_args.setting(args, "archive_dir") is None  # no default: not given
    monkeypatch.setenv(SETTINGS["ledger_dir"].env, " /srv/ledger ")
    assert ledger_args.setting(args, "ledger_dir") == "/srv/ledger"
    parser = argparse.ArgumentParser()
    ledger_args.add_ledger_options(parser)
    ledger_args.add_redis_option(parser)
    helps = {a.dest: a.help or "" for a in parser._actions}
    for name in ("archive_dir", "ledger_dir", "redis_url"):
        assert helps[name].endswith(f"env {SETTINGS[name].env})"), helps[name]
    monkeypatch.delenv("MCPBG_REDIS_URL", raising=False)
    with pytest.raises(InvalidInputError, match=r"--redis-url: required: .* MCPBG_REDIS_URL"):
        ledger_args.required(argparse.Namespace(redis_url=None), "redis_url", "the Redis")


def test_the_example_server_reads_the_table() -> None:
    server = load_example_server()
    assert tuple(SETTINGS[name].env for name in server.SETTINGS) == server.ENV


def _code_strings(path: Path) -> list[str]:
    """The string literals of a module's code, docstrings left out."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            docstrings.add(id(body[0].value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_no_module_but_the_table_spells_a_variable() -> None:
    """Outside ``settings.py`` a variable's name comes from the table, never a literal."""
    table = ROOT / "mcp_budget_governor" / "settings.py"
    variable = re.compile(r"MCPBG_[A-Z]")
    spelled = {
        f"{path.relative_to(ROOT)}: {text!r}"
        for folder in SOURCES
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != table
        for text in _code_strings(path)
        if variable.search(text)
    }
    assert not spelled, spelled
    # And every variable the docs of those modules name is one of the table's.
    known = {s.env for s in SETTINGS.values()}
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            named = set(re.findall(r"MCPBG_[A-Z][A-Z_]*[A-Z]", path.read_text()))
            assert named <= known, (path, named - known)


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("MCPBG_ALERT_WEBHOOK", "ftp://hooks.example/"),
        ("MCPBG_ALERT_WEBHOOK", "http://hooks.example:99999/"),
        ("MCPBG_BATCH_WAIT", "inf"),
        ("MCPBG_TOPIC_WAIT", "nan"),
        ("MCPBG_METRICS_PORT", "70000"),
        ("MCPBG_CAPS_REFRESH", "-1"),
        ("MCPBG_CAPS_REFRESH", "inf"),
    ],
)
def test_values_the_worker_would_fail_on_later_are_named_at_the_start(
    variable: str, raw: str
) -> None:
    with pytest.raises(SettingsError, match=f"^{variable}: "):
        WorkerConfig.from_env({**BASE, variable: raw})


def test_the_webhook_sink_and_the_table_share_one_url_check() -> None:
    sinks = pytest.importorskip("mcp_budget_governor.stream.alerts.sinks")
    pytest.importorskip("aiohttp")
    for url in ("ftp://hooks.example/", "http://hooks.example:99999/", "http://"):
        with pytest.raises(InvalidInputError, match="expected an http:// or https:// URL"):
            sinks.WebhookSink(url)
    assert WorkerConfig.from_env(BASE).alert_webhook == ""  # empty: no webhook, not an error
