"""Read models: the counters the hot path reads (Redis, in-memory) and, later,
the DuckDB views, rebuild, reconcile and exports."""
