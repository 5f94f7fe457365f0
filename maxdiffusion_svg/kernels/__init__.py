"""Sparse attention executors for a TilePlan: Splash (TPU) and block-sparse XLA (CPU, GPU)."""

from maxdiffusion_svg.kernels.api import BACKENDS, resolve_backend, sparse_attention
from maxdiffusion_svg.kernels.reference import dense_attention, masked_attention, plan_reference
