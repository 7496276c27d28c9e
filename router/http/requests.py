"""OpenAI request bodies → headrace requests: one `ApiRequest` per HTTP call.

Design note. A body is read once, field by field, against three tables: OpenAI's sampling
fields and headrace's extensions (both straight onto `GenerationConfig`, whose own checks are
the only validation of values), fields accepted and ignored, and fields refused because
headrace cannot honour them yet. Any other field is refused as OpenAI does ("unrecognized"),
so a typo never silently changes nothing. Errors are `InvalidArgumentError`s whose ``field``
is the OpenAI ``param`` (``messages[1].content``, ``top_logprobs``, ``max_completion_tokens``),
including errors raised later by the router or a worker, which name headrace's fields
(``config.top_p``, ``chat``, ``prompt``): `ApiRequest.param` translates them back.

Structured output: `response_format` ``{"type": "json_object"}`` becomes
`GenerationConfig.json_object`, ``{"type": "json_schema", "json_schema": {"schema": ...}}``
its `json_schema` (`_response_format`); vLLM's extra fields `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` map onto json_schema, regex, choice and grammar.
`logit_bias` (token ids as JSON strings) is the config's own.

Tool calling: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` become the tools the
chat template is offered, the output constraint of ``required`` or a named function, and the
`ToolCalling` the response is parsed with (`tools.py`, `tool_calls.py`).

Echo and prompt logprobs (completions): ``echo`` starts each choice with its prompt, and with
``logprobs: N`` its logprobs start with the prompt's tokens (the first has none), as OpenAI's
legacy API does; the worker scores the prompt (`GenerationConfig.prompt_logprobs`, N unless
vLLM's ``prompt_logprobs`` field says otherwise, as vLLM does). ``max_tokens: 0`` with echo
scores the prompt alone: the worker, which always generates at least one token, is asked for
one, and the door drops it (vLLM's way). A prompt of token ids is echoed as the worker decodes
it, which comes beside the prompt logprobs (asked for with N = 0 when only the text is
wanted). vLLM's ``prompt_logprobs`` extra field (both endpoints, not with streams) returns the
prompt's logprobs in vLLM's shape too.

Beam search: vLLM's extra fields `num_beams`, `length_penalty` and `early_stopping` (true,
false or "never") are the config's own too; `n` says how many of the best beams come back,
as the choices, best first, each whole in the one event a beam search streams per choice.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from headrace.router.http.prompts import chat_prompt, completion_prompts
from headrace.router.http.tool_calls import ToolCalling
from headrace.router.http.tools import ToolPlan, plan_tools
from headrace.sdk.config import GenerationConfig, check_int64
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Prompt


class Endpoint(enum.Enum):
    CHAT = "chat.completion"
    COMPLETION = "text_completion"


#: OpenAI sampling fields that are `GenerationConfig` fields of the same name and meaning.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
)
#: headrace extensions: extra body fields (``extra_body`` in the openai package), also
#: `GenerationConfig` fields of the same name. `priority` is the request's, not the config's.
EXTENSION_FIELDS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
    "num_beams",
    "length_penalty",
    "early_stopping",
)
#: vLLM's structured-output extensions → the `GenerationConfig` constraint each sets.
GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
#: Accepted and ignored on purpose: they change nothing headrace does (issue 31 reviewed
#: OpenAI's reference for both endpoints; tests/router/http/test_openai_fields.py walks the
#: `openai` package's request types so a field OpenAI adds shows up in review).
IGNORED_FIELDS = frozenset(
    {
        # An end-user id for OpenAI's abuse monitoring (and its successor below).
        "user",
        "safety_identifier",
        # Keep the completion for OpenAI's evals and distillation, with tags: nothing is kept.
        "store",
        "metadata",
        # OpenAI's processing tiers (flex, priority): headrace's own `priority` orders work.
        "service_tier",
        # Only matters to a chat with tools, where `tools.py` reads it.
        "parallel_tool_calls",
        # Prompt-cache hints: headrace's prefix cache is automatic (and prefix-affinity routing
        # keeps a prompt's prefix on one worker), so there is nothing to key, mark or keep.
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        # Predicted output only speeds OpenAI up; the output is the model's either way.
        "prediction",
    }
)
#: Chat fields refused (400 naming them) unless they ask for what headrace does anyway (the
#: values listed): each would change the output in a way headrace cannot honour.
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[object, ...]] = {
    # Spoken output, and the modalities asking for it: headrace generates text.
    "audio": (),
    "modalities": (["text"],),
    # A reasoning budget, and GPT-5's length hint: headrace's models take neither (OpenAI
    # refuses them for its own models without reasoning, too); "none" / "medium" ask for
    # what they do anyway.
    "reasoning_effort": ("none",),
    "verbosity": ("medium",),
    # OpenAI's hosted tools: a web search, and moderation that may block the answer.
    "web_search_options": (),
    "moderation": (),
}
#: ``stream_options`` keys: include_usage (OpenAI's: a last chunk with the usage),
#: continuous_usage_stats (vLLM's, with include_usage: the usage so far on every chunk, as
#: guidellm asks), include_obfuscation (OpenAI's padding of chunks against side channels
#: over the internet: ignored, the door adds none).
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"})
#: Fields every endpoint reads itself (not config fields).
COMMON_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "priority",
        "max_tokens",
        "logprobs",
        "prompt_logprobs",
        *GUIDED_FIELDS,
    }
)
CHAT_FIELDS = frozenset(
    {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "add_generation_prompt",
    }
)
COMPLETION_FIELDS = frozenset({"prompt", "echo", "suffix", "best_of"})
#: /v1/completions' default max_tokens (OpenAI's); chat generates until EOS or the context.
COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One HTTP call, in headrace's terms: a `Request` per prompt, all with one config."""

    endpoint: Endpoint
    #: As the client named it ("" = the served model).
    model: str
    #: Chat: one `Chat`; completions: one or more prompts (a batch).
    prompts: tuple[Prompt, ...]
    config: GenerationConfig
    priority: int
    stream: bool
    #: Streaming: end with a chunk that carries the usage.
    include_usage: bool
    #: Return logprobs (in the endpoint's format).
    logprobs: bool
    #: headrace field → the OpenAI param that set it (for errors named by router or worker).
    params: Mapping[str, str] = field(default_factory=dict)
    #: Chat with tools: how each choice's text becomes tool calls; None: it does not.
    tool_calls: ToolCalling | None = None
    #: Streaming with include_usage: every chunk carries its choice's usage so far (vLLM's
    #: ``continuous_usage_stats``).
    continuous_usage: bool = False
    #: Completions' ``echo``: each choice starts with its prompt (and its logprobs, with
    #: `logprobs`).
    echo: bool = False
    #: ``echo`` with ``max_tokens: 0``: the prompt alone; the one token generated is dropped.
    prompt_only: bool = False
    #: vLLM's ``prompt_logprobs`` field: return the prompt's logprobs in vLLM's shape.
    prompt_logprobs: bool = False

    def param(self, headrace_field: str) -> str | None:
        """The OpenAI param behind a headrace field name (``config.top_p`` → ``top_p``)."""
        name = headrace_field.removeprefix("config.")
        if not name:
            return None
        for field_name in sorted(self.params, key=len, reverse=True):
            rest = name.removeprefix(field_name)
            if rest != name and (not rest or rest[0] in ".["):
                return self.params[field_name] + rest
        return name

    def check_context(self, max_model_len: int) -> None:
        """Refuse a max_tokens the context could never hold, naming the param that set it,
        as vLLM does; one that only the prompt makes too long is clipped (the sample ends
        with finish reason "length" when the context is full)."""
        max_tokens = self.config.max_tokens
        if max_tokens > max_model_len:
            param = self.param("max_tokens") or "max_tokens"
            raise InvalidArgumentError(
                param,
                f"{param}={max_tokens} cannot be greater than this model's maximum context "
                f"length (max_model_len={max_model_len} tokens, prompt included). Please "
                "request fewer output tokens.",
            )


def parse_chat(body: Any, default_max_tokens: int, tool_call_format: str = "") -> ApiRequest:
    """A ``/v1/chat/completions`` body; ``default_max_tokens``: the model's context;
    ``tool_call_format``: the format the model writes tool calls in ("" = unknown)."""
    fields = _fields(body, CHAT_FIELDS | UNSUPPORTED_CHAT_FIELDS.keys())
    _refuse_functions(fields)
    _refuse_unsupported(fields)
    tools = plan_tools(fields, tool_call_format)
    add_generation_prompt = _typed(fields, "add_generation_prompt", bool, True)
    prompt = chat_prompt(fields.get("messages"), add_generation_prompt, tools.tools)
    logprobs = _typed(fields, "logprobs", bool, False)
    top = fields.get("top_logprobs")
    if top is not None and not logprobs:
        raise InvalidArgumentError("top_logprobs", "needs logprobs: true")
    params = {
        "logprobs": "top_logprobs",
        "chat": "messages",
        "chat.messages": "messages",
        "prompt": "messages",
        "prompt_token_ids": "messages",
    }
    options = {"logprobs": (top if top is not None else 0) if logprobs else None}
    max_name = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    options["max_tokens"] = fields.get(max_name, default_max_tokens)
    params["max_tokens"] = max_name
    _response_format(fields.get("response_format"), options, params)
    _tool_constraint(tools, fields, options, params)
    wants_prompt_logprobs = _prompt_logprobs(fields, options, params)
    api = _request(Endpoint.CHAT, fields, (prompt,), options, params, logprobs)
    return dataclasses.replace(api, tool_calls=tools.calling, prompt_logprobs=wants_prompt_logprobs)


def parse_completion(body: Any) -> ApiRequest:
    """A ``/v1/completions`` body: prompt as text or token ids (or a list of either)."""
    fields = _fields(body, COMPLETION_FIELDS)
    echo = _typed(fields, "echo", bool, False)
    if fields.get("suffix") not in (None, ""):
        raise InvalidArgumentError("suffix", "suffix (insertion) is not supported")
    prompts = completion_prompts(fields.get("prompt"))
    logprobs = fields.get("logprobs")
    options: dict[str, object] = {"logprobs": logprobs}
    max_tokens = fields.get("max_tokens", COMPLETION_MAX_TOKENS)
    prompt_only = echo and type(max_tokens) is int and max_tokens == 0
    options["max_tokens"] = 1 if prompt_only else max_tokens
    best_of = fields.get("best_of")
    if best_of is not None and best_of != fields.get("n", 1):
        raise InvalidArgumentError("best_of", "must equal n (best-of selection is not supported)")
    params = {"chat": "prompt", "prompt_token_ids": "prompt"}
    wants_prompt_logprobs = _prompt_logprobs(fields, options, params)
    if echo and options.get("prompt_logprobs") is None:
        _echo_prompt_logprobs(logprobs, prompts, options, params)
    api = _request(Endpoint.COMPLETION, fields, prompts, options, params, logprobs is not None)
    return dataclasses.replace(
        api, echo=echo, prompt_only=prompt_only, prompt_logprobs=wants_prompt_logprobs
    )


def _prompt_logprobs(
    fields: dict[str, Any], options: dict[str, object], params: dict[str, str]
) -> bool:
    """vLLM's ``prompt_logprobs`` field onto the config; whether the prompt's logprobs are to be
    returned. Not with a stream (vLLM refuses N > 0 there and ignores 0)."""
    value = fields.get("prompt_logprobs")
    if value is None:
        return False
    if _typed(fields, "stream", bool, False):
        if value == 0 and type(value) is int:
            return False
        raise InvalidArgumentError("prompt_logprobs", "is not available with stream: true")
    options["prompt_logprobs"] = value
    params["prompt_logprobs"] = "prompt_logprobs"
    return True


def _echo_prompt_logprobs(
    logprobs: Any, prompts: tuple[Prompt, ...], options: dict[str, object], params: dict[str, str]
) -> None:
    """What echo needs of the worker: the prompt's logprobs with `logprobs: N` (top N), and the
    text of a prompt of token ids (which comes with them: top 0 if nothing else asks)."""
    if logprobs is not None:
        options["prompt_logprobs"] = logprobs
        params["prompt_logprobs"] = "logprobs"
    elif not all(isinstance(prompt, str) for prompt in prompts):
        options["prompt_logprobs"] = 0
        params["prompt_logprobs"] = "echo"


def _fields(body: Any, endpoint_fields: frozenset[str]) -> dict[str, Any]:
    """The body's fields with nulls dropped (null means "the default" everywhere here);
    refuses a body that is not an object and any field nobody knows."""
    if not isinstance(body, dict):
        raise InvalidArgumentError("", "the request body must be a JSON object")
    known = COMMON_FIELDS | endpoint_fields | IGNORED_FIELDS
    for name in body:
        if name not in known and name not in SAMPLING_FIELDS and name not in EXTENSION_FIELDS:
            raise InvalidArgumentError(name, f"unrecognized request argument: {name!r}")
    return {name: value for name, value in body.items() if value is not None}


def _request(
    endpoint: Endpoint,
    fields: dict[str, Any],
    prompts: tuple[Prompt, ...],
    options: dict[str, object],
    params: dict[str, str],
    logprobs: bool,
) -> ApiRequest:
    model = _typed(fields, "model", str, "")
    stream = _typed(fields, "stream", bool, False)
    include_usage, continuous_usage = _usage_options(fields.get("stream_options"), stream)
    priority = _typed(fields, "priority", int, 0)
    check_int64("priority", priority)
    for name in (*SAMPLING_FIELDS, *EXTENSION_FIELDS):
        if name in fields:
            options[name] = fields[name]
    for name, config_field in GUIDED_FIELDS.items():
        if name in fields:
            options[config_field] = fields[name]
            params[config_field] = name
    config = _config(options, params)
    return ApiRequest(
        endpoint,
        model,
        prompts,
        config,
        priority,
        stream,
        include_usage,
        logprobs,
        params,
        continuous_usage=continuous_usage,
    )


def _config(options: dict[str, object], params: dict[str, str]) -> GenerationConfig:
    """`GenerationConfig` checks every value; its errors are renamed to the OpenAI param."""
    try:
        return GenerationConfig(**{k: v for k, v in options.items() if v is not None})  # type: ignore[arg-type]
    except InvalidArgumentError as error:
        param = params.get(error.field, error.field)
        message = str(error).removeprefix(f"{error.field}: ")
        raise InvalidArgumentError(param, message) from None


def _usage_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """``stream_options`` → (include_usage, continuous_usage)."""
    if options is None:
        return False, False
    if not stream:
        raise InvalidArgumentError("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict):
        raise InvalidArgumentError("stream_options", "must be an object")
    for key in options:
        if key not in STREAM_OPTIONS:
            raise InvalidArgumentError(f"stream_options.{key}", f"unrecognized option {key!r}")
    values = {key: value for key, value in options.items() if value is not None}
    for key in STREAM_OPTIONS:
        _typed(values, key, bool, False, f"stream_options.{key}")
    include_usage = values.get("include_usage", False)
    return include_usage, include_usage and values.get("continuous_usage_stats", False)


def _refuse_functions(fields: dict[str, Any]) -> None:
    """OpenAI's legacy function calling; its successor, tools, is served."""
    if fields.get("functions"):
        raise InvalidArgumentError("functions", "is legacy and not supported: send tools")
    if fields.get("function_call", "none") != "none":
        raise InvalidArgumentError("function_call", "is legacy and not supported: send tool_choice")


def _tool_constraint(
    tools: ToolPlan, fields: dict[str, Any], options: dict[str, object], params: dict[str, str]
) -> None:
    """``tool_choice`` required or named: its schema is the call's one constraint."""
    if tools.json_schema is None:
        return
    if "json_object" in options or "json_schema" in options or set(GUIDED_FIELDS) & set(fields):
        raise InvalidArgumentError(
            "tool_choice", "cannot be combined with response_format or guided_* fields"
        )
    options["json_schema"] = tools.json_schema
    params["json_schema"] = tools.schema_param


def _refuse_unsupported(fields: dict[str, Any]) -> None:
    for name, harmless in UNSUPPORTED_CHAT_FIELDS.items():
        if name in fields and fields[name] not in harmless:
            raise InvalidArgumentError(name, f"{name} is not supported, got {fields[name]!r}")


def _response_format(value: Any, options: dict[str, object], params: dict[str, str]) -> None:
    """``response_format`` onto the config's json_object / json_schema options."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return
    if kind == "json_object":
        options["json_object"] = True
        params["json_object"] = "response_format"
        return
    schema = value.get("json_schema") if kind == "json_schema" else None
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise InvalidArgumentError(
            "response_format",
            'must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        )
    options["json_schema"] = schema["schema"]
    params["json_schema"] = "response_format.json_schema.schema"


def _typed(
    fields: Mapping[str, Any], name: str, kind: type, default: Any, param: str | None = None
) -> Any:
    value = fields.get(name, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidArgumentError(param or name, f"must be a {_KIND_NAMES[kind]}, got {value!r}")
    return value


_KIND_NAMES: dict[type, str] = {bool: "boolean", int: "integer", str: "string"}
