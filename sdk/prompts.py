"""What a prompt may be, for every API that takes one (SDK, offline `LLM`, engine, wire)."""

from __future__ import annotations

#: Text (tokenized by the server's tokenizer) or token ids.
Prompt = str | list[int]
