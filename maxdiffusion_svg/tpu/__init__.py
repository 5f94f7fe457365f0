"""Compiling for a TPU from any host with libtpu, reading libtpu's static bundles, and the
prices of a call by them."""
