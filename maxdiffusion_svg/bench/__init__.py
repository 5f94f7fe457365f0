"""Benchmarks: scripts that print figures and ratios (speed is never asserted in tests)."""
