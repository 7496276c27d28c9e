"""A mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS): a router sends
each token to its top-k experts, and the experts run grouped by expert.

Routing is transformers' exactly: router logits in the model's dtype, softmax in float32,
top-k, rescaled to sum to 1 where the family says so (Mixtral always, Qwen's
``norm_topk_prob``), cast back to the model's dtype. GPT-OSS's router has a bias and takes
the top-k logits first, then a softmax over those k in the logits' dtype; its experts have
biases and a clamped SwiGLU (`layers/mlp.py`). The experts then run grouped: the
(token, expert) pairs are sorted by expert, and each expert some token chose runs once over
all of its tokens (one gate/up and one down matmul, through the kernel set's linear layers
like any MLP), never a loop over tokens. Each expert's output, times its routing weight, is
added into its tokens' rows in expert order, as transformers adds them. Qwen2-MoE also runs a
shared expert over every token, scaled by sigmoid(shared_expert_gate(x)).

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension
(gate/up rows, down columns), as for a dense MLP; the router and the shared gate are whole on
every rank. A rank's block output is then a partial sum, linear in its experts' partials, so
the block costs one all-reduce, like the dense MLP. With expert parallelism
(`ParallelConfig.expert_parallel`) rank r instead holds experts [r E / T, (r + 1) E / T)
whole and runs only the (token, expert) pairs routed to them: every rank already has every
token (attention's all-reduce leaves them replicated), so no token moves, and the block's
one all-reduce sums the ranks' experts as it summed their slices. Each expert's matmuls are
then whole rather than 1 / T wide; a rank's share of the work is the share of the pairs its
experts drew. Experts take no LoRA adapters (the LoRA
manager skips them; an adapter naming one is refused as a module the model lacks).

With the CPU kernels a rank's plain experts (gated SiLU, no biases) run in one C call per
block where every expert's rows are few enough for the skinny matmul (a decode step's):
`headrace.kernels.cpu_experts`, the same ops as the per-op path, so the same bits, without
three kernel calls' overhead per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from headrace.kernels import KernelSet, cpu_experts
from headrace.worker.distributed.parallel import ParallelConfig, all_reduce
from headrace.worker.layers.mlp import GatedMLP
from headrace.worker.layers.weights import new_parameter
from torch import nn


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    #: Experts each token is sent to.
    top_k: int
    #: Each expert's intermediate size.
    intermediate_size: int
    #: Rescale each token's top-k routing weights to sum to 1.
    renormalize: bool
    #: The shared expert's intermediate size (Qwen2-MoE); 0: no shared expert.
    shared_intermediate_size: int = 0
    #: Layers that keep a dense MLP (Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``).
    dense_layers: frozenset[int] = field(default_factory=frozenset)
    #: GPT-OSS: the router has a bias and softmaxes the top-k logits alone (see the module
    #: note); the experts have biases and the activation `GatedMLP` names (clamped SwiGLU).
    softmax_after_top_k: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


class Gate(nn.Module):
    """A projection to a few logits, whole on every rank (the router's, one per expert; the
    shared expert's, one); biased only in GPT-OSS's router."""

    def __init__(
        self, num_outputs: int, hidden_size: int, dtype: torch.dtype, bias: bool = False
    ) -> None:
        super().__init__()
        self.weight = new_parameter((num_outputs, hidden_size), dtype)
        self.bias = new_parameter((num_outputs,), dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, num_outputs]
        return F.linear(x, self.weight, self.bias)


class SparseMoe(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        moe: MoeConfig,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
    ) -> None:
        super().__init__()
        self.moe = moe
        self.parallel = parallel
        self.gate = Gate(moe.num_experts, hidden_size, dtype, moe.router_bias)
        #: The experts this rank runs: all of them, or its block under expert parallelism.
        self.local_experts = range(moe.num_experts)
        expert_parallel = parallel.whole() if parallel.expert_parallel else parallel
        if parallel.expert_parallel:
            per_rank = moe.num_experts // parallel.tensor_parallel_size
            first = parallel.tensor_parallel_rank * per_rank
            self.local_experts = range(first, first + per_rank)
        # Another rank's expert is a placeholder: the list keeps the checkpoint's numbering.
        self.experts = nn.ModuleList(
            self._mlp(hidden_size, moe.intermediate_size, expert_parallel, dtype, kernels)
            if expert in self.local_experts
            else nn.Identity()
            for expert in range(moe.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Gate | None = None
        if moe.shared_intermediate_size:
            size = moe.shared_intermediate_size
            self.shared_expert = self._mlp(hidden_size, size, parallel, dtype, kernels)
            self.shared_expert_gate = Gate(1, hidden_size, dtype)
        #: Whether the local experts may run in one C call (`cpu_experts`); the stack is built
        #: at the first call, once the weights are loaded.
        plain = moe.activation == "silu" and not moe.expert_bias
        self.experts_in_one_call = kernels.NAME == "cpu" and plain
        self._expert_stack: cpu_experts.ExpertStack | None = None

    def _mlp(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
    ) -> GatedMLP:
        return GatedMLP(
            hidden_size,
            intermediate_size,
            bias=self.moe.expert_bias,
            parallel=parallel,
            dtype=dtype,
            kernels=kernels,
            reduce_results=False,  # the block all-reduces once, after every expert
            activation=self.moe.activation,
            swiglu_alpha=self.moe.swiglu_alpha,
            swiglu_limit=self.moe.swiglu_limit,
        )

    def holds_expert(self, expert: int) -> bool:
        """Whether this rank holds (and so loads) expert ``expert``'s weights."""
        return expert in self.local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        weights, experts = self.route(x)
        out = self.run_experts(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out, self.parallel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k] (in x's dtype)."""
        if self.moe.softmax_after_top_k:
            top_logits, experts = torch.topk(self.gate(x), self.moe.top_k, dim=-1)
            return torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype), experts
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def run_experts(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:  # [T, hidden]: sum over each token's experts of weight x expert(x)
        top_k = experts.shape[1]
        flat = experts.flatten()  # [T x k]: pair i is token i // k's (i % k)-th choice
        order = torch.argsort(flat, stable=True)  # the pairs grouped by expert, ascending
        tokens = order // top_k
        grouped = x[tokens]  # [T x k, hidden]: each expert's tokens contiguous, in order
        # (another rank's pairs stay zero: they add nothing here, their rank adds them)
        local = len(self.local_experts) == self.moe.num_experts
        outputs = torch.empty_like(grouped) if local else torch.zeros_like(grouped)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        if not self._run_in_one_call(grouped, counts, outputs):
            start = 0
            for expert, count in enumerate(counts):
                if count and expert in self.local_experts:
                    outputs[start : start + count] = self.experts[expert](
                        grouped[start : start + count]
                    )
                start += count
        outputs *= weights.flatten()[order].unsqueeze(1)
        # One add into the tokens' rows, pair by pair in expert order (transformers' order).
        return torch.zeros_like(x).index_add_(0, tokens, outputs)

    def _run_in_one_call(
        self,
        grouped: torch.Tensor,  # [T x k, hidden]: the pairs' rows, grouped by expert
        counts: list[int],  # [num_experts]: each expert's pairs
        outputs: torch.Tensor,  # [T x k, hidden]: the local experts' rows are written
    ) -> bool:
        """The local experts over their rows in one C call (`cpu_experts`), if it takes
        them; False: the caller runs them one by one."""
        stack = self._current_expert_stack(grouped.dtype)
        local = self.local_experts  # a contiguous block of experts, so of rows
        first = sum(counts[: local.start])
        rows = slice(first, first + sum(counts[local.start : local.stop]))
        local_counts = counts[local.start : local.stop]
        if stack is None or not stack.fits(grouped[rows], local_counts):
            return False
        stack.run(grouped[rows], local_counts, outputs[rows])
        return True

    def _current_expert_stack(self, dtype: torch.dtype) -> cpu_experts.ExpertStack | None:
        """The local experts' stack, built anew when their matrices are no longer the ones
        it holds (quantized weights moved wholesale); None where the experts are not plain.
        (Experts never carry LoRA adapters: the LoRA manager skips them.)"""
        if not self.experts_in_one_call:
            return None
        experts = [self.experts[e] for e in self.local_experts]
        mlps = [mlp for mlp in experts if isinstance(mlp, GatedMLP)]
        matrices = [(mlp.gate_up_proj.matrix(), mlp.down_proj.matrix()) for mlp in mlps]
        stack = self._expert_stack
        if stack is None or stack.dtype != dtype or not stack.holds(matrices):
            stack = self._expert_stack = cpu_experts.ExpertStack(matrices, dtype)
        return stack
