"""Everything that appends to the ledger: Kafka, a durable outbox, files, memory."""

if __name__ != "mcp_budget_governor.producers":  # one name per module (README, Layout)
    raise ImportError("import mcp_budget_governor.producers, not producers")
