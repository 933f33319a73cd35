"""The counters: the ledger's projection the hot path reads and charges.

One module per store (``redis``, ``postgres``, ``memory``), each implementing the
:class:`~mcp_budget_governor.counters.Backend` protocol; ``sync`` reads and
rewrites Redis counters against the ledger's totals, and ``rebuild`` rebuilds
them from the ledger (``mcpbg replay``).
"""
