"""The side-by-side benchmarks, run from the repository root as
``python -m benchmarks.<script>`` (see benchmarks/README.md)."""
