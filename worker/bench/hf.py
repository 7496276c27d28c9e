"""transformers as the baseline: its padded batch `generate` and its continuous-batching
`generate_batch`, on the same prompts and the same number of new tokens as headrace."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from headrace.worker.bench.common import Report, Workload


def load_hf_model(model_path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval()
    # transformers fills a None eos_token_id back in from the model's own config: clear it
    # there so both baselines run every request to max_tokens, like ignore_eos does here.
    model.generation_config.eos_token_id = None
    return model


def run_hf_generate(model: Any, workload: Workload, pad_id: int) -> Report:
    """transformers' padded batch generate: all prompts left-padded into one batch."""
    max_tokens = _uniform_output_len(workload)
    width = max(len(p) for p in workload.prompts)
    input_ids = torch.full((len(workload.prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(workload.prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
        )
    seconds = time.perf_counter() - start
    num_tokens = (out.shape[1] - width) * out.shape[0]
    return Report("hf generate (padded)", seconds, num_tokens)


def run_hf_generate_batch(model: Any, workload: Workload) -> Report:
    """transformers' continuous batching: generate_batch."""
    from transformers import GenerationConfig as HFGenerationConfig

    config = HFGenerationConfig(
        max_new_tokens=_uniform_output_len(workload),
        do_sample=False,
        eos_token_id=None,
        use_cuda_graph=False,
    )
    start = time.perf_counter()
    # No inference_mode here: generate_batch runs its own thread and updates its cache in place.
    results = model.generate_batch(inputs=workload.prompts, generation_config=config)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(r.generated_tokens) for r in results.values())
    return Report("hf generate_batch", seconds, num_tokens)


def _uniform_output_len(workload: Workload) -> int:
    lengths = set(workload.max_tokens)
    if len(lengths) != 1:
        raise ValueError("the transformers baselines need one output length for all requests")
    return lengths.pop()
