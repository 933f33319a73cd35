"""The TypeScript package's own suite (``ts/``), run from pytest so that
``scripts/test`` (the README's test command, and CI's) covers it too.

``npm ci`` installs from the committed lockfile, then ``npm run lint`` (eslint
and ``tsc`` over sources, tests and benchmark) and ``npm test`` (build, which
copies ``lua/`` and checks its digests against ``conformance/vectors.json``,
then node's test runner) run with this run's Redis in ``MCPBG_TEST_REDIS_URL``,
a broker in ``MCPBG_TEST_KAFKA_BOOTSTRAP`` and the Redis binary in
``MCPBG_TEST_REDIS_SERVER``, as the TypeScript tests expect them. Without them
``ts/test/ledgerKafka.test.ts`` would skip its test of the bytes, keys and
partitions on the topic, and ``ts/test/redisBackend.test.ts`` its private Redis:
here none may skip (the Redis one only where no binary exists, Redis in Docker).
Node 20+ is required: without it this fails saying so (see ``testing/node.py``).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from testing.node import TS_DIR, npm_ci
from testing.services import KafkaService, RedisService, redis_binary
from testing.stream_support import kafka

__all__ = ["kafka"]  # a fixture, used by name


def _npm(script: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["npm", "run", script], cwd=TS_DIR, env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise AssertionError(
            f"npm run {script} failed ({done.returncode}):\n"
            f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout


@pytest.mark.slow
def test_the_typescript_suite_passes(redis_service: RedisService, kafka: KafkaService) -> None:
    npm_ci()
    binary = redis_binary()
    env = {
        **os.environ,
        "MCPBG_TEST_REDIS_URL": redis_service.url,
        "MCPBG_TEST_KAFKA_BOOTSTRAP": kafka.bootstrap,
        # for the TypeScript test that starts a Redis of its own
        "MCPBG_TEST_REDIS_SERVER": binary or "redis-server",
    }
    _npm("lint", env)
    out = _npm("test", env)
    # Every test ran (node's TAP lines): a skip here is a test CI never runs.
    skipped = [line for line in out.splitlines() if "# SKIP" in line]
    if binary is None:
        skipped = [line for line in skipped if "no Redis binary" not in line]
    assert skipped == [], f"TypeScript tests skipped with every service given: {skipped}"
