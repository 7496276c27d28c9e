"""How many KV blocks a rank holds: the configured count, or what its memory budget fits."""

from __future__ import annotations

import math

import torch
from headrace.kernels.kv_layout import cache_shape
from headrace.worker.config import EngineConfig
from headrace.worker.models.interface import CausalLM


def kv_block_bytes(model: CausalLM, block_size: int, kv_cache_dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers (int8: with each row's scale)."""
    shape = cache_shape(1, block_size, model.num_kv_heads, model.head_dim, kv_cache_dtype)
    element_size = torch.tensor([], dtype=kv_cache_dtype).element_size()
    return math.prod(shape) * element_size * model.num_layers


def kv_cache_blocks(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> int:
    """KV blocks this rank can hold: the configured count, or what its memory budget fits.

    A block costs what this rank stores of it (its layers, its KV heads), so with tensor or
    pipeline parallelism the same budget holds proportionally more blocks.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_bytes = kv_block_bytes(model, config.block_size, config.kv_cache_torch_dtype(dtype))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int(config.cpu_kv_cache_gib * 2**30)
    # More blocks than every running sequence at full length could use is wasted memory.
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(budget // block_bytes, useful))
