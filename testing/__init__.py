"""What the test suite and the benchmarks share: services, stream support, the bench harness.

Not part of the installed package (pyproject lists only ``mcp_budget_governor``):
it is imported from the repository root, which pytest puts on ``sys.path``
(``pythonpath = ["."]`` in pyproject) and which ``python -m benchmarks.<script>``
run from the root puts there too.

- :mod:`testing.services`: find or start a real Redis and Kafka-protocol broker;
- :mod:`testing.stream_support`: the stream-worker fixtures, worker subprocesses,
  watermarks and the "every counter exact" check;
- :mod:`testing.workers`: code the multi-process tests run in child processes;
- :mod:`testing.focus_validator_env`: the FinOps ``focus-validator`` in its own venv;
- :mod:`testing.bench`: the benchmarks' Redis, statistics, tables and CPU meter;
- :mod:`testing.ledger_gen`: schema-valid archive Parquet for tests and benchmarks;
- :mod:`testing.buckets`: keep a wall-clock test inside one bucket of its window.
"""
