"""What a single stream's decode step should cost: reading the weights once.

At one row a decode step multiplies each weight once, so it is bound by reading them from
memory (SmolLM2-135M: 540 MB in float32, 270 MB in bfloat16, the tied LM head counted once).
`ReadsBeside` sets each one-row step beside a read of a fixed buffer made right after it
(`read_once`: torch's sum, every thread streaming), and reports the median of the pairs'
step-to-read ratios. A step within ~1.1x of the read spends little beyond it (llama.cpp
reaches that); the gap is the step's other ops and the Python between them.

The read is paired with each step, not measured once, because a VM's memory rate moves
while a run goes on: on the 2-core Zen 4 VM a buffer read every 0.3 s in one process made
30-37 GB/s, then 62-66 for a second, then 36 again, so a read measured before or after a
run set its steps beside another second's rate (a one-row step "1.1x" or "2.7x the read"
in processes a minute apart).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
#: dtype.
READ_BUFFER_BYTES = 512 << 20


def read_once(buffer: torch.Tensor) -> float:
    """Bytes per second torch's sum read ``buffer`` (float32) at, once."""
    start = time.perf_counter()
    buffer.sum()
    return buffer.numel() * buffer.element_size() / (time.perf_counter() - start)


def read_buffer() -> torch.Tensor:
    """`READ_BUFFER_BYTES` of float32 in huge pages, as a CPU runner's weights lie
    (`huge_pages.HugePageArena`), every page touched."""
    return huge_page_bytes(READ_BUFFER_BYTES).view(torch.float32).fill_(1.0)


@dataclass
class ReadsBeside:
    """One-row decode steps, each with a read of the buffer made right after it (`after_step`,
    a bench run's hook), set beside the weights' bytes."""

    #: The weights a step reads (`weight_bytes`).
    num_bytes: int
    #: Reads the buffer once: bytes per second (`read_once` on `read_buffer()`; tests give
    #: their own).
    read: Callable[[], float]
    #: (step seconds, read bytes per second) per decode step.
    pairs: list[tuple[float, float]] = field(default_factory=list)

    def after_step(self, step_s: float, is_decode: bool) -> None:
        if is_decode:
            self.pairs.append((step_s, self.read()))

    def summary(self) -> Summary:
        """The median read, step and step-to-read ratio of the pairs, printed."""
        rates = [rate for _, rate in self.pairs]
        ratios = [step_s * rate / self.num_bytes for step_s, rate in self.pairs]
        rate, ratio = statistics.median(rates), statistics.median(ratios)
        step_s = statistics.median(step_s for step_s, _ in self.pairs)
        read_s = self.num_bytes / rate
        print(
            f"  weight read beside each one-row step ({len(self.pairs)} pairs): "
            f"{read_s * 1e3:.1f} ms ({self.num_bytes / 1e6:.0f} MB at {rate / 1e9:.1f} GB/s, "
            f"{min(rates) / 1e9:.0f}-{max(rates) / 1e9:.0f} over the run); a one-row decode "
            f"step {step_s * 1e3:.1f} ms = {ratio:.2f}x its read (median of the pairs)"
        )
        return {"weight_read_ms": round(read_s * 1e3, 2), "ratio_step_weight_read": round(ratio, 3)}
