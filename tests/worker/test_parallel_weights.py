"""Weight updates on tensor- and pipeline-parallel engines (real rank processes over gloo).

An engine split over ranks, serving checkpoint A, is updated from disk (each rank reads its
slice), from tensors in rank 0's memory (broadcast to the other ranks) and from a gloo group
that a separate trainer process broadcasts into; after each it produces exactly the tokens
of a single-rank `LLM` over the same weights. A rejected update changes nothing on any rank.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.worker import LLM
from headrace.worker.distributed.weight_sync import WeightGroupSpec
from safetensors.torch import load_file

from tests.factories import cached_checkpoint

PROMPTS: list[str | list[int]] = ["the quick brown fox", [5, 17, 42, 99, 7, 64, 23, 11] * 3]
GREEDY = GenerationConfig(max_tokens=10, temperature=0.0, ignore_eos=True)

#: A trainer: joins the weights group as rank 0, then broadcasts a checkpoint's tensors.
TRAINER = textwrap.dedent(
    """
    import sys
    from safetensors.torch import load_file
    from headrace.worker.distributed.weight_sync import WeightGroup

    path, port, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with WeightGroup.join("127.0.0.1", port, world_size, 0, "gloo", 60.0) as group:
        for name, tensor in load_file(path).items():
            group.broadcast(tensor.contiguous(), src=0)
    print("broadcast done", flush=True)
    """
)


@pytest.fixture(scope="module")
def checkpoints() -> tuple[Path, Path]:
    """Three layers (so two stages split them unevenly), 4 heads, 2 KV heads."""
    return (
        cached_checkpoint("llama", num_layers=3, seed=0),
        cached_checkpoint("llama", num_layers=3, seed=1),
    )


@pytest.fixture(scope="module")
def expected(checkpoints: tuple[Path, Path]) -> dict[str, list[list[int]]]:
    tokens = {}
    for name, path in zip("AB", checkpoints, strict=True):
        with LLM(str(path), dtype="float32") as llm:
            tokens[name] = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert tokens["A"] != tokens["B"]
    return tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def update_from_trainer(llm: LLM, checkpoint: Path, version: str) -> None:
    """Start a trainer process, join its group, and receive the checkpoint it broadcasts."""
    port = free_port()
    world_size = 1 + llm.engine.config.world_size
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(checkpoint / "model.safetensors"), str(port),
         str(world_size)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        llm.init_weights_group("127.0.0.1", port, world_size, rank_offset=1, timeout_s=60)
        metas = [(n, t.dtype, t.shape) for n, t in tensors_of(checkpoint).items()]
        llm.update_weights_from_group(metas, version)
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and "broadcast done" in out
    finally:
        trainer.kill()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_a_parallel_engine_takes_updates_from_disk_tensors_and_a_trainer_group(
    checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]], tp: int, pp: int
) -> None:
    a, b = checkpoints
    options = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    with LLM(str(a), dtype="float32", **options) as llm:  # type: ignore[arg-type]
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected["A"]
        llm.update_weights(str(b), version="b-disk")
        results = llm.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in results] == expected["B"]
        assert {r.weight_version for r in results} == {"b-disk"}
        llm.update_weights_from_tensors(tensors_of(a).items(), version="a-tensors")
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected["A"]
        update_from_trainer(llm, b, "b-group")
        results = llm.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in results] == expected["B"]
        assert llm.weight_version() == "b-group"
        bad = tensors_of(a)
        bad["model.layers.2.self_attn.o_proj.weight"] = torch.zeros(64, 32)  # the last stage's
        with pytest.raises(InvalidArgumentError, match=r"layers\.2\.self_attn\.o_proj\.weight"):
            llm.update_weights_from_tensors(bad.items(), version="bad")
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected["B"]
        assert llm.weight_version() == "b-group"


def test_a_weights_group_spec_is_checked_before_anyone_joins() -> None:
    with pytest.raises(InvalidArgumentError, match="rank_offset: must be in"):
        WeightGroupSpec("127.0.0.1", 29500, world_size=2, rank_offset=2)
    with pytest.raises(InvalidArgumentError, match="backend: must be one of gloo, nccl"):
        WeightGroupSpec("127.0.0.1", 29500, world_size=3, rank_offset=1, backend="mpi")
