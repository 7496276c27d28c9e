"""Kernel benchmark (CUDA): each Triton kernel against its baseline on the same data.

    headrace bench kernels [--contexts 2048 4096 8192] [--batch 64]

Baselines: paged decode / extend attention against `scaled_dot_product_attention` on the
same K/V laid out contiguously (flash backend where it takes the shape), the other kernels
against their torch references. Times are medians of `triton.testing.do_bench` (CUDA
events). Bandwidth counts the bytes a kernel must move at least (each input read once,
each output written once) and is given against a measured device-to-device copy and
against the datasheet peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
from headrace.kernels import AttentionMetadata, KernelSet, reference, triton_ops
from torch.nn.attention import SDPBackend, sdpa_kernel

#: Datasheet memory bandwidth, bytes/s, by a substring of the device name.
DATASHEET_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.04e12}


@dataclass(slots=True)
class Row:
    kernel: str
    shape: str
    ours_ms: float
    baseline: str
    baseline_ms: float
    num_bytes: int


def median_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def paged_decode_batch(
    batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A decode step of ``batch`` sequences of ``context`` tokens in shuffled blocks, and the
    same K/V contiguous ([B, Hkv, L, D]) for SDPA."""
    dtype = torch.bfloat16
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(
        num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda"
    )
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    gathered = cache[tables.long()]  # [B, nb, 2, bs, Hkv, D]
    flat = gathered.transpose(1, 2).reshape(
        batch, 2, blocks_per_seq * block_size, num_kv_heads, head_dim
    )
    key = flat[:, 0, :context].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    value = flat[:, 1, :context].transpose(1, 2).contiguous()
    query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
    seq_lens = [context] * batch
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long, device="cuda"),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables,
        num_decode_seqs=batch,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    return query, cache, metadata, key, value


def sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool
) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA on [B, H, Lq, D] / [B, Hkv, L, D] and the backend it runs: flash where flash
    takes the shape, else whichever backend PyTorch picks."""
    gqa = query.shape[1] != key.shape[1]

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal, enable_gqa=gqa)

    def flash() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return run()

    try:
        flash()
    except RuntimeError:
        return run, "sdpa (flash refused: default backend)"
    return flash, "sdpa flash"


def bench_decode(batch: int, context: int, heads: tuple[int, int, int], block_size: int) -> Row:
    num_heads, num_kv_heads, head_dim = heads
    query, cache, metadata, key, value = paged_decode_batch(
        batch, context, num_heads, num_kv_heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    ours = median_ms(lambda: triton_ops.paged_attention(query, cache, metadata, scale))
    got = triton_ops.paged_attention(query, cache, metadata, scale)
    baseline, label = sdpa(query.unsqueeze(2), key, value, causal=False)
    want = baseline()
    error = (got.float() - want.squeeze(2).float()).abs().max().item()
    assert error < 2e-2, f"decode attention differs from SDPA by {error}"
    num_bytes = 2 * key.numel() * key.element_size() + 2 * query.numel() * query.element_size()
    return Row(
        "decode attention",
        f"B={batch} L={context} H={num_heads}/{num_kv_heads} D={head_dim} bs={block_size}",
        ours,
        label,
        median_ms(baseline),
        num_bytes,
    )


def bench_prefill(num_seqs: int, length: int, heads: tuple[int, int, int]) -> Row:
    num_heads, num_kv_heads, head_dim = heads
    block_size = 16
    query, cache, metadata, key, value = paged_decode_batch(
        num_seqs, length, num_heads, num_kv_heads, head_dim, block_size
    )
    # Every sequence prefills all its tokens in this step.
    starts = [i * length for i in range(num_seqs + 1)]
    metadata = dataclasses.replace(
        metadata,
        num_decode_seqs=0,
        query_start_loc_cpu=starts,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"),
    )
    q = torch.randn(num_seqs * length, num_heads, head_dim, dtype=query.dtype, device="cuda")
    scale = head_dim**-0.5
    ours = median_ms(lambda: triton_ops.paged_attention(q, cache, metadata, scale))
    got = triton_ops.paged_attention(q, cache, metadata, scale)
    q4 = q.view(num_seqs, length, num_heads, head_dim).transpose(1, 2)
    baseline, label = sdpa(q4, key, value, causal=True)
    want = baseline().transpose(1, 2).reshape_as(got)
    error = (got.float() - want.float()).abs().max().item()
    assert error < 2e-2, f"prefill attention differs from SDPA by {error}"
    num_bytes = 2 * (q.numel() + key.numel()) * q.element_size() + q.numel() * q.element_size()
    return Row(
        "prefill attention",
        f"{num_seqs}x{length} tokens H={num_heads}/{num_kv_heads} D={head_dim}",
        ours,
        label,
        median_ms(baseline),
        num_bytes,
    )


def bench_small_kernels(num_tokens: int) -> list[Row]:
    dtype, hidden, heads, kv_heads, head_dim = torch.bfloat16, 4096, 32, 8, 128
    x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=dtype, device="cuda")
    size = x.element_size()
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device="cuda")
    q = qkv[:, : heads * head_dim].unflatten(-1, (heads, head_dim))
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    v = qkv[:, (heads + kv_heads) * head_dim :].unflatten(-1, (kv_heads, head_dim))
    angles = torch.randn(num_tokens, 1, head_dim, device="cuda")
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = torch.zeros(num_tokens // 16 + 1, 2, 16, kv_heads, head_dim, dtype=dtype, device="cuda")
    slots = torch.randperm(cache.shape[0] * 16, device="cuda")[:num_tokens]
    rows = []
    cases: list[tuple[str, str, Callable[[KernelSet], object], int]] = [
        (
            "add + rms_norm",
            f"T={num_tokens} hidden={hidden}",
            lambda m: m.rms_norm(x, weight, 1e-5, residual),
            5 * x.numel() * size,  # read x, residual; write sum, normed (+ weight, small)
        ),
        (
            "rotary",
            f"T={num_tokens} H={heads}/{kv_heads} D={head_dim}",
            lambda m: m.apply_rotary(q, k, cos, sin),
            2 * (q.numel() + k.numel()) * size + 2 * cos.numel() * size,
        ),
        (
            "kv-cache write",
            f"T={num_tokens} Hkv={kv_heads} D={head_dim}",
            lambda m: m.write_kv_cache(k, v, cache, slots),
            4 * k.numel() * size,
        ),
    ]
    for name, shape, call, num_bytes in cases:
        ours = median_ms(functools.partial(call, triton_ops))
        base = median_ms(functools.partial(call, reference))
        rows.append(Row(name, shape, ours, "torch reference", base, num_bytes))
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``headrace bench kernels`` (flags: --batch, --contexts); returns the summary."""
    if not torch.cuda.is_available():
        raise SystemExit("headrace bench kernels: needs a CUDA device")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy = copy_bandwidth()
    peak = next((bw for key, bw in DATASHEET_BANDWIDTH.items() if key in name), None)
    rows = []
    for heads in ((32, 8, 128), (9, 3, 64)):  # Llama-3-8B's attention; SmolLM2-135M's
        for context in args.contexts:
            rows.append(bench_decode(args.batch, context, heads, 16))
    rows.append(bench_decode(args.batch, 4096, (32, 8, 128), 32))
    rows.append(bench_decode(4, 32768, (32, 8, 128), 16))  # few long sequences: split-KV
    rows.append(bench_prefill(4, 2048, (32, 8, 128)))
    rows.extend(bench_small_kernels(4096))
    _print_table(name, copy, peak, rows)
    return {
        "bench": "kernels",
        "device": name,
        "copy_tb_s": round(copy / 1e12, 3),
        "rows": [
            {**dataclasses.asdict(row), "ratio_baseline": round(row.baseline_ms / row.ours_ms, 3)}
            for row in rows
        ],
    }


def _print_table(name: str, copy: float, peak: float | None, rows: list[Row]) -> None:
    print(f"device: {name}; copy bandwidth {copy / 1e12:.2f} TB/s", end="")
    print(f"; datasheet {peak / 1e12:.2f} TB/s" if peak else "")
    print(
        f"{'kernel':<18} {'shape':<40} {'ours ms':>8} {'base ms':>8} {'base/ours':>9} "
        f"{'TB/s':>6} {'%copy':>6} {'%peak':>6}  baseline"
    )
    for row in rows:
        bandwidth = row.num_bytes / (row.ours_ms * 1e-3)
        peak_share = f"{100 * bandwidth / peak:6.1f}" if peak else "     -"
        print(
            f"{row.kernel:<18} {row.shape:<40} {row.ours_ms:8.3f} {row.baseline_ms:8.3f} "
            f"{row.baseline_ms / row.ours_ms:9.2f} {bandwidth / 1e12:6.2f} "
            f"{100 * bandwidth / copy:6.1f} {peak_share}  {row.baseline}"
        )
