"""``headrace bench lora``: throughput with many LoRA adapters in one batch, against the base
model alone.

    headrace bench lora                 # SmolLM2-135M-Instruct, 4 random rank-16 adapters
    headrace bench lora --tiny          # the tiny random model: what the LoRA path itself costs

Both runs generate the same workload (random prompts, every request to ``--max-tokens``,
greedy) in one process: the base model on an engine without LoRA, and the same requests on an
engine with ``--num-adapters`` random PEFT adapters of rank ``--rank`` (on q/k/v/o and
gate/up/down, written to a temporary folder here), request i using adapter i mod N, so every
step mixes all of them. Rounds alternate and the best of each counts (these machines are
noisy). ``ratio_lora`` is the LoRA run's tok/s over the base run's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from headrace.sdk.config import GenerationConfig
from headrace.sdk.prompts import Prompt
from headrace.worker.bench.common import (
    TINY_MODEL,
    Summary,
    build_tiny_checkpoint,
    make_workload,
)
from headrace.worker.engine.llm import LLM
from headrace.worker.models.store import DEFAULT_MODEL, resolve_model
from safetensors.torch import save_file
from transformers import AutoConfig

#: The projections every random adapter adapts.
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(args: argparse.Namespace) -> Summary:
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_path = build_tiny_checkpoint(Path(tmp) / "model", resolve_model(DEFAULT_MODEL))
            model_name = TINY_MODEL
        else:
            model_path = resolve_model(args.model)
            model_name = model_path.name
        adapters = [
            write_random_adapter(model_path, Path(tmp) / f"adapter{i}", args.rank, seed=i)
            for i in range(args.num_adapters)
        ]
        return _run(args, model_path, model_name, adapters)


def write_random_adapter(model_path: Path, directory: Path, rank: int, seed: int) -> Path:
    """A PEFT-format adapter (config + safetensors) with small random A and B on every
    projection of every layer."""
    config = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inner = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inner),
        "mlp.up_proj": (hidden, inner),
        "mlp.down_proj": (inner, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * 0.01
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    adapter_config["target_modules"] = list(_TARGETS)
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))
    return directory


def _run(
    args: argparse.Namespace, model_path: Path, model_name: str, adapters: list[Path]
) -> Summary:
    options: dict[str, Any] = {
        "device": "cpu",
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    base = LLM(str(model_path), args.dtype, **options)
    names = [f"adapter{i}" for i in range(len(adapters))]
    options["lora_modules"] = tuple((n, str(p)) for n, p in zip(names, adapters, strict=True))
    options.update(max_loras=len(adapters), max_lora_rank=args.rank)
    lora = LLM(str(model_path), args.dtype, **options)
    lengths = (args.prompt_len, args.prompt_len), (args.max_tokens, args.max_tokens)
    workload = make_workload(base.engine.vocab_size, args.num_requests, *lengths, args.seed)
    config = GenerationConfig(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    per_request: list[str | None] = [names[i % len(names)] for i in range(args.num_requests)]
    print(
        f"model {model_name}, {args.dtype}: {args.num_requests} requests of {args.prompt_len} "
        f"prompt + {args.max_tokens} new tokens; LoRA: {len(names)} adapters of rank "
        f"{args.rank} on q/k/v/o/gate/up/down, request i uses adapter i mod {len(names)}; "
        f"best of {args.rounds} rounds",
        flush=True,
    )
    best = {"base": float("inf"), "lora": float("inf")}
    for _ in range(args.rounds):
        runs: tuple[tuple[str, LLM, list[str | None] | None], ...] = (
            ("base", base, None),
            ("lora", lora, per_request),
        )
        for name, llm, adapter in runs:
            start = time.perf_counter()
            prompts: list[Prompt] = list(workload.prompts)
            llm.generate(prompts, config, adapter=adapter)
            best[name] = min(best[name], time.perf_counter() - start)
    base.close()
    lora.close()
    tok_s = {name: workload.num_output_tokens / seconds for name, seconds in best.items()}
    ratio = tok_s["lora"] / tok_s["base"]
    print(f"base model alone       {tok_s['base']:9.1f} tok/s")
    print(f"{len(names)} LoRA adapters mixed  {tok_s['lora']:9.1f} tok/s  ({ratio:.3f}x the base)")
    return {
        "base_tok_s": round(tok_s["base"], 1),
        "lora_tok_s": round(tok_s["lora"], 1),
        "ratio_lora": round(ratio, 3),
    }
