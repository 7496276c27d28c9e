"""The default real model: headrace's greedy tokens equal transformers' on English prompts."""

from __future__ import annotations

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


def test_smollm2_float32_greedy_equals_transformers(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    expected = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
            )
            expected.append(out[0, len(ids) :].tolist())
    del model
    llm = LLM(str(smollm2_dir), dtype="float32", cpu_kv_cache_gib=0.25)
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate(PROMPTS, config)  # text prompts: tokenized by the engine
    assert [r.prompt_token_ids for r in results] == prompt_ids
    assert [r.token_ids for r in results] == expected
    for result in results:
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    # Real English came out, not noise.
    assert "Paris" in results[0].text
