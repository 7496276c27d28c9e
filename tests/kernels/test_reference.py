"""The torch reference attention over a paged cache equals SDPA on contiguous K/V."""

import math

import pytest
import torch
import torch.nn.functional as F
from headrace.kernels import AttentionMetadata, paged_attention, write_kv_cache


def contiguous_attention(q, k, v, num_queries):
    """SDPA for one sequence: the last num_queries tokens attend causally to all of k/v."""
    seq_len = k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(seq_len - num_queries, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_sdpa(block_size, num_heads, num_kv_heads, dtype):
    torch.manual_seed(0)
    head_dim = 64
    # (context length after the step, new tokens): decodes first, then prefill chunks.
    seqs = [(1, 1), (17, 1), (33, 1), (20, 20), (37, 5)]
    num_decode = 3
    num_blocks = sum(math.ceil(n / block_size) for n, _ in seqs) + 3
    cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
    free = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables, ks, vs = [], [], []
    for seq_len, _ in seqs:
        tables.append([free.pop() for _ in range(math.ceil(seq_len / block_size))])
        ks.append(torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype))
        vs.append(torch.randn(seq_len, num_kv_heads, head_dim, dtype=dtype))
    # The cached prefix of every sequence is written first, as earlier steps would have.
    for table, k, v, (seq_len, num_new) in zip(tables, ks, vs, seqs, strict=True):
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        write_kv_cache(
            k[: seq_len - num_new], v[: seq_len - num_new], cache, slots[: seq_len - num_new]
        )
    qs = [torch.randn(n, num_heads, head_dim, dtype=dtype) for _, n in seqs]
    query_start_loc = [0]
    slots, new_k, new_v = [], [], []
    for table, k, v, (seq_len, num_new) in zip(tables, ks, vs, seqs, strict=True):
        query_start_loc.append(query_start_loc[-1] + num_new)
        for p in range(seq_len - num_new, seq_len):
            slots.append(table[p // block_size] * block_size + p % block_size)
        new_k.append(k[seq_len - num_new :])
        new_v.append(v[seq_len - num_new :])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = [n for n, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        num_decode_seqs=num_decode,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    write_kv_cache(torch.cat(new_k), torch.cat(new_v), cache, meta.slot_mapping)
    out = paged_attention(torch.cat(qs), cache, meta, scale=head_dim**-0.5)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (q, k, v, (_, num_new)) in enumerate(zip(qs, ks, vs, seqs, strict=True)):
        expected = contiguous_attention(q.float(), k.float(), v.float(), num_new)
        got = out[query_start_loc[i] : query_start_loc[i + 1]].float()
        torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
