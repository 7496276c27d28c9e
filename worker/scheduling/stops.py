"""Whether a sample ends with the token it just drew, and why (the stop checks)."""

from __future__ import annotations

from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.outputs import FinishReason
from headrace.worker.sequence import Sequence


def finish_reason(
    seq: Sequence, token_id: int, hit_stop_string: bool, max_model_len: int
) -> FinishReason | None:
    """The reason ``seq`` (token_id already appended) finishes now, or None to go on.

    A stop string always ends it; a stop token id (EOS included unless ignore_eos) only once
    min_tokens are out; so does a whole output constraint; then the length limits: max_tokens,
    or the model's context. A token the constraint refused (the other controls left it no
    token) ends the sample with an error.
    """
    grammar = seq.controls.grammar if seq.controls is not None else None
    if grammar is not None and grammar.rejected_token is not None:
        seq.error = InvalidArgumentError(
            "config", "no token satisfies both the constraint and the logit controls"
        )
        return FinishReason.ERROR
    if hit_stop_string or (grammar is not None and grammar.is_terminated):
        return FinishReason.STOP
    num_output = seq.num_output_tokens
    if token_id in seq.stop_token_ids and num_output >= seq.config.min_tokens:
        return FinishReason.STOP
    if num_output >= seq.config.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
