"""`LLM`: the offline batch API (RLHF rollouts, evaluation).

llm = LLM("smollm2-135m-instruct")
results = llm.generate(["The capital of France is", [1, 504, 3458]], GenerationConfig())
answers = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]])
llm.update_weights(policy.named_parameters(), version="step-1")  # or a checkpoint folder

Generation control (RLHF): the same calls as the SDK's `Client`, in-process. `generate` runs
a batch to its end, so nothing is in flight between calls: `pause` only makes `generate`
refuse (UNAVAILABLE) until `resume`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError, UnavailableError
from headrace.sdk.outputs import Completion, GenerationResult
from headrace.sdk.prompts import Chat, ChatMessage, Messages, Prompt
from headrace.sdk.weights import PauseMode, pause_mode
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.weight_sync import (
    FromGroup,
    WeightGroupSpec,
    weight_source,
)
from headrace.worker.engine.engine import Engine
from headrace.worker.engine.outputs import RequestOutput
from headrace.worker.lora.manager import AdapterInfo
from headrace.worker.models.weight_check import TensorMeta

__all__ = ["LLM", "Completion", "GenerationResult", "apply_output"]


class LLM:
    """Loads a model once, then generates for batches of prompts."""

    def __init__(self, model: str, dtype: str = "auto", **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def close(self) -> None:
        """Stop the model's other ranks (tensor/pipeline parallel); a no-op on one rank."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        config: GenerationConfig | list[GenerationConfig] | None = None,
        *,
        priority: int = 0,
        adapter: str | list[str | None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text, token ids or a `Chat`); results come in prompt
        order. ``adapter``: a loaded LoRA adapter's name for every prompt, or one per prompt
        (None: the base model)."""
        if self.engine.control.pause_mode is not None:
            raise UnavailableError("generation is paused: call resume() first")
        batch = _as_batch(prompts)
        configs = _configs_for(batch, config)
        adapters = _adapters_for(batch, adapter)
        results: dict[str, GenerationResult] = {}
        try:
            for i, (prompt, prompt_config) in enumerate(zip(batch, configs, strict=True)):
                request_id = f"offline-{next(self._request_ids)}"
                self._add(i, request_id, prompt, prompt_config, priority, adapters[i])
                results[request_id] = GenerationResult.empty(
                    request_id,
                    prompt_config.n,
                    with_logprobs=prompt_config.logprobs is not None,
                    prompt_token_ids=self.engine.prompt_token_ids(request_id),
                )
            self._run(results)
        except BaseException:
            for request_id in results:
                self.engine.abort_request(request_id)
            raise
        return list(results.values())

    def chat(
        self,
        conversations: Messages | list[Messages],
        config: GenerationConfig | list[GenerationConfig] | None = None,
        *,
        priority: int = 0,
        add_generation_prompt: bool = True,
    ) -> list[GenerationResult]:
        """Answer each conversation (a list of ``{"role", "content"}`` messages, or one such
        list), rendered with the model's chat template; results come in order."""
        batch = cast(
            list[Messages],
            [conversations] if _is_single_conversation(conversations) else conversations,
        )
        chats: list[Prompt] = [Chat.of(messages, add_generation_prompt) for messages in batch]
        return self.generate(chats, config, priority=priority)

    def _add(
        self,
        index: int,
        request_id: str,
        prompt: Prompt,
        config: GenerationConfig,
        priority: int,
        adapter: str | None,
    ) -> None:
        try:
            self.engine.add_request(request_id, prompt, config, priority, adapter)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(exc.field, f"prompts[{index}]: {exc}") from exc

    def _run(self, results: dict[str, GenerationResult]) -> None:
        unfinished = set(results)
        while unfinished:
            for output in self.engine.step():
                apply_output(results[output.request_id], output)
                if output.finished:
                    unfinished.discard(output.request_id)

    # --- LoRA adapters (engine option enable_lora) ----------------------------------------

    def load_lora_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Load a PEFT LoRA adapter under ``name`` (requests then name it)."""
        return self.engine.load_lora_adapter(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self.engine.unload_lora_adapter(name)

    def list_lora_adapters(self) -> list[AdapterInfo]:
        return self.engine.lora_adapters()

    # --- generation control ------------------------------------------------------------

    def update_weights(
        self, weights: str | Path | Iterable[tuple[str, torch.Tensor]], version: str
    ) -> None:
        """Load new weights in place: a checkpoint folder, or (name, tensor) pairs named as
        in the checkpoint. Checked whole first: a missing, unknown or wrongly shaped tensor
        raises InvalidArgumentError naming it, and nothing changes."""
        self.engine.update_weights(weight_source(weights), version)

    def update_weights_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str
    ) -> None:
        """`update_weights` from (name, tensor) pairs."""
        self.engine.update_weights(weight_source(named_tensors), version)

    def init_weights_group(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> None:
        """Join a trainer's weights group (the trainer is rank 0 and hosts it at host:port)."""
        spec = WeightGroupSpec(host, port, world_size, rank_offset, backend, timeout_s)
        self.engine.join_weight_group(spec)

    def update_weights_from_group(
        self, tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], version: str
    ) -> None:
        """Receive the (name, dtype, shape) tensors the trainer broadcasts, in this order."""
        metas = tuple(TensorMeta(name, tuple(shape), dtype) for name, dtype, shape in tensors)
        self.engine.update_weights(FromGroup(metas), version)

    def pause(self, mode: str | PauseMode = PauseMode.ABORT) -> None:
        self.engine.pause_generation(pause_mode(mode))

    def resume(self) -> None:
        self.engine.resume_generation()

    def sleep(self, offload_weights: bool = False) -> None:
        """Release the KV cache (and, on a GPU, move the weights to host memory if asked)."""
        self.engine.sleep(offload_weights)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def weight_version(self) -> str:
        return self.engine.control.weight_version


def _is_single_conversation(conversations: Messages | list[Messages]) -> bool:
    """Whether ``conversations`` is one conversation: its first item is a message (or it has
    none, which `Chat` then refuses as an empty conversation)."""
    first = next(iter(conversations), None)
    return first is None or isinstance(first, ChatMessage | Mapping)


def apply_output(result: GenerationResult, output: RequestOutput) -> None:
    """Fold one engine step's output for a request into its result."""
    for delta in output.samples:
        result.add(delta)
    result.update(
        output.prompt_logprobs,
        output.usage,
        output.error,
        output.weight_version,
        output.first_prompt_token,
        output.prompt_text,
    )


def _as_batch(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Chat):
        return [prompts]
    if (
        isinstance(prompts, list | tuple)
        and prompts
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    ):
        return [[int(t) for t in prompts]]  # type: ignore[arg-type]  # one prompt of token ids
    if not isinstance(prompts, list | tuple) or not prompts:
        raise InvalidArgumentError("prompts", "must be a prompt or a non-empty list of prompts")
    return list(prompts)  # type: ignore[arg-type]


def _adapters_for(batch: list[Prompt], adapter: str | list[str | None] | None) -> list[str | None]:
    if not isinstance(adapter, list):
        return [adapter] * len(batch)
    if len(adapter) != len(batch):
        raise InvalidArgumentError(
            "adapter", f"has {len(adapter)} entries for {len(batch)} prompts"
        )
    return adapter


def _configs_for(
    batch: list[Prompt], config: GenerationConfig | list[GenerationConfig] | None
) -> list[GenerationConfig]:
    if config is None:
        return [GenerationConfig()] * len(batch)
    if isinstance(config, GenerationConfig):
        return [config] * len(batch)
    if len(config) != len(batch):
        raise InvalidArgumentError("config", f"got {len(config)} configs for {len(batch)} prompts")
    return list(config)
