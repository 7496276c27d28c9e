"""The default real model: headrace's greedy tokens equal transformers' on English prompts,
on the CPU (torch references) and, where a GPU is present, on CUDA with the Triton kernels."""

from __future__ import annotations

import pytest
import torch
from headrace.sdk import GenerationConfig
from headrace.worker import LLM
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "My favourite breakfast is",
]
MAX_TOKENS = 16


def transformers_greedy(model_dir, prompt_ids, device: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    expected = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
            )
            expected.append(out[0, len(ids) :].tolist())
    return expected


def test_smollm2_float32_greedy_equals_transformers(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = transformers_greedy(smollm2_dir, prompt_ids, "cpu")
    llm = LLM(str(smollm2_dir), dtype="float32", cpu_kv_cache_gib=0.25)
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate(PROMPTS, config)  # text prompts: tokenized by the engine
    assert [r.prompt_token_ids for r in results] == prompt_ids
    assert [r.token_ids for r in results] == expected
    for result in results:
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    # Real English came out, not noise.
    assert "Paris" in results[0].text


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: CI has none; run on a lent GPU (see the Triton kernels issue)",
)
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 8])
def test_smollm2_cuda_triton_greedy_equals_transformers(smollm2_dir, max_num_batched_tokens):
    """Triton kernels compiled on the GPU, float32: transformers on the same GPU is the
    oracle. A budget of 8 tokens a step chunks every prompt and mixes chunks with decodes."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = transformers_greedy(smollm2_dir, prompt_ids, "cuda")
    llm = LLM(
        str(smollm2_dir),
        dtype="float32",
        device="cuda",
        kernel_backend="triton",
        num_kv_blocks=256,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert llm.engine.kernels.NAME == "triton"
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate(PROMPTS, config)
    assert [r.token_ids for r in results] == expected
    assert "Paris" in results[0].text
