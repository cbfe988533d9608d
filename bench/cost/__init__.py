"""The cost-aware overflow benchmark (`bench.cost.config` says what is run)."""
