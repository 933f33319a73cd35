"""Find or start the real Postgres the suite talks to, and give each run its own database.

:func:`find_postgres` looks, in order, at:

1. ``MCPBG_TEST_POSTGRES_URL`` (a server URL, used as is, never stopped);
2. a Docker engine that answers (:func:`testing.services.docker_available`),
   through testcontainers' ``PostgresContainer``;
3. the local server this kind of machine runs on 127.0.0.1:5432 (trust auth,
   user ``postgres``);
4. ``initdb`` + ``postgres`` from the PATH, in a temporary folder on a free
   loopback port (:func:`start_private_postgres`; run as the ``postgres`` user
   when we are root, which initdb refuses to be).

:func:`scratch_database` creates a database of its own on that server and drops
it afterwards, so runs never share state. Fault tests kill and restart only a
private server (:class:`PrivatePostgres`), never a shared one.

>>> admin_url("postgresql://u@h:5432/db?sslmode=disable")
'postgresql://u@h:5432/postgres?sslmode=disable'
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

from testing.services import docker_available, free_port

ENV_VAR = "MCPBG_TEST_POSTGRES_URL"
LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DOCKER_IMAGE = "postgres:16-alpine"
START_TIMEOUT = 30.0


class PostgresUnavailable(RuntimeError):
    """No Postgres could be found or started."""


def admin_url(url: str, database: str = "postgres") -> str:
    """``url`` pointing at ``database`` instead of its own."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether a server at ``url`` accepts a connection."""
    try:
        with psycopg.connect(url, connect_timeout=max(1, round(timeout))) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


@dataclass
class PrivatePostgres:
    """A server this process started (initdb in a temp folder): it may be killed and restarted."""

    port: int
    folder: Path
    binaries: Path
    max_connections: int = 200
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_owner(self) -> dict[str, object]:
        if os.geteuid() != 0:
            return {}
        owner = pwd.getpwnam("postgres")
        return {"user": owner.pw_uid, "group": owner.pw_gid}

    def init(self) -> None:
        data = self.folder / "data"
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)
        subprocess.run(
            [str(self.binaries / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
             "--no-sync", "-E", "UTF8"],
            check=True, capture_output=True, **self._as_owner(),  # type: ignore[arg-type]
        )  # fmt: skip

    def start(self) -> None:
        log = open(self.folder / "postgres.log", "ab")  # noqa: SIM115 - the server holds it
        self._proc = subprocess.Popen(
            [str(self.binaries / "postgres"), "-D", str(self.folder / "data"),
             "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
             "-c", f"unix_socket_directories={self.folder}", "-c", "fsync=off",
             "-c", f"max_connections={self.max_connections}"],
            stdout=log, stderr=log, start_new_session=True, **self._as_owner(),  # type: ignore[arg-type]
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not answers(self.url, 1.0):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.folder / "postgres.log").read_text(errors="replace")[-2000:]
                raise PostgresUnavailable(f"postgres did not start on {self.port}:\n{tail}")
            time.sleep(0.1)

    def kill(self) -> None:
        """Stop the server at once (SIGKILL of its postmaster and children)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # A killed postmaster leaves its pid file and shared memory children behind.
        with contextlib.suppress(FileNotFoundError):
            (self.folder / "data" / "postmaster.pid").unlink()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _binaries() -> Path | None:
    found = shutil.which("postgres") or shutil.which("initdb")
    if found is None:
        return None
    return Path(os.path.realpath(found)).parent


def start_private_postgres(max_connections: int = 200) -> PrivatePostgres:
    """initdb + postgres from the PATH, on a free loopback port, in a temp folder."""
    binaries = _binaries()
    if binaries is None:
        raise PostgresUnavailable("no initdb/postgres on the PATH")
    folder = Path(tempfile.mkdtemp(prefix="mcpbg-pg-"))
    server = PrivatePostgres(free_port(), folder, binaries, max_connections)
    try:
        server.init()
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def find_postgres() -> Iterator[str]:
    """A server URL (see the module docstring for the order); stopped after if ours."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        yield env
        return
    if docker_available():
        with contextlib.suppress(Exception):
            from testcontainers.postgres import PostgresContainer

            with PostgresContainer(DOCKER_IMAGE, driver=None) as container:
                yield container.get_connection_url()
                return
    if answers(LOCAL_URL):
        yield LOCAL_URL
        return
    server = start_private_postgres()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def scratch_database(server_url: str, prefix: str = "mcpbg_test") -> Iterator[str]:
    """A new empty database on ``server_url``, dropped (its sessions ended) afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url(server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url(server_url, name)
    finally:
        with psycopg.connect(admin_url(server_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def truncate_all(url: str) -> None:
    """Empty every mcpbg table of the database at ``url`` (between tests of one run)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
            "AND tablename LIKE 'mcpbg\\_%' AND tablename <> 'mcpbg_migrations'"
        ).fetchall()
        if rows:
            conn.execute("TRUNCATE " + ", ".join(f'"{r[0]}"' for r in rows))
