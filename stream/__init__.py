"""The stream worker: consumes the ledger topic, projects it into the counters,
archives it as Parquet and raises alerts; dead letters for what it cannot read."""

if __name__ != "mcp_budget_governor.stream":  # one name per module (README, Layout)
    raise ImportError("import mcp_budget_governor.stream, not stream")
