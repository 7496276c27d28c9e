"""Logit controls: what a request's config does to its logits before a token is picked.

Per sample, a `RowControls` holds what intake prepared once: the logit bias (ids and amounts,
added to the logits as OpenAI does), the allowed token ids (everything else -inf), the bad
words as token sequences (the last token of a sequence is banned where the tokens so far end
with the rest of it; a one-token word is always banned), and the sample's `GrammarState` for
an output constraint. `apply_controls` runs them on the rows that have any, in that order:
bias, allow-list, bad words, grammar mask. Rows without controls pay nothing.

`LogitControls` (one per engine) checks a config's ids against the vocabulary, tokenizes bad
words, compiles the constraint (cached) and makes each sample's controls; for a request the
router resumed after a failure it advances the grammar over the tokens generated before.
"""

from __future__ import annotations

import collections.abc
import math
from dataclasses import dataclass

import torch
from headrace.kernels import KernelSet
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.sampling.constraints import (
    ConstraintCompiler,
    GrammarState,
    apply_grammar_masks,
)
from headrace.worker.sequence import Sequence
from transformers import PreTrainedTokenizerBase


@dataclass(slots=True, eq=False)
class RowControls:
    """One sample's logit controls (tensors shared by a request's samples)."""

    #: [K] int64 token ids and [K] float32 amounts of the logit bias; None without one.
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    #: [A] int64 ids the sample may pick; None: any.
    allowed_ids: torch.Tensor | None = None
    #: Each bad word's token sequences.
    bad_words: tuple[tuple[int, ...], ...] = ()
    #: The sample's place in its output constraint; None without one.
    grammar: GrammarState | None = None


class LogitControls:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compiler = ConstraintCompiler(tokenizer, vocab_size, eos_token_ids)

    def check(self, config: GenerationConfig) -> None:
        """InvalidArgumentError naming the field for an id outside the vocabulary."""
        for name, ids in (
            ("config.logit_bias", list(config.logit_bias or ())),
            ("config.allowed_token_ids", list(config.allowed_token_ids)),
        ):
            outside = [token_id for token_id in ids if token_id >= self.vocab_size]
            if outside:
                raise InvalidArgumentError(
                    name, f"token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
                )

    def for_samples(
        self, config: GenerationConfig, num_samples: int, resumed_token_ids: list[int]
    ) -> list[RowControls | None]:
        """Each sample's controls (None for all where the config has none). The grammar is
        advanced over ``resumed_token_ids``, the tokens an earlier attempt generated."""
        if not config.has_logit_controls:
            return [None] * num_samples
        self.check(config)
        grammar = self.compiler.compile(config)
        shared = self._shared(config)
        controls: list[RowControls | None] = []
        for _ in range(num_samples):
            state = GrammarState(grammar) if grammar is not None else None
            if state is not None and not all(state.accept(t) for t in resumed_token_ids):
                raise InvalidArgumentError(
                    "num_resumed_tokens", "the resumed tokens do not satisfy the constraint"
                )
            controls.append(
                RowControls(
                    shared.bias_ids, shared.bias_values, shared.allowed_ids, shared.bad_words, state
                )
            )
        return controls

    def _shared(self, config: GenerationConfig) -> RowControls:
        shared = RowControls(bad_words=self._bad_word_ids(config.bad_words))
        if config.logit_bias:
            shared.bias_ids = torch.tensor(list(config.logit_bias), dtype=torch.long)
            shared.bias_values = torch.tensor(list(config.logit_bias.values()))
        if config.allowed_token_ids:
            shared.allowed_ids = torch.tensor(sorted(set(config.allowed_token_ids)))
        return shared

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word as tokenized alone and after a space (as it appears mid-text)."""
        sequences: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    sequences[ids] = None
        return tuple(sequences)


def apply_controls(
    x: torch.Tensor,  # [B, V] float32, edited in place
    seqs: collections.abc.Sequence[Sequence],
    rows: list[int],  # rows whose sequence has controls
    kernels: KernelSet,  # applies the grammar masks
) -> None:
    grammar_rows: list[int] = []
    for row in rows:
        seq = seqs[row]
        controls = seq.controls
        assert controls is not None
        if controls.bias_ids is not None and controls.bias_values is not None:
            x[row].index_add_(0, controls.bias_ids.to(x.device), controls.bias_values.to(x.device))
        if controls.allowed_ids is not None:
            allowed = controls.allowed_ids.to(x.device)
            kept = x[row, allowed]
            x[row].fill_(-math.inf)
            x[row, allowed] = kept
        banned = banned_next_tokens(controls.bad_words, seq.token_ids)
        if banned:
            x[row, banned] = -math.inf
        if controls.grammar is not None:
            grammar_rows.append(row)
    if grammar_rows:
        states = [seqs[row].controls.grammar for row in grammar_rows]  # type: ignore[union-attr]
        apply_grammar_masks(x, states, grammar_rows, kernels)  # type: ignore[arg-type]


def banned_next_tokens(bad_words: tuple[tuple[int, ...], ...], token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word after token_ids."""
    banned = []
    for word in bad_words:
        prefix = list(word[:-1])
        if not prefix or (
            len(token_ids) >= len(prefix) and token_ids[len(token_ids) - len(prefix) :] == prefix
        ):
            banned.append(word[-1])
    return banned


def advance_grammars(
    seqs: collections.abc.Sequence[Sequence], token_ids: list[int], rows: list[int]
) -> None:
    """Move each constrained row's grammar past the token it picked."""
    for row in rows:
        controls = seqs[row].controls
        if controls is not None and controls.grammar is not None:
            controls.grammar.accept(token_ids[row])
