"""Batched sampling: one next token per row of a [B, V] logits batch.

Stages, in the order HF and vLLM apply them, each run on the rows that need it only:
  1. history processors: repetition penalty (prompt + output), presence / frequency penalties
     (output), no_repeat_ngram_size bans, min_tokens bans on the stop token ids;
  2. logit controls (`controls.py`): logit bias, allowed token ids, bad words, and the token
     bitmask of an output constraint (JSON schema, regex, grammar, choice);
  3. greedy rows (temperature 0) take the argmax;
  4. sampling rows: temperature, top-k, top-p, min-p, then a seeded Gumbel-max race
     (the kernel set's `draw_tokens`, keys from `headrace.worker.sampling.draw`: on the CPU a
     C kernel that makes noise only for the tokens that could still win, and tests top-p on
     the winners instead of sorting).
Logprobs are of the raw logits, before any stage. A batch of plain greedy rows is one argmax
(`sequence.is_plain_greedy` says which rows are). After the pick, each constrained row's grammar
advances by its token. The engine's kernel set comes in through the constructor; the module
functions that run a stage take it as an argument.
"""

from __future__ import annotations

import collections.abc
import math
from dataclasses import dataclass, field
from typing import cast

import torch
from headrace.kernels import KernelSet
from headrace.kernels.sampling import argmax
from headrace.sdk.config import GenerationConfig
from headrace.sdk.outputs import TokenLogprob
from headrace.worker.sampling.controls import advance_grammars, apply_controls
from headrace.worker.sampling.draw import seeded_keys
from headrace.worker.sampling.logprobs import token_logprobs
from headrace.worker.sampling.ops import column, select_rows
from headrace.worker.sampling.penalties import apply_bans, apply_penalties
from headrace.worker.sampling.warpers import apply_min_p, apply_top_k, apply_top_p, top_p_floor
from headrace.worker.sequence import Sequence, has_penalty


@dataclass(slots=True)
class SamplerOutput:
    #: The sampled token of each row.
    token_ids: list[int]
    #: Each row's logprobs; None where the row's config.logprobs is None.
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, vocab_size: int, kernels: KernelSet, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        #: Draws the sampling rows' tokens and applies the grammar masks.
        self.kernels = kernels
        # Draws the keys of rows with no seed of their own (one batched call per step).
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: collections.abc.Sequence[Sequence],
        positions: list[int] | None = None,
    ) -> SamplerOutput:
        """Sample each row's next token; logits is [B, V] and row i belongs to seqs[i].
        ``positions``: the position each row's token takes (default: its sequence's next,
        num_tokens; a speculating sequence's rows are several positions of one sequence), on
        which a seeded row's draw depends."""
        assert logits.shape == (len(seqs), self.vocab_size), logits.shape
        plan = _Plan.of(seqs)
        if plan.is_plain_greedy:
            return SamplerOutput(argmax(logits).tolist(), [None] * len(seqs))
        logits = logits.float()
        processed = _apply_history(logits, seqs, plan, self.kernels)
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if plan.greedy_rows:
            token_ids[plan.greedy_rows] = argmax(select_rows(processed, plan.greedy_rows))
        if plan.sample_rows:
            token_ids[plan.sample_rows] = self._draw(
                processed, seqs, plan, processed is logits, positions
            )
        logprobs = token_logprobs(logits, token_ids, seqs, plan.logprob_rows)
        picked = token_ids.tolist()
        advance_grammars(seqs, picked, plan.control_rows)
        return SamplerOutput(picked, logprobs)

    def _draw(
        self,
        processed: torch.Tensor,
        seqs: collections.abc.Sequence[Sequence],
        plan: _Plan,
        shared: bool,
        positions: list[int] | None = None,
    ) -> torch.Tensor:
        """The sampling rows' tokens. ``shared``: processed is the raw logits (not to write)."""
        configs = [seqs[row].config for row in plan.sample_rows]
        device = processed.device
        x = select_rows(processed, plan.sample_rows)
        if any(0 < c.top_k < self.vocab_size for c in configs):
            if shared and x is processed:
                x = x.clone()
            _mask_top_k(x, configs)
        rows = plan.sample_rows
        at = [seqs[i].num_tokens if positions is None else positions[i] for i in rows]
        keys = self._noise_keys([seqs[i] for i in rows], at).to(device)
        return self.kernels.draw_tokens(
            x,
            column([c.temperature for c in configs], device).view(-1),
            top_p_floor(configs, device).view(-1),
            column([c.min_p for c in configs], device).view(-1),
            keys,
        )

    def _noise_keys(self, seqs: list[Sequence], positions: list[int]) -> torch.Tensor:
        """[S, 2] int64 noise key per row: an odd multiplier and an offset, both < 2**32.

        A seeded row's key is a function of (sample_seed, position) alone; other rows get
        fresh keys from the sampler's generator.
        """
        seeded = [i for i, seq in enumerate(seqs) if seq.sample_seed is not None]
        unseeded = [i for i, seq in enumerate(seqs) if seq.sample_seed is None]
        keys = torch.empty(len(seqs), 2, dtype=torch.long)
        keys[unseeded] = torch.randint(0, 1 << 32, (len(unseeded), 2), generator=self._generator)
        keys[seeded] = seeded_keys(
            [cast(int, seqs[i].sample_seed) for i in seeded], [positions[i] for i in seeded]
        )
        keys[:, 0] |= 1
        return keys


def process_logits(
    logits: torch.Tensor, seqs: collections.abc.Sequence[Sequence], kernels: KernelSet
) -> torch.Tensor:
    """The [B, V] logits each row draws from: greedy rows take their argmax, sampling rows
    draw from their softmax. For inspection and tests; the sampler does not build this."""
    plan = _Plan.of(seqs)
    processed, warped = _process(logits.float(), seqs, plan, kernels)
    out = processed.clone()
    if warped is not None:
        out[plan.sample_rows] = warped
    return out


# --- planning ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    """Which batch rows each stage touches, from one pass over the batch; rows ascend."""

    greedy_rows: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    #: Rows with a repetition, presence or frequency penalty.
    penalty_rows: list[int] = field(default_factory=list)
    ngram_rows: list[int] = field(default_factory=list)
    #: Rows still short of min_tokens, with stop token ids to hold back.
    min_tokens_rows: list[int] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    #: Rows with logit controls (bias, allowed ids, bad words, a constraint).
    control_rows: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, seqs: collections.abc.Sequence[Sequence]) -> _Plan:
        plan = cls()
        for row, seq in enumerate(seqs):
            config = seq.config
            (plan.greedy_rows if config.is_greedy else plan.sample_rows).append(row)
            if has_penalty(config):
                plan.penalty_rows.append(row)
            if config.no_repeat_ngram_size:
                plan.ngram_rows.append(row)
            if config.min_tokens > seq.num_output_tokens and seq.stop_token_ids:
                plan.min_tokens_rows.append(row)
            if config.logprobs is not None:
                plan.logprob_rows.append(row)
            if seq.controls is not None:
                plan.control_rows.append(row)
        return plan

    @property
    def needs_history(self) -> bool:
        rows = self.penalty_rows or self.ngram_rows or self.min_tokens_rows or self.control_rows
        return bool(rows)

    @property
    def is_plain_greedy(self) -> bool:
        return not (self.sample_rows or self.needs_history or self.logprob_rows)


def apply_history(
    x: torch.Tensor, seqs: collections.abc.Sequence[Sequence], kernels: KernelSet
) -> torch.Tensor:
    """x ([B, V], row i of seqs[i]) after the penalties, bans and logit controls its rows
    need (stage 1 and 2 above): a copy where any apply, else x itself."""
    return _apply_history(x, seqs, _Plan.of(seqs), kernels)


def _apply_history(
    logits: torch.Tensor,
    seqs: collections.abc.Sequence[Sequence],
    plan: _Plan,
    kernels: KernelSet,
) -> torch.Tensor:
    """The logits after penalties and bans: a copy where any apply, else logits itself."""
    if not plan.needs_history:
        return logits
    processed = logits.clone(memory_format=torch.contiguous_format)
    apply_penalties(processed, seqs, plan.penalty_rows)
    apply_bans(processed, seqs, plan.ngram_rows, plan.min_tokens_rows)
    apply_controls(processed, seqs, plan.control_rows, kernels)
    return processed


def _mask_top_k(x: torch.Tensor, configs: list[GenerationConfig]) -> None:
    """Set to -inf, in place, what top-k removes from x / temperature (HF warps the scaled
    logits; masking the unscaled ones where the scaled are removed keeps its tie rule)."""
    rows = [i for i, c in enumerate(configs) if 0 < c.top_k < x.shape[1]]
    top_k_configs = [configs[i] for i in rows]
    scaled = x[rows] / column([c.temperature for c in top_k_configs], x.device)
    apply_top_k(scaled, top_k_configs)
    x[rows] = x[rows].masked_fill_(scaled == -math.inf, -math.inf)


def _process(
    logits: torch.Tensor,
    seqs: collections.abc.Sequence[Sequence],
    plan: _Plan,
    kernels: KernelSet,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(history-processed logits [B, V], warped logits of the sampling rows [S, V] or None),
    for `process_logits`. logits itself is never written."""
    processed = _apply_history(logits, seqs, plan, kernels)
    if not plan.sample_rows:
        return processed, None
    configs = [seqs[row].config for row in plan.sample_rows]
    temperatures = column([c.temperature for c in configs], processed.device)
    warped = select_rows(processed, plan.sample_rows) / temperatures  # a new tensor
    apply_top_k(warped, configs)
    apply_top_p(warped, configs)
    apply_min_p(warped, configs)
    return processed, warped
