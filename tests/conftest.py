"""Fixtures shared across test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable must be set before
# the first kernel module is imported (triton.jit reads it when it decorates).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from headrace.worker.models.store import CACHE_ENV, DEFAULT_MODEL, model_dir, prepare_model


@pytest.fixture(scope="session")
def prepared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding the really prepared default model (converted once per session)."""
    root = tmp_path_factory.mktemp("headrace-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root))
        prepare_model(progress=False)
    return root


@pytest.fixture(scope="session")
def smollm2_dir(prepared_cache: Path) -> Path:
    """The prepared SmolLM2-135M-Instruct Hugging Face folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(prepared_cache))
        return model_dir(DEFAULT_MODEL)
