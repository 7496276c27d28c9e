"""`GenerationConfig`: how one request is decoded. Shared by the SDK and the offline API.

Defaults follow vLLM / the OpenAI API: temperature 1.0 samples; temperature 0 is greedy.
Every field is checked in ``__post_init__``; a bad value raises `InvalidArgumentError`
naming the field, so a server can answer INVALID_ARGUMENT for that request alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from headrace.sdk.errors import InvalidArgumentError

#: The wire's integers are int64: every integer field is checked against this range, so a
#: value that cannot travel is refused naming its field (never a protobuf error later).
MAX_INT64 = 2**63 - 1
MIN_INT64 = -(2**63)
MAX_SEED = MAX_INT64
MAX_LOGPROBS = 20
MAX_N = 256
MAX_BEAMS = 64
#: OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0
#: The constraint fields; a request sets at most one.
CONSTRAINTS = ("json_schema", "json_object", "regex", "grammar", "choice")


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
    #: Constrain the output to JSON valid under this JSON Schema (a dict is kept as its JSON
    #: text). At most one of json_schema, json_object, regex, grammar and choice is set.
    json_schema: str | None = None
    #: Constrain the output to one JSON value (any shape).
    json_object: bool = False
    #: Constrain the output to match this regular expression whole.
    regex: str | None = None
    #: Constrain the output to this EBNF grammar (xgrammar's dialect, GBNF-like; rule `root`).
    grammar: str | None = None
    #: Constrain the output to exactly one of these strings.
    choice: tuple[str, ...] = ()
    #: Token id -> bias added to its logit before sampling (OpenAI's logit_bias), in [-100, 100].
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)
    #: Sample only among these token ids (empty: any token).
    allowed_token_ids: tuple[int, ...] = ()
    #: Words never to generate: each is banned as the token sequences it tokenizes to.
    bad_words: tuple[str, ...] = ()
    #: Beam search over this many beams (transformers' num_beams without sampling); 1 is
    #: off. The request returns its n best beams whole when the search ends: nothing streams
    #: before, and each carries its cumulative logprob and its beam score.
    num_beams: int = 1
    #: A beam's score is its cumulative logprob / (its generated tokens ** length_penalty):
    #: above 0 favours longer outputs, below 0 shorter ones (beam search only).
    length_penalty: float = 1.0
    #: When beam search ends (transformers' early_stopping): False once the best running
    #: beam can no longer beat the worst of num_beams finished ones (judged at the current
    #: length), True as soon as num_beams beams have finished, "never" only when no running
    #: beam could beat them at any length (the canonical algorithm).
    early_stopping: bool | str = False

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
        self._check_logit_controls()
        self._check_constraint()
        self._check_beams()

    def _check_logit_controls(self) -> None:
        _set = object.__setattr__
        _set(self, "allowed_token_ids", _as_tuple("allowed_token_ids", self.allowed_token_ids, int))
        for token_id in self.allowed_token_ids:
            _check_int("allowed_token_ids", token_id, low=0)
        _set(self, "bad_words", _as_tuple("bad_words", self.bad_words, str))
        if any(not word.strip() for word in self.bad_words):
            raise InvalidArgumentError("bad_words", "bad words must not be empty or blank")
        if self.logit_bias is not None:
            _set(self, "logit_bias", _logit_bias(self.logit_bias) or None)

    def _check_constraint(self) -> None:
        _set = object.__setattr__
        _set(self, "choice", _as_tuple("choice", self.choice, str))
        if any(choice == "" for choice in self.choice):
            raise InvalidArgumentError("choice", "choices must not be empty strings")
        if not isinstance(self.json_object, bool):
            raise InvalidArgumentError("json_object", f"must be a bool, got {self.json_object!r}")
        if self.json_schema is not None:
            _set(self, "json_schema", _schema_text(self.json_schema))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(name, f"must be a non-empty string, got {value!r}")
        chosen = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False, ())]
        if len(chosen) > 1:
            raise InvalidArgumentError(
                chosen[1], f"only one constraint at a time: {' and '.join(chosen)} are both set"
            )

    def _check_beams(self) -> None:
        _check_int("num_beams", self.num_beams, low=1, high=MAX_BEAMS)
        penalty = self.length_penalty
        if not math.isfinite(_as_float("length_penalty", penalty)):
            raise InvalidArgumentError("length_penalty", f"must be finite, got {penalty}")
        object.__setattr__(self, "early_stopping", _early_stopping(self.early_stopping))
        if self.num_beams == 1:
            return
        if self.n > self.num_beams:
            raise InvalidArgumentError(
                "n", f"beam search returns at most num_beams ({self.num_beams}) beams, got {self.n}"
            )
        refused = {
            "temperature": self.temperature not in (0.0, 1.0),
            "top_k": self.top_k != 0,
            "top_p": self.top_p != 1.0,
            "min_p": self.min_p != 0.0,
            "seed": self.seed is not None,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "stop": bool(self.stop),
            "logit_bias": self.logit_bias is not None,
            "allowed_token_ids": bool(self.allowed_token_ids),
            "bad_words": bool(self.bad_words),
        }
        refused.update((name, getattr(self, name) not in (None, False, ())) for name in CONSTRAINTS)
        for name, is_set in refused.items():
            if is_set:
                why = _BEAM_REFUSALS.get(name, "not supported with beam search yet")
                raise InvalidArgumentError(
                    name, f"cannot be combined with num_beams={self.num_beams}: {why}"
                )

    @property
    def is_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, text) of the request's output constraint, or None: the grammar cache's key.
        A choice's text is its JSON list; json_object's is empty."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.choice:
            return "choice", json.dumps(list(self.choice), ensure_ascii=False)
        return None

    @property
    def has_logit_controls(self) -> bool:
        """Whether the sampler must edit this request's logits (a constraint, a bias, an
        allow-list or bad words) before it picks a token."""
        controls = (self.logit_bias, self.allowed_token_ids, self.bad_words)
        return self.constraint is not None or any(controls)


_SAMPLING = "beam search ranks tokens by their raw logprobs and draws nothing"
#: Why beam search refuses an option (see `GenerationConfig._check_beams`).
_BEAM_REFUSALS = {
    "temperature": "beam search scores raw logprobs; leave temperature at 0 or 1",
    "top_k": _SAMPLING,
    "top_p": _SAMPLING,
    "min_p": _SAMPLING,
    "seed": "beam search is deterministic",
    "logprobs": "beams change until the search ends; each returned beam has its cumulative logprob",
    "prompt_logprobs": "not supported with beams",
    "stop": "stop strings are not supported with beams (stop_token_ids are)",
}


def _early_stopping(value: object) -> bool | str:
    """True, False or "never" (the wire's strings "true" and "false" read as the bools)."""
    if isinstance(value, bool) or value == "never":
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidArgumentError("early_stopping", f'must be true, false or "never", got {value!r}')


def _logit_bias(value: object) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError("logit_bias", f"must map token ids to biases, got {value!r}")
    bias: dict[int, float] = {}
    for token_id, amount in value.items():
        if isinstance(token_id, str) and token_id.isascii() and token_id.isdigit():
            token_id = _digits(token_id)  # JSON object keys are strings
        _check_int("logit_bias", token_id, low=0)
        _check_float("logit_bias", amount, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        bias[token_id] = float(amount)
    return bias


def _digits(text: str) -> int | str:
    """A key of ASCII digits as its integer; one too long for Python to read (over 4300
    digits) stays text, which `_check_int` refuses."""
    try:
        return int(text)
    except ValueError:
        return text


def _schema_text(schema: object) -> str:
    """The schema as JSON text (a dict is dumped in its own key order: order is output order)."""
    if isinstance(schema, Mapping):
        return json.dumps(schema, ensure_ascii=False)
    if not isinstance(schema, str):
        raise InvalidArgumentError("json_schema", f"must be a JSON object, got {schema!r}")
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise InvalidArgumentError("json_schema", f"is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict | bool):
        raise InvalidArgumentError("json_schema", "must be a JSON object (a schema)")
    return schema


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


def check_int64(name: str, value: object, *, low: int = MIN_INT64) -> None:
    """An integer the wire can carry (int64), at least ``low``; else InvalidArgumentError."""
    _check_int(name, value, low=low)


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    """``value`` is an integer in [low, high]; ``high`` defaults to the int64 limit."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(name, f"must be an integer, got {value!r}")
    if low <= value <= (MAX_INT64 if high is None else high):
        return
    if high is None:
        bounds = f">= {low}" if value < low else f"in [{low}, 2^63 - 1]"
    else:
        bounds = f"in [{low}, {high}]"
    raise InvalidArgumentError(name, f"must be {bounds}, got {value}")


def _as_float(name: str, value: object) -> float:
    """A number as a float; an integer too large for one (JSON allows 10**400) is refused."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidArgumentError(name, f"must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgumentError(name, f"must be a finite number, got {value}") from None


def _check_float(
    name: str,
    value: object,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    v = _as_float(name, value)
    too_low = v <= low if low_open else v < low
    if not math.isfinite(v) or too_low or (high is not None and v > high):
        left = "(" if low_open else "["
        bounds = (
            f"in {left}{low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
        )
        raise InvalidArgumentError(name, f"must be a finite number {bounds}, got {value}")
