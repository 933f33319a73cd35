"""Read models of the ledger: the counters the hot path charges (``counters/``:
Redis, in memory, and their rebuild); beside them the budgets report and, over
the ledger view with DuckDB, reconcile, costs and the FOCUS export."""

if __name__ != "mcp_budget_governor.projections":  # one name per module (README, Layout)
    raise ImportError("import mcp_budget_governor.projections, not projections")
