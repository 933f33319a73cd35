"""The ledger topic and its dead-letter topic, made ready before a worker subscribes.

:func:`prepare_topics` waits for the ledger topic (or creates it with
``partitions``) and creates ``<topic>.dlq`` with as many partitions. Nothing
here reads ``end_offsets`` or needs transactions (see docs/worker.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from mcp_budget_governor.errors import InvalidInputError

from .config import WorkerConfig

__all__ = ["prepare_topics"]

log = logging.getLogger(__name__)


async def prepare_topics(config: WorkerConfig) -> int:
    """Wait for the ledger topic (up to ``topic_wait`` s, or create it with ``partitions``);
    create its DLQ if missing.

    Returns the ledger topic's partition count. Waiting first avoids a
    subscription to a topic that does not exist yet, which costs a
    rebalance (slow on some brokers) when it appears.
    """
    # Creating the topic gets a few seconds of its own, even with topic_wait 0.
    deadline = time.monotonic() + config.topic_wait + (10.0 if config.partitions else 0.0)
    admin = await _admin(config.bootstrap, deadline)
    try:
        said = 0.0
        while True:
            count = await _partition_count(admin, config.topic)
            if count:
                break
            if time.monotonic() >= deadline:
                raise InvalidInputError(
                    "topic",
                    config.topic,
                    f"not found on {config.bootstrap} within {config.topic_wait:g} s",
                )
            if config.partitions:
                with contextlib.suppress(TopicAlreadyExistsError):
                    await admin.create_topics([NewTopic(config.topic, config.partitions, 1)])
                    log.info(
                        "projector: created %s (%d partitions)", config.topic, config.partitions
                    )
                await asyncio.sleep(0.1)  # until the broker lists it
                continue
            if time.monotonic() - said > 5:
                log.info("projector: waiting for topic %s on %s", config.topic, config.bootstrap)
                said = time.monotonic()
            await asyncio.sleep(0.2)
        if config.dlq_topic not in await admin.list_topics():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(config.dlq_topic, count, 1)])
                log.info("projector: created %s (%d partitions)", config.dlq_topic, count)
        return count
    finally:
        await admin.close()


async def _partition_count(admin: AIOKafkaAdminClient, topic: str) -> int:
    """How many partitions ``topic`` has, 0 when the broker does not know it."""
    try:
        # Listed first: describing a missing topic is a metadata request that a
        # broker with auto-creation on answers by creating it with its default
        # partition count (tansu: 4), behind the operator's back.
        if topic not in await admin.list_topics():
            return 0
        described = await admin.describe_topics([topic])
    except KafkaError:
        return 0
    if not described or described[0].get("error_code", 0) != 0:
        return 0
    return len(described[0].get("partitions") or ())


async def _admin(bootstrap: str, deadline: float) -> AIOKafkaAdminClient:
    """A started admin client, retrying (a fresh client each time) until ``deadline``."""
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        try:
            await admin.start()
            return admin
        except (KafkaError, OSError) as exc:
            with contextlib.suppress(Exception):
                await admin.close()
            if time.monotonic() >= deadline:
                raise
            log.info("projector: Kafka at %s not reachable yet (%s); retrying", bootstrap, exc)
            await asyncio.sleep(0.5)
