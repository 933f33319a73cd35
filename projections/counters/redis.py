"""Redis counters: :class:`RedisBackend`, the scripts of :mod:`.redis_scripts` on a
client it may open itself (:meth:`RedisBackend.from_url`), or a Redis Cluster's for a
``redis+cluster://`` URL (:mod:`.cluster`, which builds on :mod:`.redis_scripts`, not
on this module, so the two do not import each other).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from mcp_budget_governor.settings import checked
from mcp_budget_governor.urls import check_redis_url

from .redis_scripts import (
    DEFAULT_TIMEOUT,
    RedisScripts,
    apply_args,
    caps_value,
    change_tokens,
    close_best_effort,
    redis_failure,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "RedisBackend",
    "apply_args",
    "caps_value",
    "change_tokens",
    "close_best_effort",
    "redis_failure",
]


class RedisBackend(RedisScripts):
    """Counters in Redis, shared by every replica.

    ``RedisBackend(client)`` borrows ``client`` (a redis-py asyncio client, say one
    whose pool the application shares): closing the backend leaves it open
    unless ``owns_client=True``. :meth:`from_url` makes a client it owns. It
    also answers the calls of mcp-budget-governor 0.1.0's backends
    (``backends.base``) on the same counters.

    >>> backend = RedisBackend.from_url("redis://localhost:6379/0")  # doctest: +SKIP
    """

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = 64,
        require_epoch: bool = False,
        coalesce: bool = True,
        clock: Callable[[], float] = time.time,
        caps_refresh: float | None = None,
        **kwargs: Any,
    ) -> RedisBackend:
        """Connect lazily to ``url``; ``timeout`` (seconds) bounds every call.

        The pool blocks when all ``max_connections`` are busy (a burst of
        concurrent checks queues for a connection, it is not an outage) and
        retries a dead connection once, so a restarted Redis is picked up at once.

        ``require_epoch=True`` is for deployments with a ledger and a stream
        worker: while the worker's epoch marker is missing (Redis restarted
        empty, or was flushed, and is being rebuilt), every charge counts as
        the backend being unreachable, so each limit's fail mode applies and
        nothing is admitted from empty counters.

        ``redis+cluster://host:port[,host:port]`` connects to a Redis Cluster
        instead (:class:`~.cluster.ClusterBackend`, docs/cluster.md); there
        ``caps_refresh`` (seconds; None: the setting's default, 1) bounds how old
        the client's copy of run-time caps and plan assignments may be (one
        Redis reads them inside its script: the value is checked, then unused),
        and ``require_epoch`` checks each slot's own epoch marker (a shard that
        restarted empty fails its slots' checks only).

        ``coalesce`` (the default): the scripts share one auto-pipelined
        connection per event loop (concurrent calls go out in one write); off,
        each call takes a pooled connection of its own.
        """
        if caps_refresh is not None:
            checked("caps_refresh", caps_refresh)
        if url.startswith("redis+cluster://"):  # Redis Cluster: projections/counters/cluster.py
            from .cluster import ClusterBackend

            if caps_refresh is not None:
                kwargs["caps_refresh"] = caps_refresh
            return ClusterBackend.from_url(  # type: ignore[return-value]
                url, timeout=timeout, require_epoch=require_epoch, **kwargs
            )
        check_redis_url(url, "url")
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=max(timeout, 1.0),
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
            **kwargs,
        )
        return cls(
            aioredis.Redis(connection_pool=pool),
            owns_client=True,
            require_epoch=require_epoch,
            coalesce=coalesce,
            timeout=timeout,
            clock=clock,
        )
