"""`GenerationConfig`: how one request is decoded. Shared by the SDK and the offline API.

Defaults follow vLLM / the OpenAI API: temperature 1.0 samples; temperature 0 is greedy.
Every field is checked in ``__post_init__``; a bad value raises `InvalidArgumentError`
naming the field, so a server can answer INVALID_ARGUMENT for that request alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from headrace.sdk.errors import InvalidArgumentError

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_N = 256


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    #: Most tokens to generate per sample (>= 1).
    max_tokens: int = 16
    #: Fewest tokens to generate before EOS / stop token ids may end a sample (>= 0).
    min_tokens: int = 0
    #: Softmax temperature; 0 means greedy (argmax).
    temperature: float = 1.0
    #: Keep only the k most likely tokens; 0 disables.
    top_k: int = 0
    #: Keep the smallest set of tokens whose probability reaches top_p; in (0, 1].
    top_p: float = 1.0
    #: Drop tokens whose probability is below min_p times the top token's; in [0, 1].
    min_p: float = 0.0
    #: Divide positive logits (multiply negative ones) of tokens seen in prompt or output; > 0.
    repetition_penalty: float = 1.0
    #: Subtracted once from the logit of every token already generated; in [-2, 2].
    presence_penalty: float = 0.0
    #: Subtracted per occurrence from the logit of every token already generated; in [-2, 2].
    frequency_penalty: float = 0.0
    #: Makes sampling reproducible: tokens depend only on (seed, position, logits).
    seed: int | None = None
    #: Strings that end a sample when they appear in its text.
    stop: tuple[str, ...] = ()
    #: Token ids that end a sample (in addition to the model's EOS unless ignore_eos).
    stop_token_ids: tuple[int, ...] = ()
    #: Keep generating past EOS (stop_token_ids still apply).
    ignore_eos: bool = False
    #: Samples to draw for the prompt (>= 1); they share the prompt's KV blocks.
    n: int = 1
    #: Return the top-N logprobs of each generated token (0 = the chosen token's only).
    logprobs: int | None = None
    #: Return the top-N logprobs of each prompt token (0 = the prompt token's only).
    prompt_logprobs: int | None = None
    #: Keep the matched stop string at the end of the text.
    include_stop_str_in_output: bool = False
    #: Leave special tokens (EOS, chat markers) out of the text.
    skip_special_tokens: bool = True
    #: Never generate an n-gram of this size twice; 0 disables.
    no_repeat_ngram_size: int = 0

    def __post_init__(self) -> None:
        _set = object.__setattr__
        _set(self, "stop", _as_tuple("stop", self.stop, str))
        _set(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int))
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidArgumentError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_float("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k, low=0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0)
        if any(s == "" for s in self.stop):
            raise InvalidArgumentError("stop", "stop strings must not be empty")
        _check_int("n", self.n, low=1, high=MAX_N)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, low=0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _as_tuple(name: str, value: object, kind: type) -> tuple:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        if kind is str and isinstance(value, str):
            return (value,)
        raise InvalidArgumentError(name, f"must be a list of {kind.__name__}, got {value!r}")
    items = tuple(value)
    for item in items:
        if not isinstance(item, kind) or isinstance(item, bool):
            raise InvalidArgumentError(name, f"must contain only {kind.__name__}, got {item!r}")
    return items


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgumentError(name, f"must be {bounds}, got {value}")


def _check_float(
    name: str,
    value: object,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidArgumentError(name, f"must be a number, got {value!r}")
    v = float(value)
    too_low = v <= low if low_open else v < low
    if not math.isfinite(v) or too_low or (high is not None and v > high):
        left = "(" if low_open else "["
        bounds = (
            f"in {left}{low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
        )
        raise InvalidArgumentError(name, f"must be a finite number {bounds}, got {value}")
