"""What the router can tell about a prompt before any worker sees it.

The router has no tokenizer (it imports no model code), so a text prompt's token count is an
estimate (`CHARS_PER_TOKEN`), good for queue accounting only. Whether a prompt can ever be
served is exact: the workers' load reports say their context, KV pool and the longest text
they take (`max_prompt_bytes`: beyond it no tokenization could fit the context). A prompt no
worker in rotation could ever take is refused at admission, in milliseconds, instead of
waiting in the queue for room that never comes.
"""

from __future__ import annotations

from collections.abc import Sequence

from headrace.protos import worker_pb2
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Chat, Prompt

CHARS_PER_TOKEN = 4


#: Tokens a chat template adds around each message (role markers, separators), a guess.
TEMPLATE_TOKENS_PER_MESSAGE = 4


def estimate_tokens(prompt: Prompt) -> int:
    """Prompt tokens for queue accounting: exact for token ids, estimated for text and chat."""
    if isinstance(prompt, str):
        return max(1, len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, Chat):
        content = sum(len(message.content) for message in prompt.messages) // CHARS_PER_TOKEN
        return max(1, content + TEMPLATE_TOKENS_PER_MESSAGE * len(prompt.messages))
    return len(prompt)


def affinity_text(prompt: str | Chat) -> str:
    """The text whose start identifies a prompt's prefix (prefix-affinity routing)."""
    if isinstance(prompt, Chat):
        return "".join(f"{m.role}\n{m.content}\n" for m in prompt.messages)
    return prompt


def check_fits(prompt: Prompt, reports: Sequence[worker_pb2.LoadReport | None]) -> None:
    """Raise InvalidArgumentError (field "prompt", with the limit) if no worker reporting
    ``reports`` could ever take the prompt. Workers that have not reported yet count as able."""
    known = [report for report in reports if report is not None]
    if not known or len(known) < len(reports):
        return
    if isinstance(prompt, str | Chat):
        num_bytes = len(prompt.encode()) if isinstance(prompt, str) else prompt.num_content_bytes
        limit = max(report.max_prompt_bytes or num_bytes for report in known)
        if num_bytes > limit:
            raise InvalidArgumentError(
                "prompt", f"has {num_bytes} bytes; the workers take at most {limit}"
            )
        return
    limit = max(_max_prompt_tokens(report) for report in known)
    if len(prompt) > limit:
        raise InvalidArgumentError(
            "prompt",
            f"has {len(prompt)} tokens; the workers take at most {limit} (their context must "
            "hold the prompt plus one generated token)",
        )


def _max_prompt_tokens(report: worker_pb2.LoadReport) -> int:
    """Most prompt tokens the worker could ever hold: its context and its whole KV pool,
    each keeping room for one generated token."""
    pool_tokens = report.total_kv_blocks * max(1, report.block_size)
    return min(report.max_model_len or pool_tokens, pool_tokens) - 1
