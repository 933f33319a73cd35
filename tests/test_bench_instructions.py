"""``testing.bench.instructions_per_op``: callgrind's counts are repeatable and scale with work.

A shell loop stands for the benchmark's subprocess (valgrind runs it in about a
second, where a Python interpreter takes tens of seconds); the benchmarks use the
same helper on ``python -m benchmarks.<script> --child ...``.
"""

from __future__ import annotations

import pytest

from testing import bench

pytestmark = pytest.mark.skipif(not bench.callgrind_available(), reason="valgrind not installed")


def loop(k: int) -> list[str]:
    return ["sh", "-c", f"i=0; while [ $i -lt {k} ]; do i=$((i+1)); done"]


def test_instructions_per_op_cancels_start_up() -> None:
    per_op = bench.instructions_per_op(loop, 300)
    assert per_op > 0
    # Start-up cancels, and the count is the same whatever the machine's load:
    # N=600 gives the per-iteration count of N=300 (a wall clock would not).
    assert abs(bench.instructions_per_op(loop, 600) - per_op) / per_op < 0.02


def test_a_failing_command_is_named() -> None:
    with pytest.raises(RuntimeError, match="failed under callgrind"):
        bench.callgrind_instructions(["sh", "-c", "exit 3"])
