"""Memory ledger and byte budgets: what is in use on the device, and the limit."""
