"""The call across devices and hosts: the Ulysses head exchange, the Ulysses x ring split,
and several JAX processes on one machine."""
