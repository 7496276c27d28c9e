"""Generate the Python modules of the `.proto` files: ``python -m headrace.protos.codegen``.

The `.proto` files live under ``headrace/v1/`` (the path matches the package, as buf and
other languages' tools expect); their generated modules live flat beside this file as
``headrace.protos.<name>_pb2``. protoc writes ``from headrace.v1 import ...`` for imports
between the files, so those lines are rewritten to ``headrace.protos``. The generated code is
committed; a test regenerates it and fails on any drift. Needs grpcio-tools (dev extra).
"""

from __future__ import annotations

import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "headrace" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT = re.compile(r"^from headrace\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules into out_dir; return their paths."""
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        raw_dir = Path(raw)
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={raw_dir}",
            f"--pyi_out={raw_dir}",
            f"--grpc_python_out={raw_dir}",
            *(str(path.relative_to(PROTO_ROOT)) for path in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for path in sorted((raw_dir / "headrace" / "v1").iterdir()):
            if not path.name.endswith(GENERATED_SUFFIXES):
                continue
            target = out_dir / path.name
            target.write_text(_IMPORT.sub("from headrace.protos import ", path.read_text()))
            written.append(target)
    return written


def main() -> int:
    for path in generate(PROTO_ROOT):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
