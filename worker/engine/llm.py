"""`LLM`: the offline batch API (RLHF rollouts, evaluation).

llm = LLM("smollm2-135m-instruct")
results = llm.generate(["The capital of France is", [1, 504, 3458]], GenerationConfig())
answers = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]])
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, cast

from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.outputs import Completion, GenerationResult
from headrace.sdk.prompts import Chat, ChatMessage, Messages, Prompt
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine
from headrace.worker.engine.outputs import RequestOutput

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
    ) -> list[GenerationResult]:
        """Generate for every prompt (text, token ids or a `Chat`); results come in prompt
        order."""
        batch = _as_batch(prompts)
        configs = _configs_for(batch, config)
        results: dict[str, GenerationResult] = {}
        try:
            for i, (prompt, prompt_config) in enumerate(zip(batch, configs, strict=True)):
                request_id = f"offline-{next(self._request_ids)}"
                self._add(i, request_id, prompt, prompt_config, priority)
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
        self, index: int, request_id: str, prompt: Prompt, config: GenerationConfig, priority: int
    ) -> None:
        try:
            self.engine.add_request(request_id, prompt, config, priority)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(exc.field, f"prompts[{index}]: {exc}") from exc

    def _run(self, results: dict[str, GenerationResult]) -> None:
        unfinished = set(results)
        while unfinished:
            for output in self.engine.step():
                apply_output(results[output.request_id], output)
                if output.finished:
                    unfinished.discard(output.request_id)


def _is_single_conversation(conversations: Messages | list[Messages]) -> bool:
    """Whether ``conversations`` is one conversation: its first item is a message (or it has
    none, which `Chat` then refuses as an empty conversation)."""
    first = next(iter(conversations), None)
    return first is None or isinstance(first, ChatMessage | Mapping)


def apply_output(result: GenerationResult, output: RequestOutput) -> None:
    """Fold one engine step's output for a request into its result."""
    for delta in output.samples:
        result.add(delta)
    result.update(output.prompt_logprobs, output.usage, output.error)


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
