"""Random PEFT LoRA adapters for the tiny test checkpoints, and the transformers + PEFT oracle.

`build_adapter` makes a real PEFT adapter (``get_peft_model`` + ``save_pretrained``) whose A
and B are both random (PEFT starts B at zero, which would make every adapter a no-op), so an
adapter changes the tokens and two adapters differ from each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GenerationConfig

from tests.factories import load_hf_model

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    base: str | Path,
    path: str | Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    std: float = 0.15,
) -> Path:
    """A PEFT adapter of ``base`` with random A and B, saved into ``path``."""
    model = load_hf_model(base)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(path))
    return Path(path)


def _greedy(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            generated = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def hf_lora_greedy(
    base: str | Path,
    adapter: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    merged: bool = False,
) -> list[list[int]]:
    """transformers + PEFT greedy tokens with the adapter applied (or merged into W)."""
    model = PeftModel.from_pretrained(load_hf_model(base), str(adapter)).eval()
    if merged:
        model = model.merge_and_unload()
    return _greedy(model, prompts, max_new_tokens)
