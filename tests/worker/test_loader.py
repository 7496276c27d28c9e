"""Each tensor-parallel rank loads its own shard of a safetensors checkpoint, and reads only
that shard from disk.

Loading only, no forward: at TP > 1 the forward calls torch.distributed collectives. Reads
are counted at safetensors' slice handle, under `CheckpointTensor`, so a loader that read a
whole tensor and sliced it in memory would be caught.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.embedding import VocabParallelEmbedding
from headrace.worker.layers.weights import CheckpointTensor, SafeSlice
from headrace.worker.models.loader import CheckpointError, checkpoint_files
from headrace.worker.models.registry import load_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.factories import build_checkpoint, cached_checkpoint

Tensors = dict[str, torch.Tensor]


class CountingSlice:
    """A safetensors slice handle that counts the elements read through it."""

    def __init__(self, name: str, source: SafeSlice, counts: Counter[str]) -> None:
        self.name, self.source, self.counts = name, source, counts

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def get_dtype(self) -> str:
        return self.source.get_dtype()

    def __getitem__(self, box: tuple[slice, ...]) -> torch.Tensor:
        tensor = self.source[box]
        self.counts[self.name] += tensor.numel()
        return tensor


@pytest.fixture
def elements_read(monkeypatch) -> Counter[str]:
    """Elements read from disk so far, per checkpoint tensor name."""
    counts: Counter[str] = Counter()
    real_whole = CheckpointTensor.whole

    def counting_whole(name: str, source: SafeSlice) -> CheckpointTensor:
        return real_whole(name, CountingSlice(name, source, counts))

    monkeypatch.setattr(CheckpointTensor, "whole", counting_whole)
    return counts


@contextmanager
def on_disk(tmp_path: Path, tensor: torch.Tensor) -> Iterator[CheckpointTensor]:
    """``tensor`` saved to a safetensors file and opened, unread."""
    path = tmp_path / "tensor.safetensors"
    save_file({"tensor": tensor}, path)
    with safe_open(path, framework="pt", device="cpu") as f:
        yield CheckpointTensor.whole("tensor", f.get_slice("tensor"))


def load_rank(path: Path, size: int, rank: int) -> Tensors:
    """Rank ``rank``'s parameters (each once, so a tied lm_head appears as the embedding)."""
    parallel = ParallelConfig(tensor_parallel_size=size, tensor_parallel_rank=rank)
    model = load_model(path, torch.float32, torch.device("cpu"), parallel=parallel).model
    return {name: param.data for name, param in model.named_parameters()}


def full_checkpoint(path: Path) -> Tensors:
    return {name: t for file in checkpoint_files(path) for name, t in load_file(file).items()}


def rows(tensor: torch.Tensor, index: int, num_pieces: int) -> torch.Tensor:
    return tensor.chunk(num_pieces)[index]


def expected_shard(
    full: Tensors, name: str, size: int, rank: int, num_kv_heads: int
) -> torch.Tensor:
    """The slice of the full checkpoint that parameter ``name`` holds on rank ``rank``."""
    module, _, kind = name.rpartition(".")  # kind: "weight" or "bias"
    prefix = module.rpartition(".")[0]
    if module.endswith("qkv_proj"):
        q, k, v = (full[f"{prefix}.{piece}_proj.{kind}"] for piece in "qkv")
        # Fewer KV heads than ranks: consecutive ranks share (replicate) one KV head.
        kv_pieces = min(size, num_kv_heads)
        kv_rank = rank * kv_pieces // size
        kv = [rows(k, kv_rank, kv_pieces), rows(v, kv_rank, kv_pieces)]
        return torch.cat([rows(q, rank, size), *kv])
    if module.endswith("gate_up_proj"):
        gate, up = (full[f"{prefix}.{piece}_proj.{kind}"] for piece in ("gate", "up"))
        return torch.cat([rows(gate, rank, size), rows(up, rank, size)])
    if module.endswith(("o_proj", "down_proj")):
        return full[name].chunk(size, dim=1)[rank]  # input columns
    if module in ("model.embed_tokens", "lm_head"):
        return rows(full[name], rank, size)  # vocab rows (512: no padding)
    return full[name]  # norms: whole on every rank


def expected_elements_read(full: Tensors, size: int, num_kv_heads: int) -> Counter[str]:
    """Per checkpoint tensor: 1/size of a sharded one, all of a replicated one."""
    replicated = ("norm.weight",)
    if num_kv_heads < size:
        replicated += ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
    return Counter(
        {name: t.numel() // (1 if name.endswith(replicated) else size) for name, t in full.items()}
    )


@pytest.mark.parametrize(
    ("family", "num_kv_heads", "kwargs", "size"),
    [
        pytest.param("llama", 2, {}, 2, id="llama-tp2"),
        pytest.param("qwen2", 1, {}, 2, id="qwen2-bias-one-kv-head-on-both-ranks"),
        pytest.param(
            "qwen3", 2, {"tie_word_embeddings": True, "sharded": True}, 2, id="qwen3-tied-files"
        ),
        pytest.param("llama", 2, {}, 1, id="llama-tp1-reads-everything-once"),
    ],
)
def test_each_rank_holds_and_reads_only_its_shard(
    family, num_kv_heads, kwargs, size, elements_read
):
    path = cached_checkpoint(family, num_kv_heads=num_kv_heads, **kwargs)
    full = full_checkpoint(path)
    for rank in range(size):
        elements_read.clear()
        params = load_rank(path, size, rank)
        for name, param in params.items():
            assert torch.equal(param, expected_shard(full, name, size, rank, num_kv_heads)), name
        assert elements_read == expected_elements_read(full, size, num_kv_heads)


def test_skipped_tensors_are_never_read(tmp_path, elements_read):
    path = build_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    skipped = ["lm_head.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]
    tensors[skipped[0]] = tensors["model.embed_tokens.weight"].clone()  # tied: ignored
    tensors[skipped[1]] = torch.ones(8)  # old checkpoints saved the rotary buffer
    save_file(tensors, path / "model.safetensors")

    load_rank(path, 2, 0)

    assert set(elements_read) == set(tensors) - set(skipped)


def test_unexpected_tensor_is_refused_without_being_read(tmp_path, elements_read):
    path = build_checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"unexpected weights: model\.layers\.0\.mystery"):
        load_rank(path, 2, 1)
    assert "model.layers.0.mystery.weight" not in elements_read


# (64, 32) is one rank's columns at TP=2: once taken as this rank's shard, now refused.
@pytest.mark.parametrize("bad_shape", [(64, 48), (64, 32)])
def test_misshapen_row_parallel_weight_is_refused_by_name_before_reading(
    tmp_path, elements_read, bad_shape
):
    path = build_checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = torch.zeros(bad_shape)
    save_file(tensors, path / "model.safetensors")

    message = rf"{name}: checkpoint tensor has shape \(64, {bad_shape[1]}\), expected \(64, 64\)"
    with pytest.raises(CheckpointError, match=message):
        load_rank(path, 2, 0)
    assert name not in elements_read


# --- CheckpointTensor itself ------------------------------------------------------------------


def test_narrowing_moves_the_box_and_read_reads_only_it(tmp_path, elements_read):
    full = torch.arange(48.0).reshape(6, 8)
    with on_disk(tmp_path, full) as lazy:
        box = lazy.narrow(0, 2, 3).narrow(1, 4, 4).narrow(0, 1, 2)
        assert box.shape == torch.Size([2, 4]) and box.dim() == 2
        assert not elements_read  # narrowing reads nothing
        assert torch.equal(box.read(), full[3:5, 4:8])
    assert elements_read == {"tensor": 8}


def test_narrowing_past_the_end_is_refused(tmp_path):
    with on_disk(tmp_path, torch.zeros(4, 2)) as lazy, pytest.raises(ValueError, match="dim 0"):
        lazy.narrow(0, 3, 2)


def test_vocab_rank_holding_only_padding_reads_nothing(tmp_path, elements_read):
    vocab, dim, size = 3, 2, 4  # one row per rank; the last rank holds only padding
    full = torch.randn(vocab, dim)
    with on_disk(tmp_path, full) as lazy:
        shards = []
        for rank in range(size):
            embedding = VocabParallelEmbedding(vocab, dim, parallel=ParallelConfig(size, rank))
            embedding.weight_loader(embedding.weight, lazy, None)
            shards.append(embedding.weight.data)
    assert torch.equal(torch.cat(shards)[:vocab], full)
    assert not shards[-1].any()
    assert elements_read == {"tensor": vocab * dim}
