"""torch's CPU GEMM with each weight packed once, for the rows the C matmul does not take.

``torch.nn.functional.linear`` on a CPU hands the weight to the BLAS as it lies in memory,
and the BLAS packs it into its blocked layout on every call: at a decode step's 64 rows that
copy was a fifth of the step (MKL's ``sgemm_scopy``). oneDNN's linear (the one torch's own
compiler uses after freezing, and vLLM's CPU backend) takes the weight packed once. Measured
2026-11-24 on the 2-core Zen 4 machine (AVX512-BF16, no AMX), SmolLM2-135M's four layer
matmuls per call, unpacked vs packed:

| rows | float32 | bfloat16 | LM head float32 |
|---|---|---|---|
| 64 | 3.00 vs 2.32 ms | 1.65 vs 1.18 | 38.7 vs 20.3 |
| 512 | 22.6 vs 19.4 | 9.6 vs 8.8 | |
| 2048 | 84.1 vs 72.0 | 38.7 vs 35.2 | |

The packed copy belongs to its parameter: kept in a table keyed weakly by the parameter's
identity (it goes when the parameter does) and packed again when the parameter's version
counter moves, which every in-place write through the parameter bumps (the weight loaders
write through the parameter, never its ``.data``, for this). It is a second copy of the
weight in memory. Only parameters are packed (a tensor made per call would be packed per
call), only in a dtype the CPU multiplies natively (`precision.compute_dtype`), and only
where torch was built with oneDNN; anything else goes to `precision.linear` as before. The
sums differ from the unpacked GEMM's in the last bits (float32 ~1e-6 relative), and like it
a row's result may depend on how many rows the call has.

oneDNN compiles and keeps a kernel per weight and row count (about 190 KB each): a worker
whose steps had every row count from 49 to 1500 grew by 400 MB in the soak test. So a call's
rows are padded with zero rows up to one of a few sizes (`bucket_rows`: multiples of 16 up
to 64, then four sizes per doubling, at most a quarter more rows), and the padding's outputs
are dropped: 32 sizes up to 8192 rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from headrace.kernels.precision import compute_dtype
from headrace.kernels.precision import linear as unpacked_linear
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

#: Rows the packing is tuned for: oneDNN picks its blocking from it. 16 to 2048 all measured
#: within 5% of each other at every row count from 16 to 2048 (a hint of 1 was up to 2x slower).
PACK_ROWS_HINT = 64
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PerParameter:
    """A copy each parameter has made of it (``make(parameter, previous)``), kept in a table
    keyed weakly by the parameter's identity (it goes when the parameter does) and made again
    when the parameter's data pointer or version counter moves (every in-place write through
    it); ``previous`` is the copy it replaces (None the first time), which make may refill."""

    def __init__(self, make: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> None:
        self._make = make
        #: parameter -> ((its data pointer, its version), its copy)
        self._copies: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __call__(self, parameter: torch.Tensor) -> torch.Tensor:
        stamp = (parameter.data_ptr(), parameter._version)
        entry = self._copies.get(parameter)
        if entry is None or entry[0] != stamp:
            previous = None if entry is None else entry[1]
            entry = self._copies[parameter] = (stamp, self._make(parameter, previous))
        return entry[1]


def available() -> bool:
    """Whether this torch has oneDNN's packed linear."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies x by weight's packed copy."""
    return (
        isinstance(weight, nn.Parameter)
        and weight.device.type == "cpu"
        and weight.dtype in _PACKED_DTYPES
        and x.dtype == weight.dtype
        and x.dim() == 2
        and compute_dtype(weight.dtype, weight.device) == weight.dtype
        and _AVAILABLE
    )


def linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, out] in out_dtype (default: x's dtype)
    """x Wᵀ + b by oneDNN on weight's packed copy where `packs`, else `precision.linear`."""
    if not packs(x, weight):
        return unpacked_linear(x, weight, bias, out_dtype)
    if bias is not None:
        bias = bias.to(weight.dtype)
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        whole = x.new_empty((padded, x.shape[1]))
        whole[:rows].copy_(x)
        whole[rows:].zero_()
        x = whole
    out = torch.ops.mkldnn._linear_pointwise(x, packed_copy(weight), bias, "none", [], "")
    return out[:rows].to(out_dtype or x.dtype)


def bucket_rows(rows: int) -> int:
    """The row count a call of ``rows`` rows is padded to."""
    if rows <= 64:
        return -(-rows // 16) * 16
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


#: weight in oneDNN's blocked layout, packed on first use and again after a write.
packed_copy = PerParameter(
    lambda weight, _: torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
)


_AVAILABLE = available()
