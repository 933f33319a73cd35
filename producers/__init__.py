"""Everything that appends to the ledger: Kafka, a durable outbox, files, memory."""
