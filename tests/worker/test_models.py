"""The Llama-family forward pass against transformers on the same tiny checkpoints.

Each step is run the way the model runner runs it: one flattened batch of several sequences,
a paged KV cache per layer, and block tables that scatter each sequence over random,
non-contiguous blocks, so a model that ignored the block table would read the wrong K/V.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from headrace.kernels import AttentionMetadata, select_kernels
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker import LLM
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from headrace.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from headrace.worker.layers.rotary import compute_inv_freq
from headrace.worker.models.config import ModelConfig
from headrace.worker.models.loader import CheckpointError
from headrace.worker.models.registry import UnsupportedModelError, load_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, GPT2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.factories import build_checkpoint, cached_checkpoint, hf_greedy, load_hf_model
from tests.kernels import needs_c_compiler

BLOCK_SIZE = 4
NUM_BLOCKS = 48
PROMPT_LENS = (5, 23, 12)
FP32_ATOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Far below max_position_embeddings, so all three wavelength bands occur at head_dim 16.
    "original_max_position_embeddings": 64,
}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0}
YARN_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}
YARN_ROPE_TRUNCATED = {**YARN_ROPE, "factor": 8.0, "truncate": True}
# Phi-3's longrope: a factor per frequency (head_dim 16: 8), the model 2x its original context.
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.2, 3.0, 4.0, 5.5, 7.0, 9.0],
    "original_max_position_embeddings": 256,
}


def variant(family: str, **kwargs: Any) -> Any:
    name = "-".join([family, *(f"{k}={v}" for k, v in kwargs.items() if k != "rope_scaling")])
    if "rope_scaling" in kwargs:
        name += "-" + kwargs["rope_scaling"]["rope_type"]
    return pytest.param(family, kwargs, id=name)


VARIANTS = [
    variant(family, tie_word_embeddings=tied, sharded=sharded)
    for family in ("llama", "mistral", "qwen2", "qwen3")
    for tied in (False, True)
    for sharded in (False, True)
] + [
    variant("llama", rope_scaling=LLAMA3_ROPE),
    variant("llama", rope_scaling=LINEAR_ROPE),
    # head_dim * num_heads != hidden_size: head_dim must come from the config.
    variant("qwen3", head_dim=32),
    # Mixtures of experts (tests/factories.py: 4-8 experts, top 2).
    variant("mixtral"),
    variant("qwen2_moe", sharded=True),
    variant("qwen3_moe", tie_word_embeddings=True),
    # Sliding windows shorter than the prompts: every layer, and alternating with full.
    variant("mistral", sliding_window=4),
    variant("qwen3", sliding_window=4),
    variant("qwen2_moe", sliding_window=4),
    # Gemma: sandwich norms, (1 + w) weights, scaled embeddings, GELU; Gemma 2's soft caps,
    # Gemma 3's q/k norms and two ropes (the full layers' scaled in one case).
    variant("gemma2"),
    variant("gemma3_text"),
    variant("gemma3_text", rope_scaling=LINEAR_ROPE),
    # Phi-3: fused q/k/v and gate/up in the checkpoint; a window; longrope.
    variant("phi3"),
    variant("phi3", sliding_window=4, sharded=True),
    variant("phi3", rope_scaling=LONGROPE),
    # GPT-OSS: sinks, biases, clamped SwiGLU experts, YaRN, alternating windows.
    variant("gpt_oss"),
    variant("gpt_oss", tie_word_embeddings=True, sharded=True),
]


# --- a paged batch, built the way the model runner builds one ------------------------------


@dataclass(slots=True)
class PagedSequences:
    """Sequences scattered over random KV blocks, with a cache tensor per layer."""

    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with block 0 (never used)
    kv_caches: list[torch.Tensor]

    @classmethod
    def allocate(cls, model: Any, max_lens: list[int], seed: int = 0) -> PagedSequences:
        generator = torch.Generator().manual_seed(seed)
        free = (1 + torch.randperm(NUM_BLOCKS - 1, generator=generator)).tolist()
        num_blocks = [-(-n // BLOCK_SIZE) for n in max_lens]
        tables = torch.zeros(len(max_lens), max(num_blocks), dtype=torch.int32)
        for i, n in enumerate(num_blocks):
            tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
        dtype = next(iter(model.parameters())).dtype
        shape = (NUM_BLOCKS, 2, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
        return cls(tables, caches)

    def step(self, model: Any, new_tokens: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run one step (sequence i gets new_tokens[i] at positions starts[i]...); decodes
        (one new token) must come first. Returns logits for every new token, [T, V]."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for i, (tokens, start) in enumerate(zip(new_tokens, starts, strict=True)):
            for pos in range(start, start + len(tokens)):
                block = int(self.block_tables[i, pos // BLOCK_SIZE])
                slots.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
                positions.append(pos)
            input_ids.extend(tokens)
        query_start_loc = [0]
        for tokens in new_tokens:
            query_start_loc.append(query_start_loc[-1] + len(tokens))
        seq_lens = [start + len(tokens) for tokens, start in zip(new_tokens, starts, strict=True)]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.block_tables[: len(new_tokens)],
            num_decode_seqs=next(
                (i for i, tokens in enumerate(new_tokens) if len(tokens) > 1), len(new_tokens)
            ),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_size=BLOCK_SIZE,
        )
        with torch.inference_mode():
            ids = torch.tensor(input_ids, dtype=torch.long)
            hidden = model(ids, torch.tensor(positions, dtype=torch.long), self.kv_caches, metadata)
            return model.compute_logits(hidden)


def make_prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


@functools.cache
def hf_model(path: Path, dtype: torch.dtype | None = None) -> Any:
    return load_hf_model(path, dtype)


def hf_logits(path: Path, token_ids: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(path, dtype)(torch.tensor([token_ids])).logits[0].float()  # [L, V]


def load(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return load_model(path, dtype, torch.device("cpu")).model


# --- logits against transformers ----------------------------------------------------------


@pytest.mark.parametrize(("family", "kwargs"), VARIANTS)
def test_prefill_then_decode_logits_match_transformers(family, kwargs):
    path = cached_checkpoint(family, **kwargs)
    model = load(path)
    prompts = make_prompts(model.vocab_size)
    paged = PagedSequences.allocate(model, [len(p) + 1 for p in prompts])

    logits = paged.step(model, prompts, [0, 0, 0])  # [sum(PROMPT_LENS), V]

    expected = torch.cat([hf_logits(path, p) for p in prompts])
    assert logits.dtype == torch.float32
    assert logits.shape == (sum(PROMPT_LENS), model.vocab_size)
    torch.testing.assert_close(logits, expected, atol=FP32_ATOL, rtol=0)

    next_tokens = [int(hf_logits(path, p)[-1].argmax()) for p in prompts]
    logits = paged.step(model, [[t] for t in next_tokens], [len(p) for p in prompts])

    expected = torch.stack(
        [hf_logits(path, p + [t])[-1] for p, t in zip(prompts, next_tokens, strict=True)]
    )
    torch.testing.assert_close(logits, expected, atol=FP32_ATOL, rtol=0)


def test_chunked_prefill_beside_a_decode_matches_transformers():
    path = cached_checkpoint("llama")
    model = load(path)
    short, long = make_prompts(model.vocab_size, (6, 20))
    paged = PagedSequences.allocate(model, [len(short) + 1, len(long)])
    paged.step(model, [short, long[:9]], [0, 0])

    # Sequence 0 decodes while sequence 1's second chunk attends to its cached first chunk.
    token = int(hf_logits(path, short)[-1].argmax())
    logits = paged.step(model, [[token], long[9:]], [len(short), 9])

    expected = torch.cat([hf_logits(path, short + [token])[-1:], hf_logits(path, long)[9:]])
    torch.testing.assert_close(logits, expected, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("checkpoint_dtype", [torch.float32, torch.bfloat16])
def test_bf16_load_matches_transformers_in_bf16(checkpoint_dtype):
    path = cached_checkpoint("qwen3", dtype=checkpoint_dtype, tie_word_embeddings=True)
    model = load(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompts = make_prompts(model.vocab_size)
    paged = PagedSequences.allocate(model, [len(p) for p in prompts])

    logits = paged.step(model, prompts, [0, 0, 0])

    expected = torch.cat([hf_logits(path, p, torch.bfloat16) for p in prompts])
    assert logits.dtype == torch.float32
    # bf16 keeps ~3 significant digits and logits here are O(5); fused projections round
    # differently, so this is the size of transformers' own bf16-vs-fp32 difference.
    torch.testing.assert_close(logits, expected, atol=0.15, rtol=0)
    assert (logits - expected).abs().mean() < 0.03


# --- tensor-parallel shards (no process group needed: only the loaders are exercised) ------


def ranks(size: int) -> list[ParallelConfig]:
    return [ParallelConfig(size, rank) for rank in range(size)]


@pytest.mark.parametrize("size", [2, 4])  # 4 > num_kv_heads: each KV head on two ranks
def test_qkv_shards_hold_each_ranks_heads(size):
    head_dim, num_heads, num_kv_heads, hidden = 2, 4, 2, 8
    full = {
        "q": torch.randn(num_heads * head_dim, hidden),
        "k": torch.randn(num_kv_heads * head_dim, hidden),
        "v": torch.randn(num_kv_heads * head_dim, hidden),
    }
    for parallel in ranks(size):
        layer = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, bias=False, parallel=parallel
        )
        for shard_id, weight in full.items():
            layer.weight_loader(layer.weight, weight, shard_id)
        q, k, v = (rows.T for rows in layer.split(layer.weight.data.T))
        rank, kv_rank = parallel.tensor_parallel_rank, layer.kv_head_index
        assert kv_rank == rank * num_kv_heads // size
        assert torch.equal(q, full["q"].chunk(size)[rank])
        assert torch.equal(k, full["k"].chunk(min(size, num_kv_heads))[kv_rank])
        assert torch.equal(v, full["v"].chunk(min(size, num_kv_heads))[kv_rank])


def test_merged_and_row_parallel_shards_reassemble_the_full_mlp():
    hidden, intermediate, size = 4, 6, 2
    gate, up, down = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    x = torch.randn(3, hidden)
    partial_sums = []
    for parallel in ranks(size):
        gate_up = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], bias=False, parallel=parallel
        )
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        row = RowParallelLinear(intermediate, hidden, bias=False, parallel=parallel)
        row.weight_loader(row.weight, down, None)
        g, u = gate_up(x).chunk(2, dim=-1)
        partial_sums.append((torch.nn.functional.silu(g) * u) @ row.weight.T)
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(sum(partial_sums), expected)


def test_vocab_shards_cover_the_vocab_once_with_zero_padding():
    vocab, dim, size = 10, 3, 4  # 3 rows per rank; the last rank holds 1 row + 2 padding
    full = torch.randn(vocab, dim)
    shards = []
    for parallel in ranks(size):
        embedding = VocabParallelEmbedding(vocab, dim, parallel=parallel)
        embedding.weight_loader(embedding.weight, full, None)
        shards.append(embedding.weight.data)
    padded = torch.cat(shards)
    assert torch.equal(padded[:vocab], full)
    assert not padded[vocab:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", [1, 5, 4500])  # 4500 rows: 6 calls of 838 rows
@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_c_compiler)])
def test_greedy_head_picks_the_argmax_of_the_logits(dtype, num_rows, backend):
    """The greedy head (logits a few rows at a time) chooses what an
    argmax of the whole logits chooses, ties included, with torch's matmul or the CPU
    backend's (whose few-row bf16 logits are float32, never rounded to bf16)."""
    kernels = select_kernels("cpu", torch.device("cpu")) if backend == "cpu" else None
    torch.manual_seed(3)
    vocab, dim = 5003, 32
    head = ParallelLMHead(vocab, dim, parallel=ParallelConfig(), dtype=dtype, kernels=kernels)
    weight = torch.randn(vocab, dim).to(dtype)
    weight[4000] = weight[17]  # the same logit for tokens 17 and 4000 in every row
    # Token 100 is token 50 with its largest weight a step larger: in row 1 it wins by less
    # than bf16's step at that logit, a tie if the logits were rounded to bf16.
    weight[100] = weight[50]
    largest = int(weight[50].argmax())
    weight[100, largest] = (weight[50, largest].float() * (1 + 2**-7)).to(dtype)
    head.weight_loader(head.weight, weight, None)
    hidden = torch.randn(num_rows, dim).to(dtype)
    hidden[0] = weight[17] * 4  # row 0's maximum is that tie: the first token wins
    if num_rows > 1:
        hidden[1] = weight[50] * 4
    with torch.inference_mode():
        want = head(hidden).argmax(dim=-1)
        got = head.greedy(hidden)
    assert got.tolist() == want.tolist()
    assert got[0] == 17


# --- rope ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope_scaling", [None, LLAMA3_ROPE, LINEAR_ROPE, YARN_ROPE, YARN_ROPE_TRUNCATED], ids=str
)
def test_inv_freq_equals_transformers_exactly(rope_scaling):
    hf_config = AutoConfig.from_pretrained(cached_checkpoint("llama", rope_scaling=rope_scaling))
    ours = compute_inv_freq(ModelConfig.from_hf(hf_config).rope)
    if rope_scaling is None:
        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](hf_config)
    assert torch.equal(ours, theirs)


# --- what the loader refuses --------------------------------------------------------------


def test_unsupported_model_type_names_it_and_the_supported_ones(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="gpt2") as info:
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert isinstance(info.value, InvalidArgumentError)
    assert info.value.field == "model"
    assert "llama" in str(info.value) and "qwen3" in str(info.value)


def hf_config_of(family: str, **kwargs: Any) -> Any:
    return AutoConfig.from_pretrained(cached_checkpoint(family, **kwargs))


@pytest.mark.parametrize(
    ("family", "window", "full_layers"),
    [
        ("mistral", 128, set()),  # every layer
        ("mixtral", 128, set()),
        ("qwen3_moe", 128, set()),
        ("qwen2", 128, {0}),  # layer_types: windows from max_window_layers on
        ("qwen2_moe", 128, {1}),  # ... and before it
        ("mistral", None, set()),
    ],
)
def test_sliding_windows_are_read_per_layer_as_transformers_reads_them(family, window, full_layers):
    config = ModelConfig.from_hf(hf_config_of(family, sliding_window=window))
    assert config.full_attention_layers == full_layers
    assert [config.window_of(i) for i in range(2)] == [
        None if i in full_layers else window for i in range(2)
    ]
    # Blocks behind a window are only given back where every layer keeps to it.
    assert config.kv_window == (window if not full_layers else None)


def test_a_window_no_sequence_can_outgrow_is_no_window():
    config = ModelConfig.from_hf(hf_config_of("mistral", sliding_window=512))
    assert config.sliding_window is None and config.kv_window is None


@pytest.mark.parametrize(
    "disabled", ["attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"]
)
def test_gemma2s_caps_and_scale_change_the_oracle(tmp_path, disabled):
    """The tiny Gemma 2's soft caps and score scale act: without each, transformers' own
    logits change (so the logits matched above test them)."""
    path = build_checkpoint(tmp_path, "gemma2")
    (prompt,) = make_prompts(256, (23,))
    with torch.inference_mode():
        expected = load_hf_model(path)(torch.tensor([prompt])).logits
        config = json.loads((path / "config.json").read_text())
        value = 256 if disabled == "query_pre_attn_scalar" else None
        (path / "config.json").write_text(json.dumps({**config, disabled: value}))
        changed = load_hf_model(path)(torch.tensor([prompt])).logits
    assert (changed - expected).abs().max() > 0.1


def test_a_longrope_model_runs_within_its_original_context(tmp_path):
    """Past it transformers rotates every token of a forward pass with the long factors, so
    a token's rotation would depend on its batch: the engine's context stops there."""
    path = build_checkpoint(tmp_path, "phi3", rope_scaling=LONGROPE)
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.spec.max_model_len == 256
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        LLM(str(path), dtype="float32", max_model_len=300)


def test_gpt_oss_as_released_in_mxfp4_is_refused_by_name(tmp_path):
    path = build_checkpoint(tmp_path, "gpt_oss")
    config = json.loads((path / "config.json").read_text())
    quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(UnsupportedModelError, match="mxfp4"):
        load(path)


def test_an_unknown_layer_type_is_refused_by_name(tmp_path):
    path = build_checkpoint(tmp_path, "qwen2", sliding_window=8)
    config = json.loads((path / "config.json").read_text())
    layer_types = ["chunked_attention", "sliding_attention"]
    (path / "config.json").write_text(json.dumps({**config, "layer_types": layer_types}))
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        load(path)


def test_checkpoint_missing_a_weight_is_refused_by_name(tmp_path):
    path = build_checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj"):
        load(path)


def test_checkpoint_with_an_extra_weight_is_refused_by_name(tmp_path):
    path = build_checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.0\.mystery"):
        load(path)


# --- the oracle itself ----------------------------------------------------------------------


def test_oracle_greedy_output_is_not_degenerate():
    path = cached_checkpoint("llama")
    prompts = make_prompts(load(path).vocab_size)
    for tokens in hf_greedy(path, prompts, 12):
        assert len(tokens) == 12
        assert len(set(tokens)) >= 4


def test_oracle_ignore_eos_runs_past_eos_and_otherwise_stops_there(tmp_path):
    path = build_checkpoint(tmp_path, "llama")
    prompt = make_prompts(512)[:1]
    full = hf_greedy(path, prompt, 10)[0]
    config = json.loads((path / "generation_config.json").read_text())
    eos = full[3]
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos}))

    assert hf_greedy(path, prompt, 10)[0] == full
    assert hf_greedy(path, prompt, 10, ignore_eos=False)[0] == full[: full.index(eos) + 1]
