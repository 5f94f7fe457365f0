"""Per head, which layout runs: the layouts, the router, the semantic layout, compensation."""
