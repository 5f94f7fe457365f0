"""Across devices and hosts: the Ulysses head exchange, the Ulysses x ring split, multi-process."""
