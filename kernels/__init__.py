"""Kernels of the hot paths (paged attention, KV-cache write, RMSNorm, rotary): Triton
kernels and their plain-torch reference twins, behind one `KernelSet` interface."""

from headrace.kernels.attention import AttentionMetadata
from headrace.kernels.backend import BACKEND_NAMES, KernelSet, select_kernels

__all__ = ["BACKEND_NAMES", "AttentionMetadata", "KernelSet", "select_kernels"]
