"""Which dtype a matmul computes in.

CPUs without native matrix instructions for a reduced dtype (bf16: AVX512-BF16 or AMX-BF16;
fp16: AVX512-FP16 or AMX-FP16) emulate its GEMM, 5-10x slower than fp32 GEMM on the same
core (measured on this project's AVX2 machines; fp16 on its AVX512-BF16 machine without
AVX512-FP16: 65 ms for 512 rows by a 1536x576 weight on one core, 15 ms widened to fp32,
5 ms in bf16). There the weights stay in the requested dtype in
memory and are widened to fp32 for each matmul only; outputs go back to the requested dtype,
so the KV cache and the activations between layers keep it. On CUDA, and on CPUs with native
support, matmuls run in the requested dtype.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

#: The CPU flags (any one) under which torch's GEMM of a reduced dtype is native.
_NATIVE_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16"}),
}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists flag (e.g. "amx_bf16") for this CPU."""
    return flag in _cpu_flags()


def cpu_has_native_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies dtype (bf16 or fp16) natively."""
    return bool(_cpu_flags() & _NATIVE_FLAGS[dtype])


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to run a matmul in for tensors stored as dtype on device."""
    if device.type == "cpu" and dtype in _NATIVE_FLAGS and not cpu_has_native_gemm(dtype):
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
