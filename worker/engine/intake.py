"""Request intake: a request as callers give it becomes the sequences the scheduler runs.

`RequestIntake.build` checks everything about a request that can be checked before it runs
(the config's type, the prompt, its token ids, whether it can ever fit the context and the
KV pool, the logit controls' ids and the output constraint, compiled), tokenizes a text
prompt, and makes one `Sequence` per sample, each with its own logit controls (its own
place in the constraint). Bad input raises
`InvalidArgumentError` naming the field and changes nothing. Samples 1..n-1 of a request
wait (status NEW) until sample 0 has computed the shared prompt, so they find its blocks in
the prefix cache. A beam search starts as one sequence with its `BeamSearch`; its beams fork
as the search goes (`engine/beams.py`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.outputs import TokenLogprob
from headrace.sdk.prompts import Chat, Prompt
from headrace.worker.engine.model_spec import ModelSpec
from headrace.worker.engine.outputs import RequestTimes
from headrace.worker.sampling.beam_search import BeamSearch, beams_to_keep
from headrace.worker.sampling.controls import LogitControls, RowControls
from headrace.worker.sampling.detokenizer import Detokenizer
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.sequence import Sequence


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One request inside the engine: its samples and what has been reported of it."""

    request_id: str
    config: GenerationConfig
    prompt_token_ids: list[int]
    #: Its samples (a beam search: its live beams). Samples 1..n-1 follow sample 0: they are
    #: queued once it has computed the shared prompt (`Scheduler.follow`).
    seqs: list[Sequence]
    times: RequestTimes
    #: The LoRA adapter the request runs with (None: the base model).
    adapter: str | None = None
    prompt_logprobs_sent: bool = False
    prompt_token_ids_sent: bool = False
    #: A beam-search request's search (its live beams are `seqs`); None otherwise.
    beams: BeamSearch | None = None
    #: The returned beams' tokens, once a beam search ends.
    num_beam_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def take_prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs once all are scored, the first time they are (else None)."""
        leader = self.seqs[0]
        if not leader.wants_prompt_logprobs or self.prompt_logprobs_sent:
            return None
        if len(leader.prompt_logprobs) < leader.num_prompt_tokens - 1:
            return None
        self.prompt_logprobs_sent = True
        return list(leader.prompt_logprobs)

    @property
    def num_generated_tokens(self) -> int:
        """Over every sample (a beam search: over the beams it returned)."""
        if self.beams is not None:
            return self.num_beam_tokens
        return sum(seq.num_output_tokens for seq in self.seqs)


class RequestIntake:
    def __init__(
        self,
        spec: ModelSpec,
        vocab_size: int,
        block_manager: BlockManager,
        detokenizer: Detokenizer,
    ) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.block_manager = block_manager
        self.detokenizer = detokenizer
        self.controls = LogitControls(spec.tokenizer, vocab_size, spec.eos_token_ids)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    def build(
        self,
        request_id: str,
        prompt: Prompt,
        config: GenerationConfig,
        priority: int,
        lora: tuple[str, int] | None = None,
        num_resumed_tokens: int = 0,
    ) -> EngineRequest:
        """The request's sequences, or InvalidArgumentError naming what is wrong. ``lora``:
        the adapter's (name, load number) from `Adapters.resolve`; None for the base model.
        ``num_resumed_tokens``: the prompt's last tokens an earlier attempt generated."""
        if not isinstance(config, GenerationConfig):
            raise InvalidArgumentError("config", "must be a GenerationConfig")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidArgumentError("priority", f"must be an integer, got {priority!r}")
        prompt_token_ids = self.prompt_token_ids(prompt)
        self._check_fits(prompt_token_ids)
        self._check_token_ids("config.stop_token_ids", list(config.stop_token_ids))
        if not 0 <= num_resumed_tokens <= len(prompt_token_ids):
            raise InvalidArgumentError("num_resumed_tokens", "must be in [0, the prompt's length]")
        resumed = prompt_token_ids[len(prompt_token_ids) - num_resumed_tokens :]
        num_seqs = 1 if config.is_beam_search else config.n  # beams fork as they go
        controls = self.controls.for_samples(config, num_seqs, resumed)
        request = self._new_request(request_id, prompt_token_ids, config, priority, controls, lora)
        if config.is_beam_search:
            request.beams = self._beam_search(request)
        return request

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def _beam_search(self, request: EngineRequest) -> BeamSearch:
        leader = request.seqs[0]
        num_keep = beams_to_keep(request.config.num_beams, len(leader.stop_token_ids))
        if num_keep > self.vocab_size:
            raise InvalidArgumentError(
                "num_beams",
                f"keeps {num_keep} continuations a round, more than the vocabulary "
                f"({self.vocab_size} tokens)",
            )
        max_length = min(leader.num_tokens + request.config.max_tokens, self.spec.max_model_len)
        return BeamSearch(request.config, leader.num_tokens, max_length, leader.stop_token_ids)

    def prompt_token_ids(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        """The prompt as token ids: text tokenized (with the tokenizer's special tokens unless
        told not to), a chat rendered with the model's chat template, token ids checked
        against the vocabulary."""
        if isinstance(prompt, Chat):
            self._check_size("chat", prompt.num_content_bytes)
            return self._render_chat(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError("prompt", "must not be empty")
            self._check_size("prompt", len(prompt.encode()))
            return list(self.spec.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if not isinstance(prompt, list | tuple):
            raise InvalidArgumentError("prompt", "must be a string or a list of token ids")
        if not prompt:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        token_ids = list(prompt)
        self._check_token_ids("prompt_token_ids", token_ids)
        return token_ids

    def text_of(self, token_ids: list[int]) -> str:
        """The text of token ids (checked against the vocabulary), special tokens kept."""
        self._check_token_ids("token_ids", token_ids)
        return str(self.spec.tokenizer.decode(token_ids))

    def _check_size(self, field_name: str, num_bytes: int) -> None:
        """Refuse, before tokenizing it, text that could never fit the context."""
        if num_bytes > self.spec.max_prompt_bytes:
            raise InvalidArgumentError(
                field_name,
                f"has {num_bytes} bytes; this worker takes at most {self.spec.max_prompt_bytes} "
                f"(its context is {self.spec.max_model_len} tokens)",
            )

    def _render_chat(self, chat: Chat) -> list[int]:
        """The chat through the model's template, tools and tool calls as transformers takes
        them (`Chat.as_dicts`, `Chat.tool_dicts`); a template that knows no tools ignores them."""
        tokenizer = self.spec.tokenizer
        if not tokenizer.chat_template:
            raise InvalidArgumentError(
                "chat", "this model has no chat template: send the prompt as text or token ids"
            )
        try:
            token_ids = tokenizer.apply_chat_template(
                chat.as_dicts(),
                tools=cast(list[dict | Callable] | None, chat.tool_dicts()),  # as typed there
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=not chat.add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as exc:  # the template's own checks (roles, alternation) raise
            raise InvalidArgumentError("chat", f"the chat template refused it: {exc}") from exc
        return [int(token_id) for token_id in cast(list[int], token_ids)]

    def _check_token_ids(self, field_name: str, token_ids: list[int]) -> None:
        for i, token_id in enumerate(token_ids):
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise InvalidArgumentError(field_name, f"[{i}] is not an integer: {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise InvalidArgumentError(
                    field_name,
                    f"[{i}] = {token_id} is outside the vocabulary [0, {self.vocab_size})",
                )

    def _check_fits(self, prompt_token_ids: list[int]) -> None:
        num_tokens, max_model_len = len(prompt_token_ids), self.spec.max_model_len
        if num_tokens + 1 > max_model_len:
            raise InvalidArgumentError(
                "prompt",
                f"has {num_tokens} tokens; the model's context is {max_model_len} and must "
                "hold the prompt plus at least one generated token",
            )
        num_blocks = self.block_manager.num_blocks_for(num_tokens + 1)
        if num_blocks > self.block_manager.num_blocks:
            raise InvalidArgumentError(
                "prompt",
                f"needs {num_blocks} KV blocks but the cache has {self.block_manager.num_blocks}",
            )

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        config: GenerationConfig,
        priority: int,
        controls: list[RowControls | None],
        lora: tuple[str, int] | None,
    ) -> EngineRequest:
        stop_ids = frozenset(config.stop_token_ids)
        if not config.ignore_eos:
            stop_ids |= self.spec.eos_token_ids
        arrival, arrival_s = next(self._arrivals), time.monotonic()
        adapter, lora_id = lora if lora is not None else (None, 0)
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                sample_index=i,
                config=config,
                token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids),
                priority=priority,
                arrival=arrival,
                arrival_s=arrival_s,
                sample_seed=sample_seed(config.seed, i),
                stop_token_ids=stop_ids,
                wants_prompt_logprobs=(i == 0 and config.prompt_logprobs is not None),
                detok_state=self.detokenizer.new_state(prompt_token_ids, config),
                controls=seq_controls,
                adapter=adapter,
                lora_id=lora_id,
            )
            for i, seq_controls in enumerate(controls)
        ]
        times = RequestTimes(arrival_s=arrival_s)
        return EngineRequest(request_id, config, prompt_token_ids, seqs, times, adapter)


def sample_seed(seed: int | None, sample_index: int) -> int | None:
    """Sample 0 uses the request's seed as is, so n=1 and sample 0 of n agree."""
    if seed is None or sample_index == 0:
        return seed
    return hash((seed, sample_index)) & (2**63 - 1)
