"""Per head, which layout runs: the head layouts, the router, the semantic (k-means) layout,
and compensation for the tiles a head skips."""
