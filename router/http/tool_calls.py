"""Generated text → OpenAI tool calls, as it streams: one parser per choice.

Design note. A parser takes a choice's text in the pieces it streams in (`feed`, then
`finish` at its end) and gives back `Deltas`: the text that stays ``content`` and the pieces
of tool calls, each call's first piece with its id and name, every piece a fragment of its
arguments. A plain response feeds its whole text once, so both ways come from one code path
and a stream's deltas always reassemble into the plain response's calls.

The formats (`sdk/tool_formats.py`) share one shape: outside a call, text is content until
a *marker* opens a region of calls (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``);
a marker may also be a special token the detokenizer left out, so an output that *opens*
with a call's own first character (``{``, or ``[`` for an array of calls) opens a region
too. Inside a region, JSON objects are calls, and the *glue* between them (closing tags,
brackets, commas, semicolons, whitespace) is dropped; any other text ends the region and is
content again. An object is a call once its ``"name"`` is whole and names an offered tool;
its ``"arguments"`` (or ``"parameters"``) value then streams as its raw text grows, so the
arguments are the model's own JSON text. An object that turns out not to be a call (no
name, another name, not JSON) gives its text back as content, with the region's marker when
the region made no call. Text that could still become a marker is held back until it
cannot.

`tool_choice` ``required`` and a named function constrain the output (`router/http/tools.py`):
``required`` to an array of ``{"name", "parameters"}`` objects (parsed as a region that opens
the output), a named function to its arguments object itself (`NamedCallParser`).
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from headrace.sdk.tool_formats import HERMES, LLAMA3_JSON, MISTRAL

Json = dict[str, Any]
#: The keys whose value is a call's arguments (Llama 3 and `required` say "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of one tool call of a choice."""

    #: Which call (0, 1, ... in the order they were made).
    index: int
    #: A fragment of its arguments' JSON text.
    arguments: str
    #: Its id and function name: on its first piece only.
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Deltas:
    """What a piece of text added: content and pieces of tool calls."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: Deltas) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> Deltas: ...

    def finish(self) -> Deltas:
        """What was held back, at the end of the choice's text."""
        ...

    @property
    def num_calls(self) -> int: ...


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How one family writes its calls (see the design note)."""

    #: Text that opens a region of calls; dropped.
    markers: tuple[str, ...]
    #: Text dropped between calls in a region (besides whitespace).
    glue: tuple[str, ...]
    #: The character an output opening with a call starts with ("" = none).
    opening: str
    #: Makes a call id: OpenAI's ``call_...``, or Mistral's 9 alphanumerics (its chat
    #: templates refuse other ids when a call comes back in the history).
    new_id: Callable[[], str]


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


FORMATS = {
    HERMES: CallFormat(("<tool_call>",), ("<tool_call>", "</tool_call>"), "{", openai_call_id),
    LLAMA3_JSON: CallFormat(("<|python_tag|>",), (";",), "{", openai_call_id),
    MISTRAL: CallFormat(("[TOOL_CALLS]",), ("[", "]", ","), "[", mistral_call_id),
}
#: `tool_choice: "required"`: an array of calls, the whole output.
REQUIRED = CallFormat((), ("[", "]", ","), "[", openai_call_id)


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How a chat call's output becomes tool calls; each choice gets a parser of its own."""

    #: The offered tools' names: an object naming another is no call.
    tool_names: frozenset[str]
    #: The calls' format; None: the whole output is the arguments of `function`.
    format: CallFormat | None
    #: `tool_choice` named this function.
    function: str = ""
    #: Calls kept per choice (``parallel_tool_calls: false``: 1); later ones are dropped.
    max_calls: int | None = None

    def parser(self) -> ToolCallParser:
        if self.format is None:
            return NamedCallParser(self.function)
        return FormatParser(self.format, self.tool_names, self.max_calls)


# --- a named function: the output is its arguments ------------------------------------------


class NamedCallParser:
    """`tool_choice` named a function: the constrained output is its arguments object."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> Deltas:
        if not text:
            return Deltas()
        if self.num_calls:
            return Deltas(calls=[CallDelta(0, text)])
        self.num_calls = 1
        return Deltas(calls=[CallDelta(0, text, openai_call_id(), self.name)])

    def finish(self) -> Deltas:
        return Deltas()


# --- the marker formats and `required` --------------------------------------------------------


class FormatParser:
    """Content and calls out of text in one `CallFormat` (see the design note)."""

    def __init__(
        self, call_format: CallFormat, tool_names: frozenset[str], max_calls: int | None
    ) -> None:
        self.format = call_format
        self.tool_names = tool_names
        self.max_calls = max_calls
        self.num_calls = 0
        #: Text not yet decided on (a possible marker, glue, or the output's opening).
        self._pending = ""
        #: Nothing but whitespace so far: an opening character would open a region.
        self._at_start = bool(call_format.opening)
        #: Inside a region of calls: its text so far (the marker included).
        self._region: str | None = None
        self._region_calls = 0
        self._object: _ObjectScanner | None = None
        self._call: _CallOutput | None = None

    def feed(self, text: str) -> Deltas:
        self._pending += text
        out = Deltas()
        while self._pending:
            if self._region is None:
                if not self._outside(out):
                    break
            elif self._object is not None:
                self._in_object(out)
            elif not self._between_objects(out):
                break
        return out

    def finish(self) -> Deltas:
        out = Deltas()
        if self._object is not None:
            self._end_object(out, whole=False)
        if self._region is not None and not self._region_calls:
            out.content += self._region  # nothing in it was a call
        out.content += self._pending
        self._pending, self._region = "", None
        return out

    # Outside a region: content up to a marker (or an opening at the start).

    def _outside(self, out: Deltas) -> bool:
        """Handle pending text outside a region; False to wait for more text."""
        pending = self._pending
        if self._at_start:
            stripped = pending.lstrip()
            if not stripped:
                return False
            if stripped[0] == self.format.opening and not _starts_marker(
                stripped, self.format.markers
            ):
                self._at_start = False
                self._enter_region("", stripped)
                return True
            if _partial_marker(stripped, self.format.markers):
                return False
            self._at_start = False
        position, marker = _find_marker(pending, self.format.markers)
        if marker:
            out.content += pending[:position]
            self._enter_region(marker, pending[position + len(marker) :])
            return True
        keep = _held_back(pending, self.format.markers)
        out.content += pending[: len(pending) - keep]
        self._pending = pending[len(pending) - keep :]
        return False

    def _enter_region(self, marker: str, rest: str) -> None:
        self._region, self._region_calls, self._pending = marker, 0, rest

    def _leave_region(self, out: Deltas, text: str) -> None:
        """End the region: ``text`` (what ended it) and what follows are content again."""
        if not self._region_calls:
            out.content += self._region or ""
        self._region, self._pending = None, text + self._pending

    # Inside a region: glue between objects, and the objects.

    def _between_objects(self, out: Deltas) -> bool:
        """Drop whitespace and glue, start the next object, or end the region; False to wait."""
        assert self._region is not None
        stripped = self._pending.lstrip()
        self._region += self._pending[: len(self._pending) - len(stripped)]
        self._pending = stripped
        if not stripped:
            return False
        if stripped[0] == "{":
            self._object, self._call = _ObjectScanner(), None
            return True
        for glue in self.format.glue:
            if stripped.startswith(glue):
                self._region += glue
                self._pending = stripped[len(glue) :]
                return True
        if _partial_marker(stripped, self.format.glue):
            return False
        self._pending = ""
        self._leave_region(out, stripped)
        return True

    def _in_object(self, out: Deltas) -> None:
        scanner = self._object
        assert scanner is not None
        num_read = scanner.feed(self._pending)
        self._pending = self._pending[num_read:]
        self._follow(out, scanner)
        if scanner.failed or scanner.done:
            self._end_object(out, whole=scanner.done)

    def _follow(self, out: Deltas, scanner: _ObjectScanner) -> None:
        """Start the call once its name is whole, and stream its arguments as they grow."""
        if self._call is None and scanner.name is not None:
            self._call = self._start_call(scanner.name)
            if self._call is not None and self._call.kept:
                out.calls.append(CallDelta(self._call.index, "", self._call.id, scanner.name))
        if self._call is not None and self._call.kept:
            fragment = self._call.take(scanner)
            if fragment:
                out.calls.append(CallDelta(self._call.index, fragment))

    def _start_call(self, name: str) -> _CallOutput | None:
        if name not in self.tool_names:
            return None
        kept = self.max_calls is None or self.num_calls < self.max_calls
        call = _CallOutput(self.num_calls, self.format.new_id(), kept)
        self.num_calls += kept
        return call

    def _end_object(self, out: Deltas, whole: bool) -> None:
        """An object ended (``whole``) or broke off: a call, or content again."""
        scanner, call = self._object, self._call
        assert scanner is not None and self._region is not None
        self._object, self._call = None, None
        if call is None:  # never a call: its text is content, and the region ends
            self._leave_region(out, scanner.text)
            return
        self._region_calls += 1
        if call.kept and whole and not call.num_chars:
            out.calls.append(CallDelta(call.index, "{}"))  # no arguments given
        self._region += scanner.text
        if scanner.failed:  # what broke it is content
            self._leave_region(out, "")


@dataclass(slots=True)
class _CallOutput:
    """A call being streamed: how much of its arguments' text has gone out."""

    index: int
    id: str
    #: False past max_calls: scanned to its end, never sent.
    kept: bool
    num_chars: int = 0

    def take(self, scanner: _ObjectScanner) -> str:
        """The arguments' text not sent yet. An object or array streams as it grows; a
        string (arguments encoded as JSON text) goes whole once it ends, decoded."""
        span = scanner.arguments
        if span is None:
            return ""
        start, end = span
        text = scanner.text[start : len(scanner.text) if end is None else end]
        if text[:1] not in ("{", "["):
            if end is None:
                return ""
            if text.startswith('"'):
                text = _decoded(text)
            if self.num_chars:
                return ""
        fragment = text[self.num_chars :]
        self.num_chars = len(text)
        return fragment


def _decoded(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


# --- one JSON object, scanned as it arrives ---------------------------------------------------

# Where the scanner is among the object's top-level members.
_KEY, _IN_KEY, _COLON, _VALUE, _IN_VALUE, _AFTER_VALUE = range(6)


class _ObjectScanner:
    """One JSON object, read a character at a time: where its top-level values start and
    end, so a call's name is read once whole and its arguments can be sent while they grow.
    Nested values are only skipped over (their brackets and strings counted), not checked."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self.failed = False
        #: The value of "name", once whole and a string.
        self.name: str | None = None
        #: The arguments value's span in `text`: (start, end), end None while it grows.
        self.arguments: tuple[int, int | None] | None = None
        self._state = -1  # before the opening brace
        self._key_start = 0
        self._key = ""
        self._value_start = 0
        self._nesting = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """Read text up to the object's end (or a character that breaks it); returns how many
        characters were read (the rest belongs to what follows)."""
        start = len(self.text)
        self.text += text
        for position in range(start, len(self.text)):
            if not self._step(self.text[position], position):
                self.failed = True
                self.text = self.text[:position]
                return position - start
            if self.done:
                self.text = self.text[: position + 1]
                return position + 1 - start
        return len(text)

    def _step(self, char: str, position: int) -> bool:
        """Advance by one character; False if it cannot continue a JSON object here."""
        state = self._state
        if state == _IN_KEY or (state == _IN_VALUE and self._in_string):
            self._string_char(char, position)
            return True
        if state == _IN_VALUE:
            return self._value_char(char, position)
        if char.isspace():
            return True
        if state == -1:
            self._state = _KEY
            return char == "{"
        if state == _KEY:
            return self._key_char(char, position)
        if state == _COLON:
            self._state = _VALUE
            return char == ":"
        if state == _VALUE:
            self._start_value(char, position)
            return True
        # _AFTER_VALUE
        if char == ",":
            self._state = _KEY
            return True
        self.done = char == "}"
        return self.done

    def _key_char(self, char: str, position: int) -> bool:
        if char == "}":
            self.done = True
            return True
        if char != '"':
            return False
        self._state, self._key_start, self._in_string = _IN_KEY, position, True
        return True

    def _string_char(self, char: str, position: int) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
            if self._state == _IN_KEY:
                self._key = _decoded(self.text[self._key_start : position + 1])
                self._state = _COLON
            elif self._nesting == 0:
                self._end_value(position + 1)

    def _start_value(self, char: str, position: int) -> None:
        self._state, self._value_start = _IN_VALUE, position
        if self._key in ARGUMENT_KEYS:
            self.arguments = (position, None)
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._nesting = 1

    def _value_char(self, char: str, position: int) -> bool:
        """A character inside a top-level value (not inside one of its strings)."""
        if self._nesting == 0:  # a number, true, false or null
            if char in ",}" or char.isspace():
                self._end_value(position)
                return self._step(char, position)
            return True
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._nesting += 1
        elif char in "}]":
            self._nesting -= 1
            if self._nesting == 0:
                self._end_value(position + 1)
        return True

    def _end_value(self, end: int) -> None:
        self._state = _AFTER_VALUE
        raw = self.text[self._value_start : end]
        if self._key in ARGUMENT_KEYS:
            self.arguments = (self._value_start, end)
        elif self._key == "name" and raw.startswith('"'):
            self.name = _decoded(raw)


# --- shared helpers ---------------------------------------------------------------------------


def _find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first marker in text and where it starts; (-1, "") if none."""
    found = [(text.find(marker), marker) for marker in markers if marker in text]
    return min(found) if found else (-1, "")


def _starts_marker(text: str, markers: tuple[str, ...]) -> bool:
    return any(text.startswith(m) or m.startswith(text) for m in markers)


def _partial_marker(text: str, markers: tuple[str, ...]) -> bool:
    """Text is a proper prefix of a marker: more text decides."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


# --- the JSON of OpenAI's responses -----------------------------------------------------------


def message_calls(calls: list[CallDelta]) -> list[Json]:
    """A plain response's ``message.tool_calls``: each call's pieces joined."""
    merged: dict[int, Json] = {}
    for delta in calls:
        call = merged.setdefault(
            delta.index,
            {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}},
        )
        call["function"]["arguments"] += delta.arguments
    return [merged[index] for index in sorted(merged)]


def stream_calls(calls: list[CallDelta]) -> list[Json]:
    """A stream event's ``delta.tool_calls``: a call's consecutive pieces in one entry; its
    first entry carries id, type and name, as OpenAI's streams do."""
    entries: list[Json] = []
    for delta in calls:
        if entries and entries[-1]["index"] == delta.index:
            entries[-1]["function"]["arguments"] += delta.arguments
            continue
        entry: Json = {"index": delta.index}
        function: Json = {"arguments": delta.arguments}
        if delta.id is not None:
            entry.update(id=delta.id, type="function")
            function = {"name": delta.name, "arguments": delta.arguments}
        entry["function"] = function
        entries.append(entry)
    return entries
