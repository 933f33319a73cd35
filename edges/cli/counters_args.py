"""The counters' store of a CLI command: Redis (``--redis-url``) or Postgres (``--postgres``).

The one place the commands that read or change the counters directly
(``budgets``, ``caps``, ``plans``, ``grant``, ``reset``) choose their backend.
An option beats an environment variable; with neither option,
``MCPBG_POSTGRES_URL`` beats ``MCPBG_REDIS_URL``, as it does for ``mcpbg
worker``, so one environment serves both. Both options at once is an error.

>>> import argparse
>>> p = argparse.ArgumentParser()
>>> add_counters_options(p)
>>> args = p.parse_args(["--postgres", "postgresql://postgres@127.0.0.1:5432/test"])
>>> counters_store(args)
('postgres_url', 'postgresql://postgres@127.0.0.1:5432/test')
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..settings import SETTINGS, env_value
from .ledger_args import add_redis_option, required

if TYPE_CHECKING:
    from ..counters import Backend
    from ..projections.counters.postgres import PostgresBackend


def add_counters_options(p: Any) -> None:
    """``--redis-url`` and ``--postgres`` (also ``--postgres-url``)."""
    add_redis_option(p)
    s = SETTINGS["postgres_url"]
    p.add_argument(
        "--postgres",
        s.option,
        dest="postgres_url",
        metavar="URL",
        help=s.describe(
            "the counters in Postgres instead of Redis, postgresql://user@host:port/db"
        ),
    )


def counters_store(args: argparse.Namespace) -> tuple[str, str]:
    """``("postgres_url" | "redis_url", url)``, checked; bad or missing: one-line error."""
    from ..errors import InvalidInputError
    from ..urls import check_postgres_url, check_redis_url, redact

    postgres, redis = getattr(args, "postgres_url", None), getattr(args, "redis_url", None)
    if postgres is not None and redis is not None:
        raise InvalidInputError(
            "--postgres", redact(postgres), "give --redis-url or --postgres, not both"
        )
    if postgres is None and redis is None:
        postgres = env_value("postgres_url") or None
    if postgres is not None:
        return "postgres_url", check_postgres_url(postgres, "--postgres")
    url = required(args, "redis_url", "redis://host:port/db, or give --postgres URL")
    return "redis_url", check_redis_url(url, "--redis-url")


def open_counters(
    args: argparse.Namespace, *, timeout: float = 5.0, max_connections: int = 2
) -> Backend:
    """The backend :func:`counters_store` names (connected lazily, on first use)."""
    from ..errors import GovernorError
    from .render import install_hint

    name, url = counters_store(args)
    extra = "postgres" if name == "postgres_url" else "redis"
    try:
        if name == "postgres_url":
            from ..projections.counters.postgres import PostgresBackend

            backend = PostgresBackend.from_url(
                url, timeout=timeout, max_connections=max_connections
            )
            _probe_postgres(backend)
            return backend
        from ..projections.counters.redis import RedisBackend
        from ..settings import resolve

        # MCPBG_CAPS_REFRESH (Redis Cluster), checked before any client is made.
        refresh = resolve(["caps_refresh"])["caps_refresh"]
        return RedisBackend.from_url(
            url, timeout=timeout, max_connections=max_connections, caps_refresh=refresh
        )
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise GovernorError(f"{exc}; install the {extra} extra: {install_hint(extra)}") from None


def _probe_postgres(backend: PostgresBackend) -> None:
    """Connect once: an unreachable server (or a missing database, a refused login) is
    one line with libpq's reason, not the pool's retries logged on stderr."""
    import logging

    import psycopg

    # The pool logs each failed reconnection; a command reports its one error itself.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
    try:
        psycopg.connect(backend.url, connect_timeout=max(1, round(backend.timeout))).close()
    except psycopg.Error as exc:
        raise backend._down(exc) from None  # the backend's one wording of "unreachable"
