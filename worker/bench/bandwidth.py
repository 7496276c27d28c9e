"""What a single stream's decode step should cost: reading the weights once.

At one row a decode step multiplies each weight once, so it is bound by reading them from
memory (SmolLM2-135M: 540 MB in float32, 270 MB in bfloat16, the tied LM head counted once).
`weight_read_s` times that read on this machine, now: the model's bytes in one buffer,
summed by torch (a streaming read on every thread), best of ``repeats``. A step within
~1.1x of it spends little beyond the read (llama.cpp reaches that); the gap is the step's
other ops and the Python between them.
"""

from __future__ import annotations

import time

import torch
from headrace.worker.bench.common import Summary
from headrace.worker.models.interface import LoadableModel


def weight_bytes(model: LoadableModel) -> int:
    """Bytes of the model's distinct parameters (a tied LM head counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def weight_read_s(num_bytes: int, repeats: int = 5) -> float:
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return best


def compare_with_read(model: LoadableModel, step_s: float) -> Summary:
    """The weight read beside a one-row decode step's ``step_s`` (its p50), printed."""
    num_bytes = weight_bytes(model)
    read_s = weight_read_s(num_bytes)
    ratio = step_s / read_s
    print(
        f"  weight read: {read_s * 1e3:.1f} ms ({num_bytes / 1e6:.0f} MB at "
        f"{num_bytes / read_s / 1e9:.1f} GB/s); a one-row decode step {step_s * 1e3:.1f} ms "
        f"= {ratio:.2f}x the read"
    )
    return {"weight_read_ms": round(read_s * 1e3, 2), "ratio_step_weight_read": round(ratio, 3)}
