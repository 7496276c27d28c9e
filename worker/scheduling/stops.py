"""Whether a sample ends with the token it just drew, and why (the stop checks).

A question only: `check_stop` reads a sequence and answers; the scheduler, which owns a
sequence's status, acts on the answer (`Scheduler.update_from_output`).
"""

from __future__ import annotations

from dataclasses import dataclass

from headrace.sdk.errors import HeadraceError, InvalidArgumentError
from headrace.sdk.outputs import FinishReason
from headrace.worker.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Stop:
    """Why a sample ends now; a stop for an error carries the error its request fails with."""

    reason: FinishReason
    error: HeadraceError | None = None


def check_stop(
    seq: Sequence, token_id: int, hit_stop_string: bool, max_model_len: int
) -> Stop | None:
    """Why ``seq`` (token_id already appended) ends now, or None to go on.

    A stop string always ends it; a stop token id (EOS included unless ignore_eos) only once
    min_tokens are out; so does a whole output constraint; then the length limits: max_tokens,
    or the model's context. A token the constraint refused (the other controls left it no
    token) ends the sample with an error.
    """
    grammar = seq.controls.grammar if seq.controls is not None else None
    if grammar is not None and grammar.rejected_token is not None:
        error = InvalidArgumentError(
            "config", "no token satisfies both the constraint and the logit controls"
        )
        return Stop(FinishReason.ERROR, error)
    if hit_stop_string or (grammar is not None and grammar.is_terminated):
        return Stop(FinishReason.STOP)
    num_output = seq.num_output_tokens
    if token_id in seq.stop_token_ids and num_output >= seq.config.min_tokens:
        return Stop(FinishReason.STOP)
    if num_output >= seq.config.max_tokens or seq.num_tokens >= max_model_len:
        return Stop(FinishReason.LENGTH)
    return None
