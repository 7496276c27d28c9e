"""Triton RMSNorm fused with the residual add before it: one read of x and residual, one
write of the sum and of the normalised row.

Rounding follows the reference (`headrace.kernels.reference.rms_norm`) step for step: the
sum is rounded to the activation dtype, statistics are float32, the normalised row is
rounded before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, hidden], contiguous rows
    residual_ptr,  # [N, hidden] or unused when HAS_RESIDUAL is false
    weight_ptr,  # [hidden]
    out_ptr,  # [N, hidden]: the normalised rows
    sum_ptr,  # [N, hidden]: x + residual, the next block's residual (HAS_RESIDUAL only)
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, x + residual)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    rows = x.reshape(-1, hidden).contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    total = torch.empty_like(rows) if residual is not None else rows
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            rows if residual is None else residual.reshape(-1, hidden).contiguous(),
            weight,
            out,
            total,
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=_num_warps(hidden),
        )
    if residual is None:
        return out.view(x.shape), x
    return out.view(x.shape), total.view(x.shape)


def _num_warps(hidden: int) -> int:
    """Enough threads that each holds at most ~8 elements of a row, within 1..16 warps."""
    return max(1, min(16, triton.next_power_of_2(hidden) // 256))
