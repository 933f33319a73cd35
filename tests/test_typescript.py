"""The TypeScript package's own suite (``ts/``), run from pytest so that
``scripts/test`` (the README's test command, and CI's) covers it too.

``npm ci`` installs from the committed lockfile, then ``npm run lint`` (eslint
and ``tsc`` over sources, tests and benchmark) and ``npm test`` (build, which
copies ``lua/`` and checks its digests against ``conformance/vectors.json``,
then node's test runner) run with this run's Redis in ``MCPBG_TEST_REDIS_URL``,
a broker in ``MCPBG_TEST_KAFKA_BOOTSTRAP``, a private Redis in
``MCPBG_TEST_OWN_REDIS_URL`` and this run's Postgres database in
``MCPBG_TEST_POSTGRES_URL``, as the TypeScript tests expect them
(``ts/test/services.ts``). Without them ``ts/test/ledgerKafka.test.ts`` would skip
its test of the bytes, keys and partitions on the topic: here no test may skip.
Node 20+ is required: without it this fails saying so (see ``testing/node.py``).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from testing.node import TS_DIR, npm_ci
from testing.services import KafkaService, RedisService
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
def test_the_typescript_suite_passes(
    redis_service: RedisService, kafka: KafkaService, own_redis: RedisService, postgres_url: str
) -> None:
    npm_ci()
    env = {
        **os.environ,
        "MCPBG_TEST_REDIS_URL": redis_service.url,
        "MCPBG_TEST_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "MCPBG_TEST_OWN_REDIS_URL": own_redis.url,  # for the test that flushes its scripts
        "MCPBG_TEST_POSTGRES_URL": postgres_url,  # this run's database (testing/postgres.py)
    }
    _npm("lint", env)
    out = _npm("test", env)
    # Every test ran (node's TAP lines; its summary counts no skipped describe): a skip
    # here is a test CI never runs.
    skipped = [line for line in out.splitlines() if "# SKIP" in line]
    assert skipped == [], f"TypeScript tests skipped with every service given: {skipped}"
