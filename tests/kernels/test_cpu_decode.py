"""The decode step's layers in one C call (`cpu_decode`) against the layer-by-layer forward.

Both run the same C ops, so every value must match bit for bit: the same greedy tokens and
the same logprobs (floats compared exactly) in every dtype the kernels take, one row and
three, with grouped-query attention and a head size that is not a whole vector, with the KV
cache in the model's dtype or in int8, and 4- and 8-bit weights against int8 activations;
the prompts' steps too, whose chunks are short enough for the call. Steps it does not take
(more rows than the skinny matmul's, LoRA) keep to the per-op path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from headrace.kernels import cpu_decode
from headrace.sdk import GenerationConfig
from headrace.worker import Engine, EngineConfig
from headrace.worker.models import llama

from tests.factories import cached_checkpoint
from tests.kernels import needs_c_compiler

pytestmark = needs_c_compiler

PROMPTS = [[5, 9, 17, 33, 2], list(range(3, 40)), [7] * 20]


class Calls:
    """Counts decode_layers calls, and the rows of each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[int] = []
        inner = cpu_decode.decode_layers

        def counted(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
            self.rows.append(hidden.shape[0])
            return inner(hidden, *args)

        monkeypatch.setattr(cpu_decode, "decode_layers", counted)


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
    speculating sequence's proposals do); a step of more rows than the skinny matmul takes
    runs per op."""
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
    e.add_request("c", list(range(3, 3 + 200)), config)
    e.step()  # c's prompt: past the skinny matmul's rows, per op
    assert calls.rows == [5, 1, 38]
    e.close()


def test_models_it_does_not_serve_run_layer_by_layer(monkeypatch):
    """Biased projections (Qwen2) and q/k norm (Qwen3) keep to the per-op path."""
    calls = Calls(monkeypatch)
    for family in ("qwen2", "qwen3"):
        generate(str(cached_checkpoint(family=family, num_layers=2)), "float32", PROMPTS[:1])
    assert calls.rows == []
