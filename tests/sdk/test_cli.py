"""The `headrace` command line: `models list` and `models prepare`.

A model counts as prepared when its folder holds the marker, so these tests make one by hand
instead of running the conversion (tests/worker/test_model_store.py covers that).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from headrace.sdk.cli import main
from headrace.worker.models.store import CACHE_ENV, DEFAULT_MODEL, PREPARED_MARKER, model_dir


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def mark_prepared(name: str) -> Path:
    path = model_dir(name)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / PREPARED_MARKER).write_text("{}")
    return path


def test_models_list_shows_default_name_and_state(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "list"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row == [DEFAULT_MODEL, "(default)", "no", str(model_dir(DEFAULT_MODEL))]

    mark_prepared(DEFAULT_MODEL)
    assert main(["models", "list"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[2] == "yes"


def test_models_prepare_prints_the_path(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = mark_prepared(DEFAULT_MODEL)
    assert main(["models", "prepare"]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert main(["models", "prepare", DEFAULT_MODEL]) == 0
    assert capsys.readouterr().out.strip() == str(path)


def test_models_prepare_unknown_name_fails_with_message(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "prepare", "gpt-5"]) == 1
    err = capsys.readouterr().err
    assert "unknown model name 'gpt-5'" in err
    assert DEFAULT_MODEL in err


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main([])
    assert raised.value.code == 2
    assert "usage: headrace" in capsys.readouterr().err


def test_cli_and_models_list_do_not_import_torch(cache: Path) -> None:
    code = (
        "import sys; from headrace.sdk.cli import main; main(['models', 'list']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert DEFAULT_MODEL in result.stdout
