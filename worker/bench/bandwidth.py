"""What a single stream's decode step should cost: reading the weights once.

At one row a decode step multiplies each weight once, so it is bound by reading them from
memory (SmolLM2-135M: 540 MB in float32, 270 MB in bfloat16, the tied LM head counted once).
`compare_with_read` sets it beside the read of those bytes at the bandwidth measured now
(`read_bandwidth`: torch's sum over one fixed-size buffer, every thread streaming). A step within
~1.1x of it spends little beyond the read (llama.cpp reaches that); the gap is the step's
other ops and the Python between them.
"""

from __future__ import annotations

import time
from typing import cast

import torch
from headrace.kernels.huge_pages import huge_page_bytes
from headrace.kernels.quantized import QuantizedWeight
from headrace.worker.bench.common import Summary
from headrace.worker.models.interface import LoadableModel
from torch import nn


def weight_bytes(model: LoadableModel) -> int:
    """Bytes of the model's distinct parameters (a tied LM head counted once), a quantized
    layer's integers, scales and offsets in place of its weight."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters() if not p.is_meta}
    quantized = (getattr(m, "quantized", None) for m in cast(nn.Module, model).modules())
    return sum(seen.values()) + sum(q.nbytes() for q in quantized if isinstance(q, QuantizedWeight))


#: Bytes the bandwidth is measured on: far past any cache, and one size for every model and
#: dtype (torch's sum reads a smaller buffer at a different rate: 61 GB/s over 270 MB against
#: 37 GB/s over 540 MB on the 2-core dev VM).
READ_BUFFER_BYTES = 512 << 20


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second torch's sum reads a float32 buffer of `READ_BUFFER_BYTES` (every
    thread streaming its share), best of ``repeats``. The buffer lies in huge pages, as a
    CPU runner's weights do (`huge_pages.HugePageArena`)."""
    buffer = huge_page_bytes(READ_BUFFER_BYTES).view(torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return READ_BUFFER_BYTES / best


def compare_with_read(model: LoadableModel, step_s: float) -> Summary:
    """The weight read beside a one-row decode step's ``step_s`` (its p50), printed."""
    num_bytes = weight_bytes(model)
    read_s = num_bytes / read_bandwidth()
    ratio = step_s / read_s
    print(
        f"  weight read: {read_s * 1e3:.1f} ms ({num_bytes / 1e6:.0f} MB at "
        f"{num_bytes / read_s / 1e9:.1f} GB/s); a one-row decode step {step_s * 1e3:.1f} ms "
        f"= {ratio:.2f}x the read"
    )
    return {"weight_read_ms": round(read_s * 1e3, 2), "ratio_step_weight_read": round(ratio, 3)}
