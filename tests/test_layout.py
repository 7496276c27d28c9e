"""The tree is the architecture: these checks keep it so.

Which package may import which (ARCHITECTURE.md's table), and the worker's top kept to a few
modules. Module and function length are left to habit and review, not to a number: a cap
invited squeezing (code moved where it did not belong, docstrings cut) rather than splitting
by meaning.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "sdk", "router", "worker", "kernels")

#: Module-level imports each package (or worker sub-package) must never make. Lower parts
#: never import higher ones; the router and the SDK never load torch.
FORBIDDEN = {
    "router": ("torch", "transformers", "triton", "headrace.worker", "headrace.kernels"),
    "sdk": ("torch", "transformers", "triton", "headrace.worker", "headrace.router"),
    "protos": ("torch", "headrace."),
    "kernels": ("headrace.worker", "headrace.router", "headrace.sdk", "transformers"),
    "worker/scheduling": (
        "torch",
        "headrace.worker.engine",
        "headrace.worker.execution",
        "headrace.worker.distributed",
        "headrace.worker.sampling",
        "headrace.worker.serving",
        "headrace.worker.models",
        "headrace.worker.lora",
    ),
    "worker/models": (
        "headrace.worker.engine",
        "headrace.worker.execution",
        "headrace.worker.scheduling",
        "headrace.worker.sampling",
        "headrace.worker.serving",
    ),
    "worker/layers": (
        "headrace.worker.engine",
        "headrace.worker.execution",
        "headrace.worker.scheduling",
        "headrace.worker.sampling",
        "headrace.worker.serving",
        "headrace.worker.models",
        "headrace.worker.lora",
    ),
    # LoRA sits beside the layers: it attaches to them; the runner and the engine drive it.
    "worker/lora": (
        "headrace.worker.engine",
        "headrace.worker.execution",
        "headrace.worker.scheduling",
        "headrace.worker.sampling",
        "headrace.worker.serving",
        "headrace.worker.models",
        "headrace.worker.distributed",
    ),
    "worker/sampling": (
        "headrace.worker.engine",
        "headrace.worker.execution",
        "headrace.worker.scheduling",
        "headrace.worker.distributed",
        "headrace.worker.serving",
    ),
    "worker/execution": ("headrace.worker.engine", "headrace.worker.serving"),
    "worker/distributed": ("headrace.worker.engine", "headrace.worker.serving"),
    "worker/engine": ("headrace.worker.serving", "headrace.worker.bench"),
}


def python_files(folder: str) -> Iterator[Path]:
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "_pb2" not in path.name:
            yield path


def module_imports(path: Path) -> set[str]:
    """Modules imported at module level (including under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    nodes: list[ast.stmt] = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):
            nodes.extend(node.body)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_package_imports_what_it_sits_below(folder: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in python_files(folder)
        for name in sorted(module_imports(path))
        for banned in FORBIDDEN[folder]
        if name == banned.rstrip(".") or name.startswith(banned.rstrip(".") + ".")
    ]
    assert not offences, "\n".join(offences)


def test_the_worker_top_holds_only_a_few_modules() -> None:
    top = sorted(path.name for path in (ROOT / "worker").glob("*.py"))
    assert len(top) <= 4, top
