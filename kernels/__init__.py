"""Attention and KV-cache kernels behind one small interface, with torch reference twins."""

from headrace.kernels.attention import AttentionMetadata, paged_attention, write_kv_cache

__all__ = ["AttentionMetadata", "paged_attention", "write_kv_cache"]
