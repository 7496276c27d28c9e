"""Llama-family models behind a registry keyed by model_type."""
