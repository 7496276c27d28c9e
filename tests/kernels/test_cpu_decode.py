"""The decode step's layers in one C call (`cpu_decode`) against the layer-by-layer forward.

Both run the same C ops, so every value must match bit for bit: the same greedy tokens and
the same logprobs (floats compared exactly) in every dtype the kernels take, one row and
three, with grouped-query attention and a head size that is not a whole vector, with the KV
cache in the model's dtype or in int8, and 4- and 8-bit weights against int8 activations;
the prompts' steps too, of up to a few hundred rows where the per-op path multiplies them
in C. Steps it does not take (more rows than that, LoRA) keep to the per-op path. Each
layer's own sliding window (a stack built from `DecoderLayerWeights` directly, against the
same ops called one by one) gives the per-op bits too, without reading the blocks freed
before the windows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from headrace.kernels import cpu_decode, cpu_ops
from headrace.kernels.attention import AttentionMetadata
from headrace.sdk import GenerationConfig
from headrace.worker import LLM, Engine, EngineConfig
from headrace.worker.models import llama
from safetensors.torch import load_file

from tests.factories import cached_checkpoint
from tests.kernels import needs_c_compiler
from tests.kernels.paged import build_paged_batch
from tests.kernels.test_cpu import poison_freed_int8_blocks

pytestmark = needs_c_compiler

PROMPTS = [[5, 9, 17, 33, 2], list(range(3, 40)), [7] * 20]
GREEDY = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)


class Calls:
    """Counts the one-call stack's calls (decode_layers, and greedy_runs: a step of greedy
    decodes, embedding to token), and the rows of each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        for name in ("decode_layers", "greedy_runs"):
            monkeypatch.setattr(cpu_decode, name, self._counted(getattr(cpu_decode, name)))

    def _counted(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def counted(rows: torch.Tensor, *args: Any) -> Any:  # hidden [T, hidden] or ids [T]
            self.rows.append(rows.shape[0])
            return inner(rows, *args)

        return counted


def generate(path: str, dtype: str, prompts: list[list[int]], **engine: Any) -> dict[str, Any]:
    """Each request's tokens and logprobs (every float of the top 3 per token)."""
    e = Engine(EngineConfig(path, dtype=dtype, kernel_backend="cpu", **engine))
    config = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(prompts):
        e.add_request(f"r{i}", prompt, config)
    results: dict[str, Any] = {}
    while e.has_unfinished_requests():
        for output in e.step():
            for sample in output.samples:
                got = results.setdefault(output.request_id, [])
                got.append((sample.token_ids, repr(sample.logprobs)))
    e.close()
    return results


def per_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama, "_decode_shape", lambda *args: None)


#: (dtype, engine options) of the cases: each dtype, the KV cache in int8, and 4- and 8-bit
#: weights against int8 activations.
CASES = [
    ("float32", {}),
    ("bfloat16", {}),
    ("float16", {}),
    ("float32", dict(kv_cache_dtype="int8")),
    ("bfloat16", dict(kv_cache_dtype="int8")),
    ("float32", dict(quantization="int4", int8_activations=True)),
    ("float32", dict(quantization="int8", int8_activations=True)),
]


@pytest.mark.parametrize(("dtype", "engine"), CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", ["gqa", "odd-head-dim"])
def test_decode_in_one_call_is_the_per_op_forward_bit_for_bit(monkeypatch, dtype, engine, shape):
    kwargs = dict(num_heads=4, num_kv_heads=2) if shape == "gqa" else dict(head_dim=24)
    path = str(cached_checkpoint(family="llama", num_layers=3, **kwargs))
    with monkeypatch.context() as patch:
        calls = Calls(patch)
        fused = generate(path, dtype, PROMPTS, **engine)
        alone = generate(path, dtype, PROMPTS[1:2], **engine)
    assert calls.rows and set(calls.rows) >= {1, 3}  # batches of three, and one alone
    per_op(monkeypatch)
    assert fused == generate(path, dtype, PROMPTS, **engine)
    assert alone == generate(path, dtype, PROMPTS[1:2], **engine)


def test_short_chunks_run_in_the_call_and_long_steps_layer_by_layer(monkeypatch):
    """A short prompt's chunk, alone or beside a decode, runs in the one call (as a
    speculating sequence's proposals do); a step of more rows than the per-op path
    multiplies in C (float32: `skinny_max_rows`) runs per op."""
    path = str(cached_checkpoint(family="llama", num_layers=2))
    calls = Calls(monkeypatch)
    e = Engine(EngineConfig(path, dtype="float32", kernel_backend="cpu"))
    config = GenerationConfig(max_tokens=4, temperature=0.0, ignore_eos=True)
    e.add_request("a", PROMPTS[0], config)
    e.step()  # a's prompt: 5 rows
    e.step()  # a decodes alone
    assert calls.rows == [5, 1]
    e.add_request("b", PROMPTS[1], config)
    e.step()  # b's 37-token prompt beside a's decode
    assert calls.rows == [5, 1, 38]
    limit = cpu_ops.skinny_max_rows(torch.float32)
    e.add_request("c", list(range(100, 100 + limit)), config)  # no cached prefix
    e.step()  # c's prompt beside two decodes: past the C matmul's rows, per op
    assert calls.rows == [5, 1, 38]
    e.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_steps_of_hundreds_of_rows_run_in_the_call_where_the_per_op_path_is_c(
    monkeypatch, dtype
):
    """A step with a 150-token prompt beside the others' (212 rows) runs in one call in
    float32 where the per-op path's C matmul takes that many rows (AVX-512's tiles: up to
    FLOAT32_MAX_ROWS) and in bf16 where the weights have panels (which it multiplies at any
    row count), else per op; either way the tokens and logprobs are the per-op forward's, bit
    for bit."""
    path = str(cached_checkpoint(family="llama", num_layers=3, num_heads=4, num_kv_heads=2))
    prompts = [*PROMPTS, list(range(3, 153))]
    with monkeypatch.context() as patch:
        calls = Calls(patch)
        fused = generate(path, dtype, prompts)
    num_prompt_rows = sum(len(p) for p in prompts)
    in_call = cpu_ops.wide_tiles() if dtype == "float32" else cpu_ops.makes_panels()
    assert (num_prompt_rows in calls.rows) == in_call
    per_op(monkeypatch)
    assert fused == generate(path, dtype, prompts)


def test_the_pointer_table_is_made_once_and_again_after_a_weight_update(monkeypatch):
    """The stack keeps its table of pointers from step to step (making it looks up every
    weight's panels), and makes it again once a weight is written through its parameter, so
    bf16 weights' panels are packed again and the new weights' tokens come out."""
    num_layers = 3
    a, b = (cached_checkpoint("llama", num_layers=num_layers, seed=seed) for seed in (0, 1))
    want = {}
    for name, path in (("a", a), ("b", b)):
        with LLM(str(path), dtype="bfloat16", kernel_backend="cpu") as llm:
            want[name] = llm.generate(PROMPTS, GREEDY)[0].token_ids
    assert want["a"] != want["b"]
    looked_up: list[cpu_decode.Matrix] = []
    inner = cpu_decode.matrix_pointers
    monkeypatch.setattr(cpu_decode, "matrix_pointers", lambda m: looked_up.append(m) or inner(m))
    one_table = 4 * num_layers  # qkv, o, gate/up and down of each layer
    with LLM(str(a), dtype="bfloat16", kernel_backend="cpu") as llm:
        assert llm.generate(PROMPTS, GREEDY)[0].token_ids == want["a"]
        assert llm.generate(PROMPTS, GREEDY)[0].token_ids == want["a"]
        assert len(looked_up) == one_table  # two generations' steps, one table
        tensors = list(load_file(str(b / "model.safetensors")).items())
        llm.update_weights_from_tensors(tensors, version="b")
        assert llm.generate(PROMPTS, GREEDY)[0].token_ids == want["b"]
        assert len(looked_up) == 2 * one_table


def test_models_it_does_not_serve_run_layer_by_layer(monkeypatch):
    """Biased projections (Qwen2) and q/k norm (Qwen3) keep to the per-op path."""
    calls = Calls(monkeypatch)
    for family in ("qwen2", "qwen3"):
        generate(str(cached_checkpoint(family=family, num_layers=2)), "float32", PROMPTS[:1])
    assert calls.rows == []


# --- per-layer sliding windows -----------------------------------------------------------------

WINDOW_SHAPE = cpu_decode.DecoderShape(
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    eps=1e-5,
    scale=16**-0.5,
)
#: Four decodes (contexts shorter and longer than the windows) and a 3-token chunk: 7 rows.
WINDOW_SEQS = [(1, 1), (9, 1), (23, 1), (40, 1), (12, 3)]


def random_layer(sliding_window: int | None, dtype: torch.dtype) -> cpu_decode.DecoderLayerWeights:
    shape = WINDOW_SHAPE
    hidden, inter = shape.hidden_size, shape.intermediate_size
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols) * cols**-0.5).to(dtype)

    return cpu_decode.DecoderLayerWeights(
        input_norm=(1 + 0.1 * torch.randn(hidden)).to(dtype),
        qkv=matrix(qkv_rows, hidden),
        o_proj=matrix(hidden, shape.num_heads * shape.head_dim),
        post_norm=(1 + 0.1 * torch.randn(hidden)).to(dtype),
        gate_up=matrix(2 * inter, hidden),
        down=matrix(hidden, inter),
        sliding_window=sliding_window,
    )


def per_op_layers(
    hidden: torch.Tensor,  # [T, hidden]
    stack: cpu_decode.DecoderStack,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_caches: list[torch.Tensor],
    metadata: AttentionMetadata,
) -> torch.Tensor:  # [T, hidden]: the final norm's output
    """The stack's layers as the model runs them op by op (each a `cpu_ops` kernel call)."""
    shape, num_tokens = stack.shape, hidden.shape[0]
    q_cols = shape.num_heads * shape.head_dim
    kv_cols = shape.num_kv_heads * shape.head_dim
    residual = None
    for layer, cache in zip(stack.layers, kv_caches, strict=True):
        normed, residual = cpu_ops.rms_norm(hidden, layer.input_norm, shape.eps, residual)
        qkv = cpu_ops.linear(normed, layer.qkv)
        query = qkv[:, :q_cols].view(num_tokens, shape.num_heads, shape.head_dim)
        key = qkv[:, q_cols : q_cols + kv_cols].view(num_tokens, -1, shape.head_dim)
        value = qkv[:, q_cols + kv_cols :].view(num_tokens, -1, shape.head_dim)
        query, key = cpu_ops.apply_rotary(query, key, cos, sin)
        cpu_ops.write_kv_cache(key, value, cache, metadata.slot_mapping)
        attention = cpu_ops.paged_attention(
            query, cache, metadata, shape.scale, layer.sliding_window
        )
        hidden = cpu_ops.linear(attention.view(num_tokens, q_cols), layer.o_proj)
        normed, residual = cpu_ops.rms_norm(hidden, layer.post_norm, shape.eps, residual)
        hidden = cpu_ops.linear(
            cpu_ops.silu_and_mul(cpu_ops.linear(normed, layer.gate_up)), layer.down
        )
    out, _ = cpu_ops.rms_norm(hidden, stack.final_norm, shape.eps, residual)
    return out


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.int8)],
    ids=str,
)
@pytest.mark.parametrize("windows", [(None, 3, None, 8), (3, 8, 5, 8)], ids=str)
@pytest.mark.parametrize("block_size", [1, 4])
def test_per_layer_sliding_windows_in_one_call_are_the_per_op_forward_bit_for_bit(
    block_size, windows, dtype, kv_cache_dtype
):
    """Each layer attends within its own window in the call as in its per-op kernel call.
    Where every layer has a window, the blocks before the widest one are freed (poisoned:
    NaN in them would reach the output); beside a layer with none, no block is."""
    torch.manual_seed(block_size)
    widest = None if None in windows else max(windows)  # what frees blocks, if any does
    batch = build_paged_batch(
        WINDOW_SEQS,
        4,
        block_size,
        WINDOW_SHAPE.num_heads,
        WINDOW_SHAPE.num_kv_heads,
        WINDOW_SHAPE.head_dim,
        dtype,
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=widest,
    )
    if kv_cache_dtype == torch.int8 and widest is not None:
        poison_freed_int8_blocks(batch, widest)
    layers = [random_layer(window, dtype) for window in windows]
    final_norm = (1 + 0.1 * torch.randn(WINDOW_SHAPE.hidden_size)).to(dtype)
    stack = cpu_decode.DecoderStack(layers, final_norm, WINDOW_SHAPE)
    num_tokens = batch.query.shape[0]
    hidden = torch.randn(num_tokens, WINDOW_SHAPE.hidden_size).to(dtype)
    angles = torch.randn(num_tokens, 1, WINDOW_SHAPE.head_dim // 2)
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))

    def run(stack: cpu_decode.DecoderStack, one_call: bool) -> torch.Tensor:
        caches = [batch.kv_cache.clone() for _ in layers]  # each layer's, written as it runs
        if one_call:
            assert stack.fits(hidden.shape[0], hidden.dtype, caches, batch.metadata)
            return stack.decode(hidden, cos, sin, caches, batch.metadata)
        return per_op_layers(hidden, stack, cos, sin, caches, batch.metadata)

    fused = run(stack, one_call=True)
    assert not fused.isnan().any()
    assert torch.equal(fused, run(stack, one_call=False))
    unwindowed = [dataclasses.replace(layer, sliding_window=None) for layer in layers]
    everything = cpu_decode.DecoderStack(unwindowed, final_norm, WINDOW_SHAPE)
    assert not torch.equal(fused, run(everything, one_call=True))  # the windows hide keys
