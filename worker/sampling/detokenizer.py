"""Incremental detokenization: token ids in, text deltas out, stop strings matched on the text.

What the deltas of one sequence add up to (deltas + `finish()`, when no stop string matched):

* Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2):
  ``tokenizer.decode(output_ids, skip_special_tokens=...)``. Fast path: every token id's
  bytes are computed once from the vocab, and a UTF-8 decoder with carry-over turns the byte
  stream into text, so a character whose bytes span several tokens appears whole once its last
  byte arrives (never as U+FFFD before that). Special tokens are found by id: skipped ones
  leave the byte stream untouched, kept ones (and other added tokens) are written verbatim and
  end the byte run, as ``decode`` does.
* Any other tokenizer (SentencePiece / Metaspace, WordPiece, ...):
  ``decode(tail + output_ids)[len(decode(tail)):]`` where ``tail`` is the prompt's last
  `PROMPT_TAIL_TOKENS` ids, so a leading "▁" becomes a space after the prompt. Generic path:
  vLLM's prefix/read offsets -- decode a short window of recent ids each step and emit what
  grew past the window's already-emitted prefix, unless it ends in U+FFFD (bytes still
  arriving). Emitted text is never taken back, so a decoder whose text for earlier ids depends
  on later ones (ByteFallback turning a whole invalid byte run into U+FFFDs, clean-up of " .")
  can differ from the one-shot decode on such sequences.

Token names (`TokenNames`): what logprobs call each token, as vLLM does, computed once per id.
Its bytes are the UTF-8 it adds to the text, as OpenAI's logprobs ``bytes``: on byte-level BPE
the token's own bytes (a part of a character included), elsewhere the UTF-8 of its text (a
byte-fallback token ``<0xXX>``: that byte). Its text is ``tokenizer.decode([id])`` with
special tokens kept (a SentencePiece word keeps the leading space decode strips from a lone
token, as vLLM restores it), except where a character is split across tokens: there, as vLLM
reads such tokens in their sequence, a token is named by the characters its bytes finish after
the bytes the tokens before it left unfinished, so the token that completes a character
carries it whole and the ones before it read "" (vLLM gets the same from decoding with up to 4
preceding tokens, but loses the whole characters of a token that also starts one). A
sequence's token names thus join into its text, as its bytes do.

Stop strings (design note). A sequence stops as soon as its text contains a stop string: the
match that ends first wins, and of matches ending at the same character the longest. The text
is cut just before it (just after it with include_stop_str_in_output); nothing after the cut is
ever emitted. Without include_stop_str_in_output the longest suffix of the unemitted text that
is a proper prefix of a stop string is held back, because it may still become a stop; a later
call releases it once it cannot, and `finish()` releases it when the sequence ends otherwise.
With include_stop_str_in_output nothing needs holding: a partial stop is output either way.
Matching only needs the text's last ``max(len(stop)) - 1`` characters (the window) plus the new
text, so each call costs O(new text + window), not O(text).
"""

from __future__ import annotations

import codecs
import functools
import re
from codecs import utf_8_decode
from collections.abc import Sequence
from dataclasses import dataclass, field

import tokenizers
from headrace.sdk.config import GenerationConfig
from headrace.sdk.outputs import TokenLogprob
from tokenizers import decoders, models
from transformers import PreTrainedTokenizerBase

#: Prompt ids decoded ahead of the output on the generic path (vLLM uses the same 5).
PROMPT_TAIL_TOKENS = 5


@dataclass(slots=True)
class TextDelta:
    #: New text safe to stream now (may be "").
    text: str
    #: The stop string matched in this call, if any; the sequence must then stop.
    stop_string: str | None


class _ByteStream:
    """Fast path: text of a byte-level BPE sequence from per-id bytes and a UTF-8 carry-over."""

    __slots__ = ("added", "pending", "pieces")

    def __init__(self, pieces: list[str | bytes | None], added: dict[int, str]) -> None:
        #: Per token id: its text when its bytes are valid UTF-8 alone, else its bytes;
        #: None for an added token written verbatim (its text is in `added`).
        self.pieces = pieces
        self.added = added
        #: Bytes of a character still arriving (at most 3).
        self.pending = b""

    def decode(self, token_ids: list[int]) -> str:
        text = ""
        for token_id in token_ids:
            try:
                piece = self.pieces[token_id]
            except IndexError:
                continue  # an id past the vocab (padded embedding row): decode drops it too
            if isinstance(piece, str) and not self.pending:
                text += piece
            elif piece is None:
                text += self.flush() + self.added[token_id]
            else:
                data = piece if isinstance(piece, bytes) else piece.encode()
                text += self._decode_bytes(data)
        return text

    def flush(self) -> str:
        """Ends the byte run: an incomplete character becomes U+FFFD, as in a one-shot decode."""
        if not self.pending:
            return ""
        text = utf_8_decode(self.pending, "replace", True)[0]
        self.pending = b""
        return text

    def _decode_bytes(self, data: bytes) -> str:
        data = self.pending + data
        text, num_consumed = utf_8_decode(data, "replace", False)
        self.pending = data[num_consumed:]
        return text


class _OffsetWindow:
    """Generic path: vLLM's prefix/read offsets over any tokenizer's ``decode``."""

    __slots__ = ("num_prefix_ids", "prefix_text", "skip_special_tokens", "token_ids", "tokenizer")

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        #: The window: ids whose text was emitted (the prefix), then ids not yet emitted.
        self.token_ids = list(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        self.num_prefix_ids = len(self.token_ids)
        self.prefix_text = self._decode()

    def decode(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        text = self._decode()
        if len(text) <= len(self.prefix_text) or text.endswith("\ufffd"):
            return ""  # nothing new yet, or a character's bytes are still arriving
        new_text = text[len(self.prefix_text) :]
        # The ids just emitted become the next window's prefix.
        del self.token_ids[: self.num_prefix_ids]
        self.num_prefix_ids = len(self.token_ids)
        self.prefix_text = self._decode()
        return new_text

    def flush(self) -> str:
        return self._decode()[len(self.prefix_text) :]

    def _decode(self) -> str:
        if not self.token_ids:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        assert isinstance(text, str)
        return text


class _StopMatcher:
    """Finds stop strings in window + new text, and how much of it to hold back."""

    __slots__ = ("first_chars", "prefixes", "stops", "window_len")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        #: Every proper prefix of every stop string.
        self.prefixes = frozenset(s[:i] for s in stops for i in range(1, len(s)))
        self.first_chars = frozenset(s[0] for s in stops)
        #: Characters of text a stop string can still reach back into.
        self.window_len = max(map(len, stops)) - 1

    def find(self, text: str) -> tuple[str, int] | None:
        """The match ending first (longest on a tie) as (stop string, end), or None."""
        best: tuple[str, int] | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or end < best[1] or (end == best[1] and len(stop) > len(best[0])):
                best = (stop, end)
        return best

    def num_held(self, text: str, start: int) -> int:
        """Length of the longest suffix of text[start:] that is a proper prefix of a stop."""
        low = max(start, len(text) - self.window_len)
        best = len(text)
        for char in self.first_chars:
            i = text.find(char, low)
            while 0 <= i < best:
                if text[i:] in self.prefixes:
                    best = i
                    break
                i = text.find(char, i + 1)
        return len(text) - best


@functools.lru_cache(maxsize=1024)
def _stop_matcher(stops: tuple[str, ...]) -> _StopMatcher | None:
    return _StopMatcher(stops) if stops else None


@dataclass(slots=True, eq=False)
class DetokenizerState:
    """One sequence's detokenization; owned by the `Detokenizer` that made it."""

    source: _ByteStream | _OffsetWindow
    #: None when the request has no stop strings.
    stop_matcher: _StopMatcher | None
    include_stop_str: bool
    #: The last `window_len` characters of text seen; its last `num_held` are not emitted yet.
    window: str = ""
    num_held: int = 0
    #: The stop string that ended the sequence, if one did.
    stop_string: str | None = None
    #: A stop string matched or `finish()` ran: later calls emit nothing.
    is_done: bool = False
    _emitted: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""


#: A byte-fallback token (SentencePiece's ``<0xE4>``): one raw byte.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
#: SentencePiece's (Metaspace's) mark of a word that follows a space.
_SPACE_MARKER = "\u2581"
#: The most tokens one character's bytes span (UTF-8 has at most 4 bytes a character).
_MAX_CHAR_TOKENS = 4
_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


def _utf8_decoder() -> codecs.IncrementalDecoder:
    """Holds an unfinished character's bytes; invalid bytes read U+FFFD, as decode has them."""
    return _Utf8Decoder("replace")


class TokenNames:
    """Each token's text and bytes as logprobs name it (see the module note), by id."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        pieces: list[str | bytes | None] | None,
        added: dict[int, str],
    ) -> None:
        self.tokenizer = tokenizer
        #: Byte-level BPE: every id's piece (its text if valid UTF-8 alone, else its bytes) and
        #: the added tokens' text; None on other tokenizers, which decode each id once.
        self._pieces = pieces
        self._added = added
        self._names: dict[int, tuple[str, bytes]] = {}
        #: Named ids whose bytes are not whole UTF-8 characters alone.
        self._partial: set[int] = set()

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """The token's name alone: decode's text and its bytes."""
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self._name(token_id)
            try:
                name[1].decode()
            except UnicodeDecodeError:
                self._partial.add(token_id)
        return name

    def name(self, entry: TokenLogprob, preceding_ids: Sequence[int]) -> None:
        """Fill in the entry's token, token_bytes and top_tokens; ``preceding_ids`` are the
        sequence's tokens before the entry's position (the alternatives share them)."""
        pending = self._pending(preceding_ids)
        entry.token, entry.token_bytes = self._read(entry.token_id, pending)
        entry.top_tokens = [self._read(token_id, pending) for token_id, _ in entry.top]

    def name_prompt(self, logprobs: list[TokenLogprob], prompt_token_ids: list[int]) -> None:
        """Name prompt logprobs: entry k scores prompt token k + 1."""
        for k, entry in enumerate(logprobs):
            self.name(entry, prompt_token_ids[max(0, k + 1 - _MAX_CHAR_TOKENS) : k + 1])

    def _read(self, token_id: int, pending: bytes) -> tuple[str, bytes]:
        """The token's text after ``pending`` bytes of an unfinished character: the characters
        its bytes finish, and nothing of a character it leaves unfinished."""
        text, data = self(token_id)
        if pending or self._is_partial(token_id):
            decoder = _utf8_decoder()
            decoder.setstate((pending, 0))
            text = decoder.decode(data)
        return text, data

    def _is_partial(self, token_id: int) -> bool:
        """Whether the token's bytes are not whole UTF-8 characters alone."""
        self(token_id)
        return token_id in self._partial

    def _pending(self, preceding_ids: Sequence[int]) -> bytes:
        """The bytes of a character the preceding tokens began and did not finish."""
        if not preceding_ids or not self._is_partial(preceding_ids[-1]):
            return b""  # a token whole in itself ends on a character boundary
        decoder = _utf8_decoder()
        decoder.decode(b"".join(self(t)[1] for t in preceding_ids[-_MAX_CHAR_TOKENS:]))
        pending: bytes = decoder.getstate()[0]
        return pending

    def _decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        assert isinstance(text, str)
        return text

    def _name(self, token_id: int) -> tuple[str, bytes]:
        if self._pieces is None:
            return self._decoded_name(token_id)
        if token_id in self._added:
            text = self._added[token_id]
            return text, text.encode()
        piece = self._pieces[token_id] if 0 <= token_id < len(self._pieces) else None
        if isinstance(piece, bytes):
            return utf_8_decode(piece, "replace", True)[0], piece
        return (piece, piece.encode()) if piece else ("", b"")

    def _decoded_name(self, token_id: int) -> tuple[str, bytes]:
        text = self._decode([token_id])
        piece = str(self.tokenizer.convert_ids_to_tokens(token_id))
        if byte := _BYTE_TOKEN.fullmatch(piece):
            return text, bytes([int(byte.group(1), 16)])
        if piece.startswith(_SPACE_MARKER) and not text.startswith(" "):
            text = " " + text  # decode strips a lone word's leading space; the text has it
        return text, text.encode()


class Detokenizer:
    """Turns each sequence's new token ids into text deltas; one per engine."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        tables = _byte_level_tables(tokenizer)
        #: Fast-path pieces per skip_special_tokens value, or None on the generic path.
        self._pieces: dict[bool, list[str | bytes | None]] | None = None
        self._added: dict[int, str] = {}
        if tables is None:
            #: What logprobs call each token.
            self.token_names = TokenNames(tokenizer, None, {})
        else:
            pieces, added, special_ids = tables
            self.token_names = TokenNames(tokenizer, pieces, added)
            keep = list(pieces)
            for token_id in added:
                keep[token_id] = None
            skip = list(keep)
            for token_id in special_ids:
                skip[token_id] = ""  # skipped: the byte run goes on across it
            self._pieces = {False: keep, True: skip}
            self._added = added

    @property
    def is_byte_level(self) -> bool:
        """Whether the fast path serves this tokenizer (tests pin which path a tokenizer
        takes, since both must produce the same text)."""
        return self._pieces is not None

    def new_state(self, prompt_token_ids: list[int], config: GenerationConfig) -> DetokenizerState:
        source: _ByteStream | _OffsetWindow
        if self._pieces is not None:
            source = _ByteStream(self._pieces[config.skip_special_tokens], self._added)
        else:
            source = _OffsetWindow(self.tokenizer, prompt_token_ids, config.skip_special_tokens)
        return DetokenizerState(
            source, _stop_matcher(config.stop), config.include_stop_str_in_output
        )

    def add_tokens(self, state: DetokenizerState, token_ids: list[int]) -> TextDelta:
        """The text the newly generated token_ids make safe to stream, and any stop matched."""
        if state.is_done:
            return TextDelta("", None)
        return _release(state, state.source.decode(token_ids), is_final=False)

    def finish(self, state: DetokenizerState) -> str:
        """The sequence ended other than by a stop string: the text still held back."""
        if state.is_done:
            return ""
        text = _release(state, state.source.flush(), is_final=True).text
        state.is_done = True
        return text


def _release(state: DetokenizerState, new_text: str, is_final: bool) -> TextDelta:
    """Emits new_text minus any stop string and what follows it, holding back partial stops."""
    matcher = state.stop_matcher
    if matcher is None:
        if new_text:
            state._emitted.append(new_text)
        return TextDelta(new_text, None)
    text = state.window + new_text
    start = len(state.window) - state.num_held  # first character not yet emitted
    match = matcher.find(text)
    if match is not None:
        stop, end = match
        cut = end if state.include_stop_str else end - len(stop)
        state.stop_string = stop
        state.is_done = True
        return _emit(state, text[start:cut], stop)
    num_held = 0
    if not (is_final or state.include_stop_str):
        num_held = matcher.num_held(text, start)
    state.window = text[max(0, len(text) - matcher.window_len) :]
    state.num_held = num_held
    return _emit(state, text[start : len(text) - num_held], None)


def _emit(state: DetokenizerState, text: str, stop_string: str | None) -> TextDelta:
    if text:
        state._emitted.append(text)
    return TextDelta(text, stop_string)


# --- byte-level vocab -----------------------------------------------------------------------


def _byte_level_tables(
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[list[str | bytes | None], dict[int, str], list[int]] | None:
    """Per-id pieces, added tokens' text by id, special ids -- or None unless byte-level.

    Mirrors ``tokenizers``' ``decode``: a model token's characters map back to bytes through
    the GPT-2 byte-to-unicode table (a token with a character outside it is its own UTF-8);
    added tokens are written verbatim. Only used where ``tokenizer.decode`` is exactly that:
    a plain ByteLevel decoder and no clean-up of spaces (transformers 5 skips the clean-up
    for BPE models unless told to corrupt their output).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and (
        not isinstance(backend.model, models.BPE) or bool(getattr(tokenizer, forced, False))
    )
    if cleans_up:
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    added_tokens = backend.get_added_tokens_decoder()
    num_ids = max([*vocab.values(), *added_tokens.keys()], default=-1) + 1
    pieces: list[str | bytes | None] = [""] * num_ids  # ids with no token decode to nothing
    byte_of = _unicode_to_byte()
    for token, token_id in vocab.items():
        try:
            data = bytes([byte_of[char] for char in token])
        except KeyError:
            data = token.encode()
        try:
            pieces[token_id] = data.decode()
        except UnicodeDecodeError:
            pieces[token_id] = data
    added = {token_id: token.content for token_id, token in added_tokens.items()}
    special_ids = [token_id for token_id, token in added_tokens.items() if token.special]
    return pieces, added, special_ids


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: printable bytes stand for themselves, the rest
    (controls, space, 0x7F-0xA0, 0xAD) for code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    byte_of = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    byte_of.update({chr(256 + i): b for i, b in enumerate(others)})
    return byte_of
