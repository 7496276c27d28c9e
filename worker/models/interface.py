"""The model interface: what the model runner, the KV-cache sizing and the loader need of a
model. Models implement it; the runner imports it, never a model, and models never import the
runner or the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from headrace.kernels import AttentionMetadata
from headrace.worker.layers.weights import LoadedTensor


class CausalLM(Protocol):
    #: Layers, KV heads and hidden size held by this rank (its pipeline stage and TP shard).
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int
    #: The sliding window every layer of the whole model keeps to (the KV behind a
    #: sequence's window is never read again); None where some layer sees everything.
    kv_window: int | None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        carry: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def watch_layers(self, between: Callable[[float], None]) -> None:
        """Call ``between(progress)`` between two of this rank's decoder layers in every
        forward, progress the share of them run (the thread governor's look in a long step)."""
        ...

    def decode_greedy_runs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        later_slots: list[list[int]],
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> list[list[int]] | None:
        """A step of greedy one-row decodes (every row one sequence's decode): its first run
        (``input_ids`` at ``positions``, as ``attn_metadata`` says), then a multi-step
        decode's later runs, each one position on, its inputs the tokens the run before drew,
        written into its ``later_slots``. Their greedy tokens, [runs][rows], computed in one
        call where the model can, each the token `__call__` and `compute_greedy` would draw;
        None where it cannot (the runner then runs them from Python)."""
        ...


class LoadableModel(CausalLM, Protocol):
    """A model as the registry builds it and the runner holds it: weights loaded at start,
    and loaded again in place by weight updates."""

    def load_weights(
        self, tensors: Iterable[tuple[str, LoadedTensor]], complete: bool = True
    ) -> None:
        """Copy ``tensors`` (checkpoint names) into the parameters, in place; with
        ``complete`` every parameter must be filled."""
        ...

    def eval(self) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...
