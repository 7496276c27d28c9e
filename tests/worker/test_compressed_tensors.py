"""compressed-tensors checkpoints (llm-compressor's W4A16 / W8A16) served as stored.

The checkpoints are written here as llm-compressor writes them: a float checkpoint's
projections quantized symmetrically (bf16 scales, per group or per channel), their integers
packed by compressed-tensors' own ``pack_to_int32``, and config.json's quantization_config.
transformers loads them through the compressed-tensors library (which unpacks and
dequantizes them itself), so its greedy tokens are the oracle: headrace, reading the packed
integers into its int4 / int8 layouts without forming floats, must give the same tokens on the
C kernels and the torch references, with chunked prefill and preemption, and at two
tensor-parallel ranks. Each layer's `dequantize` equals the library's own unpacking times the
scale, bit for bit. ``quantization="none"`` serves the same weights dequantized, and an
update from another compressed checkpoint serves that checkpoint's tokens. Schemes
headrace does not serve are refused when the engine starts, naming what the checkpoint has.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from headrace.kernels.quantized import QuantizedWeight, dequantize
from headrace.sdk import InvalidArgumentError
from headrace.worker import LLM
from headrace.worker.models.loader import iter_weights
from safetensors.torch import load_file, save_file

from tests.factories import build_checkpoint, hf_greedy
from tests.worker.test_engine_oracle import COMPOSITIONS, assert_all_blocks_free, greedy

MAX_TOKENS = 10
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 9, 17, 33, 2], [7] * 20, list(range(3, 40)), [11, 200, 3]]


@dataclass(frozen=True)
class Scheme:
    bits: int
    group_size: int | None  # None: per channel

    @property
    def name(self) -> str:
        return f"w{self.bits}a16-{self.group_size or 'channel'}"

    def weights(self) -> dict[str, Any]:
        strategy = "group" if self.group_size else "channel"
        return {"num_bits": self.bits, "type": "int", "symmetric": True,
                "strategy": strategy, "group_size": self.group_size, "dynamic": False}  # fmt: skip


SCHEMES = [Scheme(4, 32), Scheme(4, 64), Scheme(8, None)]


def compress(float_dir: Path, out: Path, scheme: Scheme, **config: Any) -> Path:
    """``float_dir``'s checkpoint with every projection stored as compressed-tensors stores
    it: q = round(w / scale) in [-2^(b-1), 2^(b-1) - 1], scale = max|w| / (2^(b-1) - 1) per
    group rounded to bf16, packed by the library. ``config`` overrides quantization_config."""
    shutil.copytree(float_dir, out)
    tensors: dict[str, torch.Tensor] = {}
    qmax = 2 ** (scheme.bits - 1) - 1
    for name, weight in load_file(out / "model.safetensors").items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in PROJECTIONS:
            tensors[name] = weight
            continue
        rows, cols = weight.shape
        groups = weight.float().view(rows, cols // (scheme.group_size or cols), -1)
        scale = (groups.abs().amax(-1) / qmax).bfloat16()
        q = torch.round(groups / scale.float()[..., None]).clamp(-qmax - 1, qmax)
        tensors[f"{module}.weight_packed"] = pack_to_int32(
            q.view(rows, cols).to(torch.int8), scheme.bits
        )
        tensors[f"{module}.weight_scale"] = scale
        tensors[f"{module}.weight_shape"] = torch.tensor([rows, cols])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((out / "config.json").read_text())
    group = {"targets": ["Linear"], "weights": scheme.weights(), "input_activations": None,
             "output_activations": None}  # fmt: skip
    hf_config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
        **config,
    }
    (out / "config.json").write_text(json.dumps(hf_config))
    return out


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("float"), family="llama")


@pytest.fixture(scope="module")
def case(float_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """scheme -> (compressed checkpoint, transformers' greedy tokens for PROMPTS)."""
    cases: dict[Scheme, tuple[Path, list[list[int]]]] = {}

    def make(scheme: Scheme) -> tuple[Path, list[list[int]]]:
        if scheme not in cases:
            path = compress(float_dir, tmp_path_factory.mktemp(scheme.name) / "ckpt", scheme)
            cases[scheme] = (path, hf_greedy(path, PROMPTS, MAX_TOKENS))
        return cases[scheme]

    return make


def tokens_of(llm: LLM) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(PROMPTS, greedy(MAX_TOKENS))]


@pytest.mark.parametrize("composition", ["chunked-8", "preempting"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_greedy_tokens_equal_transformers_over_the_same_checkpoint(
    case, scheme: Scheme, backend: str, composition: str
) -> None:
    path, expected = case(scheme)
    llm = LLM(str(path), dtype="float32", kernel_backend=backend, **COMPOSITIONS[composition])
    assert llm.engine.spec.quantization == "compressed-tensors"
    assert tokens_of(llm) == expected
    if composition == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


def test_the_oracle_is_not_the_float_model(case, float_dir: Path) -> None:
    _, expected = case(Scheme(4, 32))
    assert hf_greedy(float_dir, PROMPTS, MAX_TOKENS) != expected


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_each_layer_dequantizes_to_the_librarys_values(case, scheme: Scheme) -> None:
    path, _ = case(scheme)
    stored = load_file(path / "model.safetensors")
    layers = {name: t for name, t in iter_weights(path) if isinstance(t, QuantizedWeight)}
    assert len(layers) == 2 * len(PROJECTIONS)  # every projection of both layers
    for name, weight in layers.items():
        module = name.removesuffix(".weight")
        shape = torch.Size(stored[f"{module}.weight_shape"].tolist())
        q = unpack_from_int32(stored[f"{module}.weight_packed"], scheme.bits, shape)
        scale = stored[f"{module}.weight_scale"].float()
        group = scheme.group_size or shape[1]
        want = (q.float().view(shape[0], -1, group) * scale[..., None]).view(shape)
        assert weight.bits == scheme.bits and weight.group_size == group
        assert torch.equal(dequantize(weight), want), name


def test_int4_over_two_tensor_parallel_ranks_equals_transformers(case) -> None:
    path, expected = case(Scheme(4, 32))
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        assert tokens_of(llm) == expected
    finally:
        llm.close()


def test_an_update_from_another_compressed_checkpoint_serves_its_tokens(
    case, tmp_path: Path
) -> None:
    """The update is checked (each packed layer as the float weight it stands for) and its
    layers land in the int4 weights as stored."""
    path, _ = case(Scheme(4, 32))
    other = compress(build_checkpoint(tmp_path / "float", seed=7), tmp_path / "b", Scheme(4, 32))
    with LLM(str(path), dtype="float32") as llm:
        llm.update_weights(str(other), version="b")
        assert tokens_of(llm) == hf_greedy(other, PROMPTS, MAX_TOKENS)


def test_none_serves_the_same_weights_dequantized(case) -> None:
    path, expected = case(Scheme(8, None))
    llm = LLM(str(path), dtype="float32", quantization="none")
    assert llm.engine.spec.quantization == "none"
    layer = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert layer.quantized is None and layer.weight.dtype == torch.float32
    assert tokens_of(llm) == expected


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(weights=dict(Scheme(4, 32).weights(), symmetric=False)), "asymmetric"),
        (dict(weights=dict(Scheme(8, None).weights(), type="float")), "float weights of 8"),
        (dict(weights=dict(Scheme(4, None).weights(), strategy="tensor")), "strategy 'tensor'"),
        (dict(weights=dict(Scheme(4, 32).weights(), group_size=48)), "group_size 48"),
        (dict(input_activations={"num_bits": 8, "type": "int"}), "activation quantization"),
        (dict(format="marlin-24"), "format 'marlin-24'"),
        (dict(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "left unquantized"),
    ],
    ids=["asymmetric", "fp8", "per-tensor", "group-48", "w8a8", "format", "ignored-layer"],
)
def test_a_scheme_it_does_not_serve_is_refused_naming_it(
    float_dir: Path, tmp_path: Path, change: dict[str, Any], named: str
) -> None:
    path = compress(float_dir, tmp_path / "ckpt", Scheme(4, 32))
    hf_config = json.loads((path / "config.json").read_text())
    quant = hf_config["quantization_config"]
    group = quant["config_groups"]["group_0"]
    for key, value in change.items():
        (group if key in ("weights", "input_activations") else quant)[key] = value
    (path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(InvalidArgumentError, match=named) as error:
        LLM(str(path), dtype="float32")
    assert error.value.field == "model"


def test_quantizing_a_quantized_checkpoint_again_is_refused(case) -> None:
    path, _ = case(Scheme(4, 32))
    with pytest.raises(InvalidArgumentError, match="quantized already") as error:
        LLM(str(path), dtype="float32", quantization="int8")
    assert error.value.field == "quantization"
