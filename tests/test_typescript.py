"""The TypeScript package's own suite (``ts/``), run from pytest so that
``scripts/test`` (the README's test command, and CI's) covers it too.

``npm ci`` installs from the committed lockfile, then ``npm run lint`` (eslint
and ``tsc`` over sources, tests and benchmark) and ``npm test`` (build, which
copies ``lua/`` and checks its digests against ``conformance/vectors.json``,
then node's test runner) run with this run's Redis in ``MCPBG_TEST_REDIS_URL``,
as the TypeScript tests expect it. Node 20+ is required: without it this fails
saying so (see ``testing/node.py``).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from testing.node import TS_DIR, npm_ci
from testing.services import RedisService


def _npm(script: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        ["npm", "run", script], cwd=TS_DIR, env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise AssertionError(
            f"npm run {script} failed ({done.returncode}):\n"
            f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
        )


@pytest.mark.slow
def test_the_typescript_suite_passes(redis_service: RedisService) -> None:
    npm_ci()
    env = {**os.environ, "MCPBG_TEST_REDIS_URL": redis_service.url}
    _npm("lint", env)
    _npm("test", env)
