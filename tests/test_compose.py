"""docker-compose.yml holds together without a Docker engine: its structure is checked here.

Services, images, ports, health checks and depends_on conditions are read
from the YAML; every command must name a real entry point (an ``mcpbg``
subcommand the parser knows, or the example server file, which must import),
and every ``MCPBG_*`` variable must be one the program it configures reads.
"""

from __future__ import annotations

import base64
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from mcp_budget_governor import Policy, cli
from mcp_budget_governor.cli import worker as worker_cli
from mcp_budget_governor.stream.worker import WorkerConfig
from mcp_budget_governor.stream.worker import load_policy as worker_load_policy

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def load_example_server() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_server", ROOT / "examples/server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_services_with_official_images(compose: dict[str, Any]) -> None:
    svc = services(compose)
    assert set(svc) == {"kafka", "redis", "worker", "server", "prometheus", "grafana"}
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", svc["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", svc["grafana"]["image"])
    assert svc["grafana"]["profiles"] == ["grafana"]  # optional: --profile grafana
    assert re.fullmatch(r"apache/kafka:\d+\.\d+\.\d+", svc["kafka"]["image"])
    assert re.fullmatch(r"redis:\d+(\.\d+)*(-alpine)?", svc["redis"]["image"])
    # The worker builds the project image (Dockerfile) that the server reuses.
    assert svc["worker"]["build"] == "."
    # The worker, which the server waits for, creates the ledger topic.
    assert int(svc["worker"]["environment"]["MCPBG_PARTITIONS"]) > 1
    assert svc["server"]["image"] == svc["worker"]["image"]
    assert (ROOT / "Dockerfile").is_file()


def test_kafka_runs_in_kraft_mode_with_a_listener_for_the_network_and_the_host(
    compose: dict[str, Any],
) -> None:
    env = services(compose)["kafka"]["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "ZOOKEEPER" not in " ".join(env)
    # The image formats its storage with CLUSTER_ID when configured from the environment.
    cluster = env["CLUSTER_ID"]
    assert len(base64.urlsafe_b64decode(cluster + "==")) == 16  # a UUID, as Kafka requires
    listeners = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    internal = listeners[env["KAFKA_INTER_BROKER_LISTENER_NAME"]]
    # What the worker and server are told is the in-network listener.
    bootstrap = compose["x-mcpbg-env"]["MCPBG_KAFKA_URL"]
    assert bootstrap == f"kafka://{internal}"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"].startswith(f"{env['KAFKA_NODE_ID']}@kafka:")


def test_ports_are_published(compose: dict[str, Any]) -> None:
    svc = services(compose)

    def published(name: str) -> set[int]:
        return {int(str(p).split(":")[0]) for p in svc[name].get("ports", [])}

    assert 9092 in published("kafka")
    assert 6379 in published("redis")
    assert 8000 in published("server")
    assert 9108 in published("worker")
    assert 9090 in published("prometheus")
    assert 3000 in published("grafana")


def test_every_service_has_a_health_check(compose: dict[str, Any]) -> None:
    for name, svc in services(compose).items():
        check = svc.get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert len(check["test"]) > 1 and check["retries"] >= 3, name
    # The checks probe what the commands serve.
    assert "9108" in " ".join(services(compose)["worker"]["healthcheck"]["test"])
    server_check = " ".join(services(compose)["server"]["healthcheck"]["test"])
    assert "localhost:8000/health" in server_check


def test_dependencies_wait_for_healthy_services(compose: dict[str, Any]) -> None:
    svc = services(compose)
    for name, needs in {
        "worker": {"kafka", "redis"},
        "server": {"kafka", "redis", "worker"},
        "prometheus": {"worker", "server"},
        "grafana": {"prometheus"},
    }.items():
        depends = svc[name]["depends_on"]
        assert set(depends) == needs, name
        for dep, rule in depends.items():
            assert rule["condition"] == "service_healthy", (name, dep)
            assert "healthcheck" in svc[dep]


def test_the_worker_command_is_a_real_mcpbg_subcommand(compose: dict[str, Any]) -> None:
    command = services(compose)["worker"]["command"]
    assert command[:2] == ["mcpbg", "worker"]
    assert "worker" in cli.COMMANDS
    args = cli.parser().parse_args(command[1:])
    assert args.command == "worker"
    # Its settings come from the environment, each one the worker reads.
    env = {k: str(v) for k, v in services(compose)["worker"]["environment"].items()}
    known = {f"MCPBG_{name.upper()}" for name in worker_cli.OPTIONS}
    names = {k for k in env if k.startswith("MCPBG_")}
    assert names and names <= known, names - known
    config = WorkerConfig.from_env(env)
    for name in names:
        option = name.removeprefix("MCPBG_").lower()
        assert str(getattr(config, option)) == env[name], name


def test_the_server_command_runs_the_example_server_which_imports(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    command = services(compose)["server"]["command"]
    assert command[0] == "python"
    script = command[1]
    assert (ROOT / script).is_file()
    server = load_example_server()
    # Its options parse, and every MCPBG_* variable given is one it reads.
    options = server.parse_args(command[2:])
    assert options.port == 8000
    env = {k: str(v) for k, v in services(compose)["server"]["environment"].items()}
    names = {k for k in env if k.startswith("MCPBG_")}
    assert names and names <= set(server.ENV), names - set(server.ENV)
    # Building the server (nothing connects yet) reads each of them.
    env["MCPBG_POLICY"] = str(ROOT / env["MCPBG_POLICY"].removeprefix("/app/"))
    env["MCPBG_OUTBOX_DIR"] = str(tmp_path / "outbox")  # the container's path, not this host's
    read = Spy(env)
    app = server.build(read)
    assert names <= read.asked, names - read.asked
    assert "/health" in {getattr(route, "path", None) for route in app._additional_http_routes}


class Spy(dict[str, str]):
    """An environment that remembers which variables were asked for."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.asked: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        return super().__getitem__(key)


def test_the_policy_file_is_in_the_image(compose: dict[str, Any]) -> None:
    policy = services(compose)["server"]["environment"]["MCPBG_POLICY"]
    # The worker reads the same file for its alert levels and breakers.
    assert services(compose)["worker"]["environment"]["MCPBG_POLICY"] == policy
    assert policy.startswith("/app/")
    # The Dockerfile copies examples/ into /app.
    local = ROOT / policy.removeprefix("/app/")
    assert len(Policy.from_file(local)) > 0
    assert worker_load_policy(str(local)) == Policy.from_file(local)
    assert "COPY examples ./examples" in (ROOT / "Dockerfile").read_text()


def test_volumes_keep_the_archive_and_the_outbox(compose: dict[str, Any]) -> None:
    svc = services(compose)
    archive = svc["worker"]["environment"]["MCPBG_ARCHIVE_DIR"]
    assert f"archive:{archive}" in svc["worker"]["volumes"]
    outbox = svc["server"]["environment"]["MCPBG_OUTBOX_DIR"]
    assert f"outbox:{outbox}" in svc["server"]["volumes"]
    assert {"archive", "outbox"} <= set(compose["volumes"])


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """Container path -> the repository file a bind mount gives it."""
    out = {}
    for volume in svc.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("./"):
            out[target] = ROOT / source[2:]
    return out


def test_prometheus_scrapes_the_worker_and_the_governor(compose: dict[str, Any]) -> None:
    svc = services(compose)
    mounts = _mounts(svc["prometheus"])
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["prometheus"]["command"]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = {t for j in jobs.values() for c in j["static_configs"] for t in c["targets"]}
    worker_port = svc["worker"]["environment"]["MCPBG_METRICS_PORT"]
    assert f"worker:{worker_port}" in targets
    assert "server:8000" in targets and jobs["mcpbg-governor"]["metrics_path"] == "/metrics"
    # The example server serves /metrics, and the image installs the [otel] extra for it.
    assert '@server.custom_route("/metrics"' in (ROOT / "examples/server.py").read_text()
    assert "otel" in (ROOT / "Dockerfile").read_text().split("pip install", 1)[1].split("\n")[0]


def _metric_names() -> set[str]:
    """The Prometheus names the governor (Telemetry) and the worker export."""
    pytest.importorskip("opentelemetry.exporter.prometheus")
    import asyncio

    from mcp_budget_governor import Context, Governor, Limit, Scope, Window
    from mcp_budget_governor.integrations.otel import Telemetry
    from mcp_budget_governor.stream import metrics

    tel = Telemetry.prometheus()
    try:
        gov = Governor(
            Policy.of(Limit("b", cap=1, window=Window.MINUTE, scope=Scope.USER)), observer=tel
        )
        asyncio.run(gov.check(Context(user="u")))
        text = tel.scrape()
    finally:
        tel.close()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    for family in metrics.REGISTRY.collect():
        names |= {sample.name for sample in family.samples} | {family.name}
    return names


def test_the_grafana_dashboard_queries_metrics_that_exist(compose: dict[str, Any]) -> None:
    import json

    svc = services(compose)["grafana"]
    mounts = _mounts(svc)
    board_path = mounts["/var/lib/grafana/dashboards/mcpbg-dashboard.json"]
    board = json.loads(board_path.read_text())
    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["url"] == "http://prometheus:9090" and ds["type"] == "prometheus"
    provider = yaml.safe_load((provisioning / "dashboards/mcpbg.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    known = _metric_names()
    used: set[str] = set()
    for panel in board["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == ds["uid"], panel["title"]
            used |= set(re.findall(r"\b(mcpbg_(?:governor|ledger|worker)_[a-z_]+)", target["expr"]))
    assert used <= known, used - known
    # Both sides are on the board: the governor's hot path and the worker.
    assert any(n.startswith("mcpbg_governor_") for n in used)
    assert any(n.startswith("mcpbg_worker_") for n in used)
    assert any(n.startswith("mcpbg_ledger_outbox") for n in used)
