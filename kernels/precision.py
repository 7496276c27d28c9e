"""Which dtype a matmul computes in.

CPUs without native bf16 / fp16 matrix instructions (no AVX512-BF16, AVX512-FP16 or AMX)
emulate reduced-precision GEMM, 5-10x slower than fp32 GEMM on the same core (measured on
this project's AVX2 machines). There the weights stay in the requested dtype in memory and
are widened to fp32 for each matmul only; outputs go back to the requested dtype, so the KV
cache and the activations between layers keep it. On CUDA, and on CPUs with native support,
matmuls run in the requested dtype.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

_REDUCED = (torch.bfloat16, torch.float16)
_NATIVE_FLAGS = {"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}


@functools.cache
def cpu_has_native_reduced_gemm() -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return bool(flags & _NATIVE_FLAGS)


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to run a matmul in for tensors stored as dtype on device."""
    if device.type == "cpu" and dtype in _REDUCED and not cpu_has_native_reduced_gemm():
        return torch.float32
    return dtype


def linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, out] in out_dtype (default: x's dtype)
    """F.linear in compute_dtype(weight)."""
    out_dtype = out_dtype or x.dtype
    dtype = compute_dtype(weight.dtype, weight.device)
    if dtype == weight.dtype:
        return torch.nn.functional.linear(x, weight, bias).to(out_dtype)
    wide_bias = None if bias is None else bias.to(dtype)
    return torch.nn.functional.linear(x.to(dtype), weight.to(dtype), wide_bias).to(out_dtype)
