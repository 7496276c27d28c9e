"""Start headrace servers as child processes and find their ports.

A server started with ``--port 0`` binds a free port and prints one line ending in
``serving <model> on <host>:<port>``; `ServerProcess` reads it. Used by ``headrace up``,
the benchmarks and the end-to-end tests.

A child never outlives the process that started it: it learns its parent's pid from
`PARENT_ENV` and (`die_with_parent`, at the start of the ``headrace`` command) asks the kernel
to SIGTERM it when that parent dies, however it died (SIGKILL included); it then drains and
exits. Arming it in the child itself, not between fork and exec, keeps the fork free of
Python code (gRPC's threads make that unsafe).
"""

from __future__ import annotations

import ctypes
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

_LISTENING = re.compile(r"serving .* on (\S+):(\d+)$")
_METRICS = re.compile(r"^metrics on http://\S+:(\d+)/metrics$")
_HEALTH = re.compile(r"^health on \S+:(\d+)$")
_HTTP = re.compile(r"^http on \S+:(\d+)$")
START_TIMEOUT_S = 180.0


class ServerStartError(RuntimeError):
    """The server exited (or never said where it listens) before it served."""

    def __init__(self, exit_code: int | None, log: str) -> None:
        ended = "did not start in time" if exit_code is None else f"exited with code {exit_code}"
        super().__init__(f"server {ended}" + (f"; its log ends with:\n{log}" if log else ""))
        #: None when it was still running (and was killed) at the deadline.
        self.exit_code = exit_code


class ServerProcess:
    """``headrace <args> --host HOST --port 0`` as a child process."""

    def __init__(
        self,
        args: list[str],
        log_path: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        """Logs go to log_path (default: this process's stderr)."""
        self.log_path = log_path
        self._log: IO[bytes] | None = log_path.open("wb") if log_path is not None else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headrace.sdk.cli", *args, "--host", host, "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())},
            # Unbuffered: lines that arrive together (health, then the banner) must not sit in
            # a read buffer where `select` cannot see them.
            bufsize=0,
        )
        #: The /metrics port, if the server was started with --metrics-port.
        self.metrics_port: int | None = None
        #: The plaintext health port, if the server was started with --health-port.
        self.health_port: int | None = None
        #: The router's OpenAI-compatible HTTP port, if it was started with --http-port.
        self.http_port: int | None = None
        self.port = self._wait_for_port()
        self.target = f"{host}:{self.port}"

    def _wait_for_port(self) -> int:
        assert self.proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if not selector.select(timeout=0.5):
                continue
            line = self.proc.stdout.readline().decode().strip()
            if metrics := _METRICS.search(line):
                self.metrics_port = int(metrics.group(1))
            if health := _HEALTH.search(line):
                self.health_port = int(health.group(1))
            if http := _HTTP.search(line):
                self.http_port = int(http.group(1))
            if match := _LISTENING.search(line):
                return int(match.group(2))
        code = self.proc.poll()
        self.kill()
        log = self.log_path.read_text()[-4000:] if self.log_path is not None else ""
        raise ServerStartError(code, log)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the server drains), then wait for its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.proc.poll() is None:
            self.terminate()
        self.kill()


def die_with_parent(parent_pid: str | None) -> None:
    """SIGTERM this process when ``parent_pid`` (the value of `PARENT_ENV`) dies; on Linux
    (PR_SET_PDEATHSIG), and a no-op without a parent pid or elsewhere."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent_pid):  # the parent died before we asked: go now
        os.kill(os.getpid(), signal.SIGTERM)


#: Set by `ServerProcess` to the starting process's pid.
PARENT_ENV = "HEADRACE_PARENT_PID"
#: prctl's option number for "signal me when my parent dies" (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def start_worker(model: Path | str, *args: str, log_path: Path | None = None) -> ServerProcess:
    """``headrace worker --model MODEL [args]`` on a free loopback port."""
    return ServerProcess(["worker", "--model", str(model), *args], log_path)


def start_router(
    workers: list[str],
    *args: str,
    log_path: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
) -> ServerProcess:
    """``headrace router --workers A,B [args]``."""
    return ServerProcess(["router", "--workers", ",".join(workers), *args], log_path, host, port)
