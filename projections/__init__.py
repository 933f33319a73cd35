"""Read models of the ledger: the counters the hot path reads (Redis, in memory)
and, over the Parquet archive with DuckDB, rebuilds, reconcile, costs and exports."""

if __name__ != "mcp_budget_governor.projections":  # one name per module (README, Layout)
    raise ImportError("import mcp_budget_governor.projections, not projections")
