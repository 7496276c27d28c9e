"""The torch references are right: paged attention equals SDPA on contiguous K/V, RMSNorm
and rotary equal transformers' own Llama modules."""

import pytest
import torch
from headrace.kernels import reference
from headrace.worker.layers.rotary import RopeConfig, RotaryEmbedding
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tests.kernels.paged import build_paged_batch, contiguous_attention

# (context length after the step, new tokens): decodes first, then prefill chunks.
SEQS = [(1, 1), (17, 1), (33, 1), (20, 20), (37, 5)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_sdpa(block_size, num_heads, num_kv_heads, dtype):
    torch.manual_seed(0)
    batch = build_paged_batch(SEQS, 3, block_size, num_heads, num_kv_heads, 64, dtype)
    out = reference.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (_, num_new) in enumerate(SEQS):
        expected = contiguous_attention(batch.queries(i), batch.keys[i], batch.values[i], num_new)
        got = out[batch.metadata.query_start_loc_cpu[i] : batch.metadata.query_start_loc_cpu[i + 1]]
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


# Windows shorter than some prefixes, chunks and decodes, and one longer than every sequence.
WINDOW_SEQS = [(1, 1), (9, 1), (40, 1), (20, 20), (37, 5), (50, 3)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_attention_matches_sdpa_and_skips_freed_blocks(
    block_size, sliding_window, dtype
):
    torch.manual_seed(0)
    batch = build_paged_batch(
        WINDOW_SEQS, 3, block_size, 6, 2, 64, dtype, sliding_window=sliding_window
    )
    out = reference.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window
    )
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (_, num_new) in enumerate(WINDOW_SEQS):
        expected = contiguous_attention(
            batch.queries(i), batch.keys[i], batch.values[i], num_new, sliding_window
        )
        got = out[batch.metadata.query_start_loc_cpu[i] : batch.metadata.query_start_loc_cpu[i + 1]]
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_attention_matches_the_capped_scores(sliding_window, dtype):
    torch.manual_seed(0)
    batch = build_paged_batch(WINDOW_SEQS, 3, 4, 6, 2, 64, dtype, sliding_window=sliding_window)
    batch.query.mul_(8)  # scores well past the cap, so capping changes them
    out = reference.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, softcap=2.0
    )
    uncapped = reference.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window
    )
    assert not torch.allclose(out.float(), uncapped.float(), atol=0.1)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (_, num_new) in enumerate(WINDOW_SEQS):
        q = batch.queries(i)
        expected = contiguous_attention(
            q, batch.keys[i], batch.values[i], num_new, sliding_window, softcap=2.0
        )
        got = out[batch.metadata.query_start_loc_cpu[i] : batch.metadata.query_start_loc_cpu[i + 1]]
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (5, None), (5, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks_add_a_logit_to_each_heads_denominator(sliding_window, softcap, dtype):
    torch.manual_seed(0)
    batch = build_paged_batch(WINDOW_SEQS, 3, 4, 6, 2, 64, dtype, sliding_window=sliding_window)
    sinks = torch.tensor([-2.0, 0.0, 1.0, 3.0, 0.5, 6.0])  # (6.0: most of the mass)
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, softcap)
    out = reference.paged_attention(*args, sinks=sinks)
    assert not torch.allclose(out.float(), reference.paged_attention(*args).float(), atol=0.05)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (_, num_new) in enumerate(WINDOW_SEQS):
        expected = contiguous_attention(
            batch.queries(i),
            batch.keys[i],
            batch.values[i],
            num_new,
            sliding_window,
            softcap,
            sinks,
        )
        got = out[batch.metadata.query_start_loc_cpu[i] : batch.metadata.query_start_loc_cpu[i + 1]]
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(576))
    x, residual = torch.randn(2, 7, 576).to(dtype), torch.randn(2, 7, 576).to(dtype)
    normed, total = reference.rms_norm(x, hf.weight, 1e-5, residual)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, hf(x + residual))
    alone, same = reference.rms_norm(x, hf.weight, 1e-5)
    assert same is x
    assert torch.equal(alone, hf(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_transformers(dtype):
    torch.manual_seed(0)
    rope = RopeConfig(64, 4096, 500000.0, "llama3", factor=8.0, original_max_position=1024)
    cos, sin = RotaryEmbedding(rope)(torch.randint(0, 4096, (9,)), dtype)  # [T, 1, D]
    q, k = torch.randn(9, 6, 64).to(dtype), torch.randn(9, 2, 64).to(dtype)
    got_q, got_k = reference.apply_rotary(q, k, cos, sin)
    # transformers wants [B, H, T, D] and cos/sin [B, T, D].
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos.transpose(0, 1), sin.transpose(0, 1)
    )
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_cos_and_sin_are_transformers_in_each_dtype(dtype):
    """The tables cast once per dtype give, call after call, the values transformers computes
    per call in float32 and casts to the model's dtype."""
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=4096
    )
    ours = RotaryEmbedding(RopeConfig(64, 4096, 10000.0))
    theirs = LlamaRotaryEmbedding(config)
    for seed in range(3):  # the second call on reads the cast tables
        positions = torch.randint(0, 4096, (9,), generator=torch.Generator().manual_seed(seed))
        cos, sin = ours(positions, dtype)  # [T, 1, D]
        want_cos, want_sin = theirs(torch.zeros(1, 9, 1, dtype=dtype), positions[None])
        assert cos.dtype == sin.dtype == dtype and cos.shape == (9, 1, 64)
        assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0])
