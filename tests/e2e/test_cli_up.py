"""`headrace up` on a bad start: the worker's own error and its exit code, no traceback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx


def test_a_worker_that_fails_under_up_gives_its_error_and_exit_code(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    done = subprocess.run(
        [sys.executable, "-m", "headrace.sdk.cli", "up", "--model", str(missing),
         "--host", "127.0.0.1", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "headrace: error: model not found" in done.stderr  # the worker's own message
    assert "headrace up: server exited with code 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_up_still_takes_the_old_workers_flag_with_a_deprecation_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "headrace.sdk.cli", "up", "--workers", "1", "--model",
         str(tmp_path / "missing"), "--host", "127.0.0.1", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "--workers N is deprecated; use --num-workers N" in done.stderr
    assert done.returncode == 1  # and it went on to start a worker (which failed: no model)


def test_up_serves_the_openai_api_on_http_port(tiny_model: Path) -> None:
    """`headrace up --http-port` passes the flag to its router and says where the API is;
    `--worker-args` reach the worker split as a shell splits them (a quoted value whole)."""
    up = subprocess.Popen(
        [sys.executable, "-m", "headrace.sdk.cli", "up", "--model", str(tiny_model),
         "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
         "--worker-args", "--served-model-name 'tiny model'"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        banner = next(line for line in up.stdout if line.startswith("headrace up: router on"))
        match = re.search(r"OpenAI API on (http://127\.0\.0\.1:\d+/v1)", banner)
        assert match, banner
        models = httpx.get(f"{match.group(1)}/models", timeout=30).json()
        assert models["data"][0]["id"] == "tiny model"
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0
