"""`ModelSpec`: what the engine settles about its model before building it.

The checkpoint folder, its transformers config, the dtype to run in, the longest sequence,
the tokenizer and the EOS ids: read once, checked once (a bad `max_model_len` fails here,
naming the field), then passed to whatever needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.config import EngineConfig
from headrace.worker.models.compressed_tensors import COMPRESSED, CompressedScheme, read_scheme
from headrace.worker.models.config import context_length
from headrace.worker.models.gguf import projection_bits
from headrace.worker.models.registry import model_factory, read_model_type
from headrace.worker.models.store import GGUF_SUFFIX, gguf_file, resolve_model
from tokenizers import decoders
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase
from transformers import GenerationConfig as HFGenerationConfig


@dataclass(frozen=True, slots=True)
class ModelSpec:
    #: The local Hugging Face checkpoint folder.
    path: Path
    #: Its transformers config.
    hf_config: Any
    #: The dtype weights, KV cache and activations use.
    dtype: torch.dtype
    #: Longest sequence (prompt + output).
    max_model_len: int
    tokenizer: PreTrainedTokenizerBase
    #: Token ids that end a sample unless ignore_eos (generation_config.json and tokenizer).
    eos_token_ids: frozenset[int]
    #: Longest text prompt in UTF-8 bytes that could fit (or the configured limit).
    max_prompt_bytes: int
    #: How linear layers hold their weights: "none", "int8", "int4", a GGUF file's blocks
    #: as shipped, "gguf-q4" / "gguf-q8", or a compressed-tensors checkpoint's layers as
    #: stored, "compressed-tensors" (`_quantization`).
    quantization: str = "none"
    #: The GGUF file the weights are read from (a .gguf model, or "gguf" for a known model
    #: shipped as one); None: the folder's safetensors.
    gguf_file: Path | None = None

    @classmethod
    def load(cls, config: EngineConfig) -> ModelSpec:
        path = resolve_model(config.model)
        gguf = _weights_gguf(config)
        model_factory(read_model_type(path))  # before transformers reads the type
        scheme = read_scheme(path)
        quantization = _quantization(config, gguf, scheme)
        _check_int8_activations(config, quantization)
        hf_config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        max_model_len = _max_model_len(config, hf_config)
        # A text of B bytes is at least B / (longest token's bytes) tokens, so anything longer
        # than this can never fit the context: refuse it without tokenizing it.
        max_prompt_bytes = (max_model_len - 1) * _max_token_bytes(tokenizer)
        if config.max_prompt_bytes is not None:
            max_prompt_bytes = min(max_prompt_bytes, config.max_prompt_bytes)
        return cls(
            path=path,
            hf_config=hf_config,
            dtype=config.torch_dtype(_checkpoint_dtype(hf_config)),
            max_model_len=max_model_len,
            tokenizer=tokenizer,
            eos_token_ids=_eos_token_ids(path, tokenizer),
            max_prompt_bytes=max_prompt_bytes,
            quantization=quantization,
            gguf_file=gguf,
        )


def _check_int8_activations(config: EngineConfig, quantization: str) -> None:
    """Refuse int8 activations (if asked) where the layers are float."""
    if config.int8_activations and quantization == "none":
        raise InvalidArgumentError(
            "int8_activations",
            "multiply quantized layers (int8, int4, a quantized GGUF, a compressed-tensors "
            "checkpoint), not none (float weights)",
        )


def _quantization(config: EngineConfig, gguf: Path | None, scheme: CompressedScheme | None) -> str:
    """The layout the layers take (`headrace.worker.layers.linear.QUANTIZED_LAYOUTS`): as
    asked, or for "gguf" (and "auto" on a .gguf file) the file's own: "gguf-q4" or "gguf-q8",
    or "none" for a file of float projections; a compressed-tensors checkpoint's own for
    "auto" ("compressed-tensors"), dequantized for "none", and nothing else."""
    asked, compressed = config.quantization, scheme is not None
    if compressed and asked not in ("auto", "none"):
        raise InvalidArgumentError(
            "quantization",
            f"{asked}: the checkpoint is quantized already (compressed-tensors); give auto to "
            "serve it as stored or none to dequantize it",
        )
    if asked == "auto":
        asked = COMPRESSED if compressed else "gguf" if gguf is not None else "none"
    if asked != "gguf":
        return asked
    assert gguf is not None, "_weights_gguf found the file"
    bits = projection_bits(gguf)
    return "none" if bits is None else f"gguf-q{bits}"


def _weights_gguf(config: EngineConfig) -> Path | None:
    """Where the weights come from when not the folder's safetensors: a .gguf model's file
    (whatever the quantization: "none" dequantizes it), a known model's for "gguf"."""
    if not config.model.endswith(GGUF_SUFFIX) and config.quantization != "gguf":
        return None
    found = gguf_file(config.model)
    if found is None:
        raise InvalidArgumentError(
            "quantization",
            "gguf serves a GGUF file as shipped: give the model as a .gguf file or a known "
            "model name shipped as one (headrace models list), not a checkpoint folder",
        )
    return found


def _checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    model_max = context_length(hf_config) if hasattr(hf_config, "max_position_embeddings") else 2048
    limit = config.max_model_len or model_max
    if limit > model_max:
        raise InvalidArgumentError(
            "max_model_len", f"{limit} exceeds the model's context of {model_max}"
        )
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < limit:
        raise InvalidArgumentError(
            "max_num_batched_tokens",
            f"without chunked prefill it must be >= max_model_len ({limit}) so every "
            "prompt fits one step",
        )
    return limit


def _max_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for. A byte-level BPE
    vocabulary string has one character per byte; any other's UTF-8 is never shorter than
    the text it stands for (SentencePiece's "▁" is 3 bytes for a space)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
    added = tokenizer.get_added_vocab()  # written verbatim: their own UTF-8
    sizes = (
        len(token) if byte_level and token not in added else len(token.encode())
        for token in tokenizer.get_vocab()
    )
    return max(sizes, default=1)


def _eos_token_ids(path: Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    try:
        generation = HFGenerationConfig.from_pretrained(path)
        eos = generation.eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:
        pass  # no generation_config.json
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
