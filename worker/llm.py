"""`LLM`: the offline batch API (RLHF rollouts, evaluation).

llm = LLM("smollm2-135m-instruct", dtype="bfloat16")
results = llm.generate(["Hello", "The capital of France is"], GenerationConfig(max_tokens=32))
print(results[0].text)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InvalidArgumentError
from headrace.worker.config import EngineConfig
from headrace.worker.engine import Engine, Prompt, RequestOutput
from headrace.worker.outputs import TokenLogprob, Usage
from headrace.worker.sequence import FinishReason


@dataclass(slots=True)
class Completion:
    """One sample's whole output."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    #: Per generated token, when config.logprobs was set.
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class GenerationResult:
    """One prompt's result; token_ids / text / finish_reason / logprobs are sample 0's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    usage: Usage = field(default_factory=Usage)
    prompt_logprobs: list[TokenLogprob] | None = None
    error: HeadraceError | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    def apply(self, output: RequestOutput) -> None:
        """Fold one streaming delta into the result."""
        for delta in output.samples:
            completion = self.outputs[delta.index]
            completion.token_ids.extend(delta.token_ids)
            completion.text += delta.text
            if completion.logprobs is not None:
                completion.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                completion.finish_reason = delta.finish_reason
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.usage is not None:
            self.usage = output.usage
        if output.error is not None:
            self.error = output.error


class LLM:
    """Loads a model once, then generates for batches of prompts."""

    def __init__(self, model: str, dtype: str = "auto", **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        config: GenerationConfig | list[GenerationConfig] | None = None,
        *,
        priority: int = 0,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids); results come in prompt order."""
        batch = _as_batch(prompts)
        configs = _configs_for(batch, config)
        results: dict[str, GenerationResult] = {}
        try:
            for i, (prompt, prompt_config) in enumerate(zip(batch, configs, strict=True)):
                request_id = f"offline-{next(self._request_ids)}"
                self._add(i, request_id, prompt, prompt_config, priority)
                prompt_token_ids = self.engine.prompt_token_ids(request_id)
                completions = [
                    Completion(k, logprobs=[] if prompt_config.logprobs is not None else None)
                    for k in range(prompt_config.n)
                ]
                results[request_id] = GenerationResult(request_id, prompt_token_ids, completions)
            self._run(results)
        except BaseException:
            for request_id in results:
                self.engine.abort_request(request_id)
            raise
        return list(results.values())

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
                results[output.request_id].apply(output)
                if output.finished:
                    unfinished.discard(output.request_id)


def _as_batch(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
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
