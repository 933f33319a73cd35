"""Busy or down: the error classes of the Postgres backend (no server needed).

docs/postgres.md ("Busy is not down") lists them; these hold the code to that list.
"""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors as pg_errors

from mcp_budget_governor import BackendBusyError, BackendUnavailableError, PostgresBackend
from mcp_budget_governor.projections.counters.postgres import (
    is_busy,
    is_down,
    replicas_allowed,
)

URL = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.mark.parametrize(
    "exc",
    [
        pg_errors.QueryCanceled("canceling statement due to statement timeout"),  # 57014
        pg_errors.LockNotAvailable("could not obtain lock"),  # 55P03
        pg_errors.TooManyConnections("sorry, too many clients already"),  # 53300
        pg_errors.OutOfMemory("out of memory"),  # 53200
    ],
)
def test_busy_classes(exc: Exception) -> None:
    assert is_busy(exc) and not is_down(exc)
    failed = PostgresBackend(URL)._failed(exc)
    assert isinstance(failed, BackendBusyError) and str(failed).startswith("postgres busy: ")


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.OperationalError("server closed the connection unexpectedly"),  # no SQLSTATE
        psycopg.InterfaceError("the connection is closed"),
        pg_errors.AdminShutdown("terminating connection due to administrator command"),
        pg_errors.CrashShutdown("terminating connection because of crash"),
        pg_errors.CannotConnectNow("the database system is starting up"),
        pg_errors.ConnectionFailure("connection failure"),  # 08006
        TimeoutError(),
        ConnectionRefusedError("refused"),
    ],
)
def test_down_classes(exc: Exception) -> None:
    assert is_down(exc) and not is_busy(exc)
    failed = PostgresBackend(URL)._failed(exc)
    assert isinstance(failed, BackendUnavailableError)
    assert str(failed).startswith("postgres postgresql://***@127.0.0.1:5432/postgres unreachable")


def test_a_raise_in_a_function_is_a_value_error_and_other_errors_are_bugs() -> None:
    backend = PostgresBackend(URL)
    failed = backend._failed(pg_errors.RaiseException("mcpbg apply: refused the batch\nCONTEXT"))
    assert isinstance(failed, ValueError) and str(failed) == "mcpbg apply: refused the batch"
    bug = pg_errors.UndefinedFunction("function mcpbg_nope() does not exist")
    assert not is_busy(bug) and not is_down(bug)
    assert backend._failed(bug) is bug  # raised as it is


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("timeout", {"timeout": 0}),
        ("timeout", {"timeout": True}),
        ("queue_timeout", {"queue_timeout": -1.0}),
        ("max_connections", {"max_connections": 0}),
        ("max_connections", {"max_connections": 2.5}),
    ],
)
def test_bad_settings_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        PostgresBackend.from_url(URL, **kwargs)  # type: ignore[arg-type]


def test_the_defaults_and_the_replicas_they_allow() -> None:
    backend = PostgresBackend.from_url(URL)
    assert (backend.timeout, backend.queue_timeout, backend.max_connections) == (2.0, 5.0, 5)
    assert backend.durable
    assert replicas_allowed(100, 3, backend.max_connections) == 19
    assert replicas_allowed(200, 3, 5) == 39
    assert replicas_allowed(100, 3, 32) == 3  # the old default pool
    assert replicas_allowed(2, 3, 5) == 0
    fast = PostgresBackend.from_url(URL, durable=False)
    assert not fast.durable
