"""testing.buckets: the wait that keeps a wall-clock test inside one bucket."""

from __future__ import annotations

import doctest

import testing.buckets
from testing.buckets import seconds_to_wait


def test_the_examples_hold() -> None:
    assert doctest.testmod(testing.buckets).failed == 0


def test_it_waits_only_when_the_bucket_is_too_short() -> None:
    start = 1_800_000_000.0  # a multiple of 60 and of 3600
    assert seconds_to_wait(60, needed=18, now=start + 41) == 0.0  # 19 s left
    assert seconds_to_wait(60, needed=18, now=start + 43) == 17.05  # 17 s left: next minute
    assert seconds_to_wait(3600, needed=18, now=start + 3590) == 10.05
    assert seconds_to_wait(60, needed=18, now=start) == 0.0
