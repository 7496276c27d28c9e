"""The docs hold: every Python example in README.md and docs/*.md runs as written, the README
stays a front door, links lead somewhere, and ARCHITECTURE.md's request path names real code.

The examples run against servers started the way `make run` starts them: the test takes the
`headrace up` command line from ``make -n run`` (so it follows the Makefile: the router bound
to 127.0.0.1, the OpenAI API beside it), with free ports in place of 50051 and 8000, and the
default model (SmolLM2-135M-Instruct, prepared once per session). Each example runs in a fresh
interpreter, and the only change made to it is the port numbers of the targets the docs print
(``localhost:50051``, ``localhost:8000``), so the host name resolves as it does for a user. An
example that breaks fails here, not in a new user's first hour; an example that cannot run
here must not be a ``python`` block.
"""

from __future__ import annotations

import ast
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from headrace.worker.models.store import CACHE_ENV

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: Where the docs say the servers of `make run` listen.
GRPC_TARGET = "localhost:50051"
HTTP_TARGET = "localhost:8000"
README_MAX_LINES = 150
#: `headrace up`'s line once its router serves (router/cli.py).
UP_BANNER = re.compile(r"^headrace up: router on \S+:(\d+), OpenAI API on http://\S+:(\d+)/v1")
UP_START_TIMEOUT_S = 300.0
EXAMPLE_TIMEOUT_S = 300.0
#: A markdown link's target: [text](target).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: A hop of ARCHITECTURE.md's request path: `path/to/file.py:Qualified.name`.
HOP = re.compile(r"`([\w/]+\.py):([\w.]+)`")


@dataclass(frozen=True, slots=True)
class Example:
    page: str  # relative to the repository root
    index: int  # among the page's python blocks
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}#{self.index}"


def examples() -> list[Example]:
    return [
        Example(str(page.relative_to(ROOT)), index, code)
        for page in PAGES
        for index, code in enumerate(SNIPPET.findall(page.read_text()))
    ]


# --- the servers of `make run` -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MakeRun:
    grpc_port: int
    http_port: int

    def rewrite(self, text: str) -> str:
        """The docs' targets with this run's ports; the host stays ``localhost``."""
        text = text.replace(GRPC_TARGET, f"localhost:{self.grpc_port}")
        return text.replace(HTTP_TARGET, f"localhost:{self.http_port}")


def make_run_commands() -> list[list[str]]:
    """The commands `make run PORT=0 HTTP_PORT=0` runs after installing, as argv lists with
    ``headrace`` run by this interpreter (the venv is this test's, not `.venv`)."""
    printed = subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.installed", "run", "PORT=0", "HTTP_PORT=0"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    commands = []
    for line in printed.replace("\\\n", " ").splitlines():
        argv = shlex.split(line)
        if argv and argv[0].endswith("/headrace"):
            commands.append([sys.executable, "-m", "headrace.sdk.cli", *argv[1:]])
    return commands


def read_banner(up: subprocess.Popen[bytes], log: Path) -> re.Match[str]:
    """`headrace up`'s banner, once its router serves."""
    assert up.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(up.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + UP_START_TIMEOUT_S
    while time.monotonic() < deadline and up.poll() is None:
        if selector.select(timeout=0.5):
            line = up.stdout.readline().decode()
            if match := UP_BANNER.match(line):
                return match
    raise AssertionError(
        f"headrace up did not serve (exit code {up.poll()}); its log ends with:\n"
        + log.read_text()[-4000:]
    )


@pytest.fixture(scope="module")
def make_run(prepared_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MakeRun]:
    *prepare, up_command = make_run_commands()
    assert up_command[3] == "up" and "--host" in up_command, up_command
    env = {**os.environ, CACHE_ENV: str(prepared_cache)}
    for command in prepare:  # `headrace models prepare`: already done, so quick
        subprocess.run(command, env=env, check=True, timeout=600)
    log = tmp_path_factory.mktemp("make-run") / "up.log"
    with log.open("wb") as stderr:
        up = subprocess.Popen(up_command, stdout=subprocess.PIPE, stderr=stderr, env=env, bufsize=0)
    try:
        banner = read_banner(up, log)
        yield MakeRun(int(banner.group(1)), int(banner.group(2)))
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


# --- the examples --------------------------------------------------------------------------


def test_the_docs_have_the_examples_this_test_runs() -> None:
    readme = [e.code for e in examples() if e.page == "README.md"]
    assert any("Client(" in code and GRPC_TARGET in code for code in readme)
    assert any("OpenAI(" in code and HTTP_TARGET in code for code in readme)
    codes = [e.code for e in examples()]
    assert any("LLM(" in code for code in codes) and any("AsyncEngine(" in code for code in codes)


@pytest.mark.parametrize("example", examples(), ids=lambda e: e.name)
def test_a_docs_example_runs(
    example: Example, prepared_cache: Path, request: pytest.FixtureRequest
) -> None:
    code = example.code
    if GRPC_TARGET in code or HTTP_TARGET in code:
        code = request.getfixturevalue("make_run").rewrite(code)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
        env={**os.environ, CACHE_ENV: str(prepared_cache)},
    )
    assert done.returncode == 0, f"{example.name} failed:\n{code}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{example.name} printed nothing"
    if "capital of France" in code:  # greedy facts: the examples promise a sensible answer
        assert "Paris" in done.stdout, done.stdout


def test_the_readme_generate_command_streams_an_answer(make_run: MakeRun) -> None:
    """The README's second command, against the first's servers: a real model's answer."""
    lines = README.read_text().splitlines()
    (line,) = [line for line in lines if line.startswith(".venv/bin/headrace generate ")]
    argv = shlex.split(line)
    command = [sys.executable, "-m", "headrace.sdk.cli", "generate"]
    command += ["--target", make_run.rewrite(GRPC_TARGET), *argv[2:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout, done.stdout


# --- the pages themselves ------------------------------------------------------------------


def test_the_readme_is_a_front_door() -> None:
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= README_MAX_LINES, f"README.md has {num_lines} lines; move detail to docs/"


def prose(page: Path) -> str:
    """The page without its code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces to -."""
    text = prose(page)
    titles = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_of_the_repository(page: Path) -> None:
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in heading_anchors(resolved), f"{page.name}: no heading for {target}"


def defines(path: Path, qualified_name: str) -> bool:
    """Whether the module at ``path`` defines ``qualified_name`` (a function, a class, or a
    method of one)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualified_name.split("."):
        found = [
            node
            for node in scope
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and node.name == part
        ]
        if not found:
            return False
        scope = found[0].body
    return True


def test_the_request_path_names_code_that_exists() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## A request's path", 1)[1].split("\n## ", 1)[0]
    hops = HOP.findall(section)
    assert len(hops) >= 20
    missing = [f"{file}:{name}" for file, name in hops if not defines(ROOT / file, name)]
    assert not missing, f"ARCHITECTURE.md's request path names what the code lacks: {missing}"
