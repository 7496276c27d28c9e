"""headrace chunks → OpenAI response bodies: whole (``stream: false``) or as stream chunks.

Design note. One HTTP call is one or more headrace requests (one per prompt, named
``<call id>-<prompt index>``), each with ``n`` samples; OpenAI numbers the choices
``prompt_index * n + sample_index``. A `ResponseBuilder` turns the chunks the router sends
into either the events of a stream (one event per chunk that carries text, logprobs or a
finish reason) or, folded, the one body of a plain response. Usage is the sum of each
request's usage, which the router already reports across failovers, so it equals the gRPC
path's.

A chat call with tools parses each choice's text (`tool_calls.py`): a plain message gets
``tool_calls`` (content null beside them unless the model wrote more), a stream OpenAI's
``delta.tool_calls`` pieces, and a choice that stopped after calls finishes with
``"tool_calls"``. Text that may open a call is held back from the stream until it is
known.

With ``stream_options.continuous_usage_stats`` (vLLM's) every event carries its choice's
usage so far: its prompt's tokens (the door asks for the prompt's token ids, which come on
the request's first chunk) and the tokens that choice has streamed.

Logprobs name tokens as the worker does on the wire (`TokenLogprob.token` / `token_bytes`: the
router has no tokenizer); an entry a worker did not name is written ``"token_id:<id>"``
(vLLM's convention for ``return_tokens_as_token_ids``) with ``bytes`` null. Values are the
worker's, -inf written as -9999.0 as vLLM does (JSON has no infinity). Completions' top
alternatives include the chosen token, as OpenAI's legacy API does (up to N + 1 entries).

Echo (completions): a prompt's text is the client's, or for token ids the worker's decode,
and its tokens are the first prompt token (no logprob: null) then the prompt's logprobs, both
on the chunk that carries the prompt logprobs (`Chunk.first_prompt_token`), which is the
prompt's first chunk of sample 0; each choice of the prompt starts with them (in a stream, its
first event). Character offsets of prompt tokens follow their bytes through a UTF-8 decoder,
so a token inside a character starts where that character does, as in the generated text.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from headrace.protos import generation_pb2 as pb
from headrace.router.http.requests import ApiRequest, Endpoint
from headrace.router.http.tool_calls import Deltas, ToolCallParser, message_calls, stream_calls

FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
ID_PREFIXES = {Endpoint.CHAT: "chatcmpl-", Endpoint.COMPLETION: "cmpl-"}
CHUNK_OBJECTS = {Endpoint.CHAT: "chat.completion.chunk", Endpoint.COMPLETION: "text_completion"}

Json = dict[str, Any]


def encode(body: object) -> bytes:
    """JSON as the door sends it: compact, UTF-8, never a raw newline (SSE needs that)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def sse(event: Json) -> bytes:
    """One Server-Sent Event carrying ``event``."""
    return b"data: " + encode(event) + b"\n\n"


#: What a logprob of -inf is written as (vLLM's; JSON has no infinity).
MIN_LOGPROB = -9999.0

#: A token as logprobs name it: a `TokenLogprob` or a `TopLogprob`.
Named = pb.TokenLogprob | pb.TopLogprob


def token_name(entry: Named) -> str:
    """The token's text as the worker named it, or ``token_id:<id>`` where it did not."""
    if entry.token or entry.token_bytes:
        return entry.token
    return f"token_id:{entry.token_id}"


def token_bytes(entry: Named) -> list[int] | None:
    return list(entry.token_bytes) if entry.token or entry.token_bytes else None


def logprob_value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


@dataclass(slots=True)
class _Choice:
    """One choice's output so far (plain responses), or its text length (streams)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    #: Characters of text so far (completions' ``text_offset``).
    num_chars: int = 0
    #: Per token in `logprobs`: where the text of its chunk starts (plain completions).
    text_offsets: list[int] = field(default_factory=list)
    #: Chat with tools: turns the choice's text into content and tool calls.
    tool_calls: ToolCallParser | None = None
    #: Tokens streamed so far (continuous usage).
    num_tokens: int = 0
    #: Streams with echo: its prompt was sent (in its first event).
    echoed: bool = False


@dataclass(slots=True)
class _Prompt:
    """One prompt as echo and vLLM's ``prompt_logprobs`` show it."""

    #: Its text: the client's, or (token ids) the worker's decode once it comes.
    text: str | None
    #: The first prompt token (no logprob), then one entry per later prompt token; empty until
    #: the worker's prompt logprobs come.
    tokens: list[pb.TokenLogprob] = field(default_factory=list)


class ResponseBuilder:
    def __init__(self, request: ApiRequest, model: str) -> None:
        self.request = request
        self.endpoint = request.endpoint
        self.model = model
        self.id = ID_PREFIXES[request.endpoint] + uuid.uuid4().hex
        self.created = int(time.time())
        calling = request.tool_calls
        self.choices = [
            _Choice(tool_calls=calling.parser() if calling else None)
            for _ in range(len(request.prompts) * request.config.n)
        ]
        self.usage = pb.Usage()
        #: The request id of each prompt (what the router's logs and spans name), and back.
        self.request_ids = [f"{self.id}-{i}" for i in range(len(request.prompts))]
        self._prompt_index = {request_id: i for i, request_id in enumerate(self.request_ids)}
        #: Per prompt: its tokens, once its first chunk said (continuous usage).
        self._num_prompt_tokens = [0] * len(request.prompts)
        self.prompts = [_Prompt(p if isinstance(p, str) else None) for p in request.prompts]
        # A stream event is `data: {<envelope>,"choices":[<choice>](,"usage":null)}\n\n`.
        self._event_head = b"data: " + encode(self._envelope())[:-1] + b',"choices":['
        self._event_tail = b'],"usage":null}\n\n' if request.include_usage else b"]}\n\n"

    def index(self, chunk: pb.Chunk) -> int:
        """The OpenAI choice index of a chunk."""
        return self._prompt_index[chunk.request_id] * self.request.config.n + chunk.index

    def record_usage(self, chunk: pb.Chunk) -> None:
        if chunk.finished and chunk.HasField("usage"):
            self.usage.prompt_tokens += chunk.usage.prompt_tokens
            if not self.request.prompt_only:  # its one token is dropped
                self.usage.generated_tokens += chunk.usage.generated_tokens
            self.usage.cached_tokens += chunk.usage.cached_tokens

    def record_prompt(self, chunk: pb.Chunk) -> None:
        """Keep the prompt's tokens (and the text of a token-id prompt) when a chunk brings
        them."""
        if not chunk.HasField("first_prompt_token"):
            return
        prompt = self.prompts[self._prompt_index[chunk.request_id]]
        prompt.tokens = [chunk.first_prompt_token, *chunk.prompt_logprobs]
        if prompt.text is None:
            prompt.text = chunk.prompt_text

    def usage_json(self) -> Json:
        usage = self.usage
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.generated_tokens,
            "total_tokens": usage.prompt_tokens + usage.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }

    # --- plain responses ----------------------------------------------------------------

    def add(self, chunk: pb.Chunk) -> None:
        """Fold a chunk into its choice."""
        self.record_usage(chunk)
        self.record_prompt(chunk)
        choice = self.choices[self.index(chunk)]
        choice.text.append(chunk.text)
        choice.logprobs.extend(chunk.logprobs)
        choice.text_offsets.extend(choice.num_chars for _ in chunk.logprobs)
        choice.num_chars += len(chunk.text)
        if chunk.finish_reason in FINISH_REASONS:
            choice.finish_reason = FINISH_REASONS[chunk.finish_reason]

    def body(self) -> Json:
        """The whole response, once every request has finished."""
        choices = [self._choice_json(i, choice) for i, choice in enumerate(self.choices)]
        body: Json = {
            "id": self.id,
            "object": self.endpoint.value,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage_json(),
        }
        if self.endpoint is Endpoint.CHAT and self.request.prompt_logprobs:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.prompts[0].tokens)
        return body

    def _choice_json(self, index: int, choice: _Choice) -> Json:
        text, entries, offsets = "".join(choice.text), choice.logprobs, choice.text_offsets
        finish_reason, num_unscored = choice.finish_reason, 0
        if self.request.echo:
            if self.request.prompt_only:
                text, entries, offsets, finish_reason = "", [], [], "length"
            echoed = _with_prompt(self._prompt_of(index), text, entries, offsets)
            text, entries, offsets, num_unscored = echoed
        logprobs = None
        if self.request.logprobs:
            logprobs = self._logprobs(entries, offsets, num_unscored)
        if self.endpoint is Endpoint.CHAT:
            message: Json = {"role": "assistant", "content": text}
            parser = choice.tool_calls
            if parser is not None:
                message = _tool_message(parser.feed(text), parser.finish())
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(parser, finish_reason),
            }
        answer = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if self.request.prompt_logprobs:
            answer["prompt_logprobs"] = vllm_prompt_logprobs(self._prompt_of(index).tokens)
        return answer

    def _prompt_of(self, index: int) -> _Prompt:
        """The prompt of choice ``index``."""
        return self.prompts[index // self.request.config.n]

    # --- streams ------------------------------------------------------------------------

    def note_prompts(self, chunks: Sequence[pb.Chunk]) -> None:
        """Learn each prompt's length from the chunks carrying its token ids."""
        for chunk in chunks:
            if chunk.prompt_token_ids:
                prompt_index = self._prompt_index[chunk.request_id]
                self._num_prompt_tokens[prompt_index] = len(chunk.prompt_token_ids)

    def first_events(self) -> bytes:
        """Chat streams open each choice with the assistant's role, as OpenAI's do."""
        if self.endpoint is not Endpoint.CHAT:
            return b""
        delta = {"role": "assistant", "content": ""}
        return b"".join(self._event(i, delta, None, None) for i in range(len(self.choices)))

    def events(self, chunk: pb.Chunk) -> bytes:
        """The stream events of one chunk, as SSE (none for a chunk that only closes a
        request, or whose token has no text yet)."""
        self.record_usage(chunk)
        self.note_prompts((chunk,))
        self.record_prompt(chunk)
        finish_reason = FINISH_REASONS.get(chunk.finish_reason)
        index = self.index(chunk)
        choice = self.choices[index]
        if not self.request.prompt_only:  # its one token is dropped
            choice.num_tokens += len(chunk.token_ids)
        if self.request.echo:
            return self._echo_event(index, choice, chunk, finish_reason)
        if not chunk.text and not chunk.logprobs and finish_reason is None:
            return b""
        logprobs = None
        if self.request.logprobs:
            offsets = [choice.num_chars] * len(chunk.logprobs)
            logprobs = self._logprobs(chunk.logprobs, offsets)
        choice.num_chars += len(chunk.text)
        if self.endpoint is not Endpoint.CHAT:
            return self._event(index, chunk.text, logprobs, finish_reason)
        parser = choice.tool_calls
        if parser is None:
            delta = {"content": chunk.text} if chunk.text or finish_reason is None else {}
            return self._event(index, delta, logprobs, finish_reason)
        tool_delta = _tool_delta(parser, chunk.text, finish_reason is not None)
        if not tool_delta and logprobs is None and finish_reason is None:
            return b""  # held back: it may be the start of a call
        return self._event(index, tool_delta, logprobs, _finish_reason(parser, finish_reason))

    def _echo_event(
        self, index: int, choice: _Choice, chunk: pb.Chunk, finish_reason: str | None
    ) -> bytes:
        """A completion stream's event with echo: a choice's first event (its first token, or
        its end) starts with its prompt; with prompt_only the chunk's own token is dropped."""
        text, entries = chunk.text, list(chunk.logprobs)
        if self.request.prompt_only:
            text, entries = "", []
            finish_reason = finish_reason and "length"
        offsets = [choice.num_chars] * len(entries)
        num_unscored = 0
        if not choice.echoed and (chunk.token_ids or finish_reason is not None):
            choice.echoed = True
            echoed = _with_prompt(self._prompt_of(index), text, entries, offsets, choice.num_chars)
            text, entries, offsets, num_unscored = echoed
        if not text and not entries and finish_reason is None:
            return b""
        choice.num_chars += len(text)
        logprobs = None
        if self.request.logprobs:
            logprobs = self._logprobs(entries, offsets, num_unscored)
        return self._event(index, text, logprobs, finish_reason)

    def usage_event(self) -> bytes:
        """The last event of a stream with ``include_usage``: no choices, the usage."""
        return sse({**self._envelope(), "choices": [], "usage": self.usage_json()})

    def _event(
        self, index: int, content: Json | str, logprobs: Json | None, finish_reason: str | None
    ) -> bytes:
        """One choice's event. Every event of a call has the same envelope (id, object,
        created, model), so it is encoded once and only the choice is encoded here."""
        key = "delta" if self.endpoint is Endpoint.CHAT else "text"
        choice = {
            "index": index,
            key: content,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if not self.request.continuous_usage:
            return self._event_head + encode(choice) + self._event_tail
        return self._event_head + encode(choice) + self._usage_tail(index)

    def _usage_tail(self, index: int) -> bytes:
        """The end of an event carrying its choice's usage so far (continuous usage)."""
        num_prompt_tokens = self._num_prompt_tokens[index // self.request.config.n]
        num_tokens = self.choices[index].num_tokens
        usage = {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_tokens,
            "total_tokens": num_prompt_tokens + num_tokens,
        }
        return b'],"usage":' + encode(usage) + b"}\n\n"

    def _envelope(self) -> Json:
        object_name = CHUNK_OBJECTS[self.endpoint]
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    # --- logprobs -----------------------------------------------------------------------

    def _logprobs(
        self, entries: Sequence[pb.TokenLogprob], text_offsets: list[int], num_unscored: int = 0
    ) -> Json:
        """The endpoint's logprobs of ``entries``, whose first ``num_unscored`` (an echoed
        prompt's first token) have no logprob."""
        if self.endpoint is Endpoint.CHAT:
            return {"content": [_chat_logprob(entry) for entry in entries], "refusal": None}
        num_top = self.request.config.logprobs or 0
        scored = entries[num_unscored:]
        return {
            "tokens": [token_name(entry) for entry in entries],
            "token_logprobs": [None] * num_unscored
            + [logprob_value(entry.logprob) for entry in scored],
            "top_logprobs": [None] * num_unscored + [_top(entry, num_top) for entry in scored],
            # Each generated token starts where its chunk's text does; see the module note.
            "text_offset": text_offsets,
        }


def _tool_message(deltas: Deltas, rest: Deltas) -> Json:
    """A plain chat message with tools: the content, and the tool calls if any (content is
    then null unless the model wrote more than whitespace beside them)."""
    deltas.extend(rest)
    if not deltas.calls:
        return {"role": "assistant", "content": deltas.content}
    content = deltas.content if deltas.content.strip() else None
    return {"role": "assistant", "content": content, "tool_calls": message_calls(deltas.calls)}


def _tool_delta(parser: ToolCallParser, text: str, last: bool) -> Json:
    """A streamed chat delta with tools: content and ``tool_calls`` pieces, each if any."""
    deltas = parser.feed(text)
    if last:
        deltas.extend(parser.finish())
    delta: Json = {"content": deltas.content} if deltas.content else {}
    if deltas.calls:
        delta["tool_calls"] = stream_calls(deltas.calls)
    return delta


def _finish_reason(parser: ToolCallParser | None, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" for a choice that stopped after making calls."""
    if parser is not None and parser.num_calls and reason == "stop":
        return "tool_calls"
    return reason


def _top(entry: pb.TokenLogprob, num_top: int) -> Json:
    """A completion token's top alternatives (at most ``num_top``) and the token itself, keyed
    by name. Distinct tokens may share a name (parts of characters may read "" or U+FFFD): the
    likeliest keeps it, so the top value is always the position's best and a token that was
    not chosen greedily never looks as if it was (what lm-eval's is_greedy reads)."""
    top: Json = {}
    for alternative in [*entry.top[:num_top], entry]:
        top.setdefault(token_name(alternative), logprob_value(alternative.logprob))
    return top


def _chat_logprob(entry: pb.TokenLogprob) -> Json:
    return {
        "token": token_name(entry),
        "logprob": logprob_value(entry.logprob),
        "bytes": token_bytes(entry),
        "top_logprobs": [
            {"token": token_name(t), "logprob": logprob_value(t.logprob), "bytes": token_bytes(t)}
            for t in entry.top
        ],
    }


def _with_prompt(
    prompt: _Prompt,
    text: str,
    entries: list[pb.TokenLogprob],
    offsets: list[int],
    start: int = 0,
) -> tuple[str, list[pb.TokenLogprob], list[int], int]:
    """A choice's text, tokens and their offsets (counted from ``start``, where the prompt
    goes) with its prompt before them, and how many leading tokens have no logprob."""
    prompt_text = prompt.text or ""
    prompt_offsets = [start + offset for offset in byte_offsets(prompt.tokens)]
    return (
        prompt_text + text,
        [*prompt.tokens, *entries],
        [*prompt_offsets, *(offset + len(prompt_text) for offset in offsets)],
        1 if prompt.tokens else 0,
    )


def byte_offsets(entries: Sequence[Named]) -> list[int]:
    """Where each token's text starts, in characters, when the tokens' bytes are decoded one
    after another (a token inside a character starts where that character does)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, num_chars = [], 0
    for entry in entries:
        offsets.append(num_chars)
        num_chars += len(decoder.decode(entry.token_bytes))
    return offsets


def vllm_prompt_logprobs(tokens: Sequence[pb.TokenLogprob]) -> list[Json | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a dict of
    token id → {logprob, rank, decoded_token}, the token first and then its top alternatives
    (ranked 1, 2, ...)."""
    scored: list[Json | None] = [None] if tokens else []
    for entry in tokens[1:]:
        rank = entry.rank or None
        position = {str(entry.token_id): _vllm_logprob(entry, rank)}
        for i, top in enumerate(entry.top):
            position.setdefault(str(top.token_id), _vllm_logprob(top, i + 1))
        scored.append(position)
    return scored


def _vllm_logprob(entry: Named, rank: int | None) -> Json:
    return {
        "logprob": logprob_value(entry.logprob),
        "rank": rank,
        "decoded_token": token_name(entry),
    }
