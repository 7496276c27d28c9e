"""The kernel sets: every hot-path operation of the model and the sampler (paged attention,
KV-cache write, matmul, RMSNorm, rotary, batched LoRA, the sampler's seeded draw and grammar
bitmask, the greedy head's running argmax) behind one `KernelSet` interface, in three
backends: Triton kernels (CUDA), C kernels built on the machine (the CPU), and their
plain-torch reference twins (any device; the others' oracle and fallback). `select_kernels`
picks one; the engine hands it to every part that runs a kernel."""

from headrace.kernels.attention import AttentionMetadata
from headrace.kernels.backend import BACKEND_NAMES, KernelSet, select_kernels

__all__ = ["BACKEND_NAMES", "AttentionMetadata", "KernelSet", "select_kernels"]
