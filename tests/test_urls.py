"""Service URLs: one check for Redis URLs, and no password ever shown (``urls``)."""

from __future__ import annotations

import pytest

from mcp_budget_governor.errors import InvalidInputError
from mcp_budget_governor.urls import check_redis_url, redact


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@cache:6379/15", "redis://***@cache:6379/15"),
        ("rediss://user:s3cret@cache:6380/0", "rediss://***@cache:6380/0"),
        ("redis://cache:6379/0?password=s3cret", "redis://cache:6379/0?password=***"),
        ("redis://cache/0?db=1&PASSWORD=s3cret&x=1", "redis://cache/0?db=1&PASSWORD=***&x=1"),
        ("unix:///run/redis.sock?password=s3cret&db=2", "unix:///run/redis.sock?password=***&db=2"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_redact_hides_every_password(url: str, shown: str) -> None:
    assert redact(url) == shown and "s3cret" not in redact(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://localhost:6379/0",
        "redis://localhost",
        "rediss://:pw@cache.example:6380/3",
        "redis://[::1]:6379/1",
        "redis://localhost:6379?db=4",
        "unix:///run/redis.sock?db=1",
    ],
)
def test_good_redis_urls_pass(url: str) -> None:
    assert check_redis_url(url) == url


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://localhost:6379/0", "expected redis://host:port/db"),
        ("localhost:6379", "expected redis://host:port/db"),
        ("", "expected redis://host:port/db"),
        ("redis://localhost:99999/0", "port 99999 is not 1-65535"),
        ("redis://localhost:0/0", "port 0 is not 1-65535"),
        ("redis://localhost:port/0", "port port is not 1-65535"),
        ("redis://localhost:6379/first", "database 'first' is not a whole number"),
        ("redis://localhost:6379/-1", "database '-1' is not a whole number"),
        ("redis://localhost:6379/0?db=x", "database 'x' is not a whole number"),
        ("unix://", "expected unix:///path/to/redis.sock"),
        ("redis://[::1/0", "expected redis://host:port/db"),
    ],
)
def test_bad_redis_urls_name_the_field(url: str, problem: str) -> None:
    with pytest.raises(InvalidInputError, match=f"^redis_url: {problem}"):
        check_redis_url(url, "redis_url")


def test_the_error_never_shows_the_password() -> None:
    with pytest.raises(InvalidInputError) as err:
        check_redis_url("redis://:s3cret@localhost:99999/0?password=s3cret")
    assert "s3cret" not in str(err.value) and "***" in str(err.value)
