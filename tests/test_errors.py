"""``errors.py``: one class and one message for "Redis unreachable"."""

from __future__ import annotations

import pytest

from mcp_budget_governor.errors import BackendUnavailableError


def test_the_counter_sync_name_is_the_one_class() -> None:
    counter_sync = pytest.importorskip("mcp_budget_governor.projections.counters.sync")
    assert counter_sync.RedisUnavailableError is BackendUnavailableError


def test_an_unreachable_redis_is_one_message_naming_the_redacted_url() -> None:
    counter_sync = pytest.importorskip("mcp_budget_governor.projections.counters.sync")
    with pytest.raises(BackendUnavailableError) as raised:
        counter_sync.redis_client("redis://:s3cret@127.0.0.1:1/0")  # nothing listens on port 1
    message = str(raised.value)
    assert message.startswith("redis redis://***@127.0.0.1:1/0 unreachable: "), message
    assert "s3cret" not in message


def test_said_once_not_nested() -> None:
    inner = BackendUnavailableError.redis(OSError("refused"))
    assert BackendUnavailableError.redis(inner) is inner
    assert str(inner) == "redis unreachable: refused"
