"""A draft model that proposes for speculative decoding (`EngineConfig.speculative_model`).

A smaller checkpoint with the target's tokenizer, or the target itself quantized (its .gguf
file, say), runs as an engine of its own in the worker's process on a small KV pool: a
proposal is its greedy continuation of the sequence's tokens. Its prefix cache keeps the
sequence's full blocks from one step to the next, so a proposal costs the tail since the
last full block plus k - 1 decode steps of the draft. Greedy proposals are certain of their
token, so the target keeps them by the same rule as prompt lookup's
(`engine/speculation.py`), exact for greedy and sampled requests alike. Proposals are made
one sequence at a time: speculation runs in steps of a few decoding sequences.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol

from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Prompt
from headrace.worker.config import EngineConfig
from headrace.worker.engine.outputs import RequestOutput
from transformers import PreTrainedTokenizerBase

#: The draft engine's KV pool on a CPU (a few sequences' contexts; GPUs size it by memory).
DRAFT_KV_CACHE_GIB = 0.25


class DraftEngine(Protocol):
    """What the proposer needs of the draft's `Engine`."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def max_model_len(self) -> int: ...

    def add_request(self, request_id: str, prompt: Prompt, config: GenerationConfig) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def close(self) -> None: ...


def draft_config(config: EngineConfig) -> EngineConfig:
    """The draft engine's options: the target's device, dtype, kernels and threads, its own
    small KV pool, one sequence at a time, no speculation of its own."""
    assert config.speculative_model is not None
    return EngineConfig(
        model=config.speculative_model,
        quantization=config.speculative_quantization,
        dtype=config.dtype,
        device=config.device,
        kernel_backend=config.kernel_backend,
        cpu_kv_cache_gib=DRAFT_KV_CACHE_GIB,
        gpu_memory_utilization=config.gpu_memory_utilization,
        block_size=config.block_size,
        max_num_seqs=1,
        cpu_threads=config.cpu_threads,
        seed=config.seed,
    )


class DraftModelProposer:
    """A `Proposer` (`scheduling/proposals.py`) backed by a draft model's engine."""

    def __init__(self, engine: DraftEngine, target_tokenizer: PreTrainedTokenizerBase) -> None:
        if engine.tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise InvalidArgumentError(
                "speculative_model", "its tokenizer differs from the model's (ids must agree)"
            )
        self.engine = engine
        self._request_ids = itertools.count()
        self._config = GenerationConfig(max_tokens=1, temperature=0.0, ignore_eos=True)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(token_ids) + max_tokens > self.engine.max_model_len:
            return []
        config = dataclasses.replace(self._config, max_tokens=max_tokens)
        self.engine.add_request(f"draft-{next(self._request_ids)}", list(token_ids), config)
        proposed: list[int] = []
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                for delta in output.samples:
                    proposed.extend(delta.token_ids)
        return proposed

    def close(self) -> None:
        self.engine.close()
