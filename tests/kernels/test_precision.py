"""Which dtype a CPU matmul computes in follows the CPU's native instructions per dtype: an
AVX512-BF16 CPU without AVX512-FP16 (this project's 2-core machine) widens fp16 to fp32."""

from __future__ import annotations

import pytest
import torch
from headrace.kernels import precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("flags", "bf16_in", "fp16_in"),
    [
        (set(), torch.float32, torch.float32),
        ({"avx512_bf16"}, torch.bfloat16, torch.float32),
        ({"amx_bf16", "avx512_fp16"}, torch.bfloat16, torch.float16),
        ({"avx512_fp16"}, torch.float32, torch.float16),
    ],
)
def test_reduced_dtypes_compute_natively_only_with_their_own_instructions(
    monkeypatch, flags, bf16_in, fp16_in
):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset(flags))
    assert precision.compute_dtype(torch.bfloat16, CPU) == bf16_in
    assert precision.compute_dtype(torch.float16, CPU) == fp16_in
    assert precision.compute_dtype(torch.float32, CPU) == torch.float32
    assert precision.compute_dtype(torch.float16, torch.device("meta")) == torch.float16
