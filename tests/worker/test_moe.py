"""Mixture-of-experts layers: routing as transformers routes, experts run grouped by expert
(once each over all their tokens), LoRA on the attention of a mixture, refused on its
experts; with the CPU kernels, a rank's experts in one C call, bit for bit the per-op path's.

The families' tokens against transformers run with the other families in
`test_engine_oracle.py` (every batch composition), `test_models.py` (logits) and
`test_parallel.py` (TP = 2, PP = 2).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from headrace.kernels import cpu_experts, cpu_ops, quantized, select_kernels
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.engine.llm import LLM
from headrace.worker.layers.linear import quantize_layers
from headrace.worker.layers.mlp import GatedMLP
from headrace.worker.layers.moe import MoeConfig, SparseMoe
from safetensors.torch import load_file, save_file

from tests.factories import cached_checkpoint
from tests.kernels import needs_c_compiler
from tests.lora_factories import build_adapter, hf_lora_greedy

HIDDEN = 16


def random_moe(moe: MoeConfig, seed: int = 0) -> SparseMoe:
    torch.manual_seed(seed)
    block = SparseMoe(
        HIDDEN,
        moe,
        ParallelConfig(),
        torch.float32,
        select_kernels("reference", torch.device("cpu")),
    )
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block


def per_token(block: SparseMoe, x: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time: sum of weight x expert(token) over its choices."""
    probs = torch.softmax(block.gate(x).double(), dim=-1)
    out = []
    for t in range(x.shape[0]):
        weights, experts = torch.topk(probs[t], block.moe.top_k)
        if block.moe.renormalize:
            weights = weights / weights.sum()
        row = sum(
            w * block.experts[int(e)](x[t : t + 1]).double()
            for w, e in zip(weights, experts, strict=True)
        )
        if block.shared_expert is not None and block.shared_expert_gate is not None:
            gate = torch.sigmoid(block.shared_expert_gate(x[t : t + 1]).double())
            row = row + gate * block.shared_expert(x[t : t + 1]).double()
        out.append(row)
    return torch.cat(out).float()


@pytest.mark.parametrize(
    "moe",
    [
        MoeConfig(num_experts=6, top_k=2, intermediate_size=8, renormalize=True),
        MoeConfig(num_experts=4, top_k=3, intermediate_size=8, renormalize=False),
        MoeConfig(4, 2, 8, renormalize=False, shared_intermediate_size=12),
    ],
    ids=["renormalised", "raw-weights", "shared-expert"],
)
def test_grouped_experts_equal_the_per_token_definition(moe: MoeConfig) -> None:
    block = random_moe(moe)
    x = torch.randn(37, HIDDEN)
    torch.testing.assert_close(block(x), per_token(block, x), atol=1e-5, rtol=1e-5)


def test_each_chosen_expert_runs_once_over_all_its_tokens() -> None:
    block = random_moe(MoeConfig(num_experts=8, top_k=2, intermediate_size=8, renormalize=True))
    rows_seen: list[int] = []
    for expert in block.experts:
        expert.register_forward_hook(lambda _m, args, _out: rows_seen.append(args[0].shape[0]))
    x = torch.randn(50, HIDDEN)
    _, experts = block.route(x)
    block(x)
    chosen = torch.bincount(experts.flatten(), minlength=8)
    assert rows_seen == [int(n) for n in chosen if n > 0]  # in expert order, one call each
    assert sum(rows_seen) == 50 * 2


PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 8, 9, 10, 11, 12, 13, 14], [33, 44]]


def test_lora_on_a_mixtures_attention_equals_peft(tmp_path) -> None:
    base = cached_checkpoint("qwen3_moe")
    adapter = build_adapter(base, tmp_path / "a", seed=3, targets=("q_proj", "v_proj", "o_proj"))
    greedy = GenerationConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(base), lora_modules=(("a", str(adapter)),)) as llm:
        got = [r.token_ids for r in llm.generate(PROMPTS, greedy, adapter="a")]
        plain = [r.token_ids for r in llm.generate(PROMPTS, greedy)]
    assert got == hf_lora_greedy(base, adapter, PROMPTS, 8)
    assert got != plain


def test_lora_on_a_mixtures_experts_is_refused_naming_the_module(tmp_path) -> None:
    """An adapter (in PEFT's per-module format) that adapts one expert's gate_proj."""
    base = cached_checkpoint("qwen3_moe")
    adapter = build_adapter(base, tmp_path / "a", seed=3, targets=("q_proj",))
    weights = load_file(adapter / "adapter_model.safetensors")
    expert = "base_model.model.model.layers.0.mlp.experts.1.gate_proj"
    weights[f"{expert}.lora_A.weight"] = torch.zeros(8, 64)
    weights[f"{expert}.lora_B.weight"] = torch.zeros(32, 8)
    save_file(weights, adapter / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "gate_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    message = r"targets model\.layers\.0\.mlp\.experts\.1\.gate_proj, which the model lacks"
    with pytest.raises(InvalidArgumentError, match=message):
        LLM(str(base), lora_modules=(("a", str(adapter)),))


# --- the CPU kernels' experts in one call (`headrace.kernels.cpu_experts`) ------------------


def cpu_moe(parallel: ParallelConfig, hidden: int = 64, seed: int = 0) -> SparseMoe:
    torch.manual_seed(seed)
    moe = MoeConfig(num_experts=8, top_k=2, intermediate_size=32, renormalize=True)
    cpu = select_kernels("cpu", torch.device("cpu"))
    block = SparseMoe(hidden, moe, parallel, torch.float32, cpu)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.5)
    return block


class OneCalls:
    """Counts `ExpertStack.run` calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        inner = cpu_experts.ExpertStack.run

        def counted(stack: cpu_experts.ExpertStack, *args: Any) -> None:
            self.count += 1
            inner(stack, *args)

        monkeypatch.setattr(cpu_experts.ExpertStack, "run", counted)


def one_call_and_per_op(block: SparseMoe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights, experts = block.route(x)
    one_call = block.run_experts(x, weights, experts)
    block.experts_in_one_call = False
    per_op = block.run_experts(x, weights, experts)
    block.experts_in_one_call = True
    return one_call, per_op


@needs_c_compiler
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["all-experts", "ep-rank-1"])
def test_cpu_experts_in_one_call_equal_the_per_op_path(
    monkeypatch: pytest.MonkeyPatch, expert_parallel: bool
) -> None:
    """Bit for bit, a rank 1 of 2 under expert parallelism running only its own experts."""
    parallel = ParallelConfig(2, 1, expert_parallel=True) if expert_parallel else ParallelConfig()
    block = cpu_moe(parallel)
    calls = OneCalls(monkeypatch)
    one_call, per_op = one_call_and_per_op(block, torch.randn(24, 64))
    assert calls.count == 1
    assert torch.equal(one_call, per_op)


@needs_c_compiler
def test_cpu_experts_follow_weights_written_in_place_or_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight update writes the parameters in place (the stack reads their pointers at
    each call); moving quantized weights replaces them (the stack is rebuilt)."""
    block, x = cpu_moe(ParallelConfig()), torch.randn(6, 64)
    calls = OneCalls(monkeypatch)
    one_call_and_per_op(block, x)
    with torch.no_grad():
        for param in block.experts.parameters():
            param.mul_(-2.0)
    one_call, per_op = one_call_and_per_op(block, x)
    assert torch.equal(one_call, per_op)
    quantize_layers(block, "int8")
    for mlp in block.experts.modules():
        if isinstance(mlp, GatedMLP):
            for layer in (mlp.gate_up_proj, mlp.down_proj):
                rows, cols = layer.weight.shape  # (per row, as "int8" holds them)
                layer.quantized = quantized.quantize(torch.randn(rows, cols), 8, cols)
    one_call, per_op = one_call_and_per_op(block, x)
    assert torch.equal(one_call, per_op)
    assert calls.count == 3


@needs_c_compiler
def test_cpu_experts_with_more_rows_than_the_skinny_matmul_keep_the_per_op_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    block, calls = cpu_moe(ParallelConfig()), OneCalls(monkeypatch)
    rows = 4 * cpu_ops.skinny_max_rows(torch.float32) + 1  # some expert draws more than that
    one_call, per_op = one_call_and_per_op(block, torch.randn(rows, 64))
    assert calls.count == 0
    assert torch.equal(one_call, per_op)
