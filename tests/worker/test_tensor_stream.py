"""Streamed weights: the SDK cuts named tensors into chunks, the worker reassembles them,
checking each tensor on its first chunk and the whole set at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from headrace.protos import control_pb2 as cpb
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.weights import tensor_chunks
from headrace.worker.models.weight_check import WeightChecker
from headrace.worker.serving.tensor_stream import TensorAssembler
from safetensors.torch import load_file
from transformers import AutoConfig

from tests.factories import cached_checkpoint


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return cached_checkpoint("llama", seed=1)


@pytest.fixture
def assembler(checkpoint: Path) -> TensorAssembler:
    checker = WeightChecker.for_model(
        checkpoint, AutoConfig.from_pretrained(checkpoint), torch.float32
    )
    return TensorAssembler(checker)


def tensors(checkpoint: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {n: t.to(dtype) for n, t in load_file(str(checkpoint / "model.safetensors")).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensors_cut_into_small_chunks_come_back_bit_for_bit(
    checkpoint: Path, assembler: TensorAssembler, dtype: torch.dtype
) -> None:
    sent = tensors(checkpoint, dtype)
    chunks = list(tensor_chunks(sent.items(), "v1", chunk_bytes=1000))
    assert chunks[0].version == "v1" and not any(c.version for c in chunks[1:])
    assert max(len(c.data) for c in chunks) == 1000
    for chunk in chunks:
        assembler.add(chunk)
    received = dict(assembler.finish())
    assert received.keys() == sent.keys()
    for name, tensor in sent.items():
        assert received[name].dtype == dtype and torch.equal(received[name], tensor)


def test_an_unknown_or_misshapen_tensor_is_refused_on_its_first_chunk(
    checkpoint: Path, assembler: TensorAssembler
) -> None:
    """Refused before any of its bytes are kept: a worker never buffers what cannot load."""
    wrong = torch.zeros(64, 100)
    (first, *_rest) = tensor_chunks(
        [("model.layers.0.mlp.down_proj.weight", wrong)], "v", chunk_bytes=64
    )
    with pytest.raises(InvalidArgumentError, match=r"down_proj\.weight: checkpoint tensor has"):
        assembler.add(first)
    (unknown, *_rest) = tensor_chunks([("model.head.weight", torch.zeros(4))], "v")
    with pytest.raises(InvalidArgumentError, match=r"unexpected weights: model\.head\.weight"):
        assembler.add(unknown)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        ("reorder", "chunk at byte 1000, expected 0"),
        ("truncate", "got 1000 of its"),
        ("repeat", "sent twice"),
        ("drop", "missing weights: model.norm.weight"),
        ("dtype", "dtype must be one of"),
    ],
)
def test_a_broken_stream_is_refused(
    checkpoint: Path, assembler: TensorAssembler, mangle: str, message: str
) -> None:
    sent = tensors(checkpoint)
    chunks = list(tensor_chunks(sent.items(), "v", chunk_bytes=1000))
    embed = [c for c in chunks if c.name == "model.embed_tokens.weight"]
    others = [c for c in chunks if c.name != "model.embed_tokens.weight"]
    if mangle == "reorder":
        chunks = [embed[1], embed[0], *others]
    elif mangle == "truncate":
        chunks = [embed[0], *others]
    elif mangle == "repeat":
        chunks = [*chunks, embed[0]]
    elif mangle == "drop":
        chunks = [c for c in chunks if c.name != "model.norm.weight"]
    else:
        chunks[0] = cpb.WeightsChunk(**{**_fields(chunks[0]), "dtype": "int8"})
    with pytest.raises(InvalidArgumentError, match=message):
        for chunk in chunks:
            assembler.add(chunk)
        assembler.finish()


def _fields(chunk: cpb.WeightsChunk) -> dict[str, object]:
    return {field.name: value for field, value in chunk.ListFields()}
