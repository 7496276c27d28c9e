"""Builds and loads the C kernels of ``kernels/csrc`` for the CPU backend.

The sources are compiled together into one library: ``cpu_kernels.c`` (the ops),
``decode_stack.c`` (a decode step's layers in one call, from the same ops),
``moe_experts.c`` (a mixture block's experts in one call, likewise) and ``amx_linear.c``
(bf16 matmuls on AMX tiles, where the CPU has them), which share ``cpu_kernels.h``.

The library is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) for
the CPU it runs on (``-march=native``, OpenMP), into a cache keyed by the source, the compiler,
the flags and the CPU's model and feature flags, so a second process loads it in
milliseconds and a different machine never loads a build made for another. Processes that
build at once (the ranks of a parallel worker) each write a private file and rename it into
place. It is linked against libgomp, which resolves to the copy torch has loaded: one OpenMP
pool for torch and these kernels.

No compiler, or a failed build, is not fatal: `load()` returns None with the reason in
`build_error()`, and the engine keeps the torch reference kernels.

Environment: ``HEADRACE_CACHE`` moves the cache (default ``~/.cache/headrace``);
``HEADRACE_CC`` names the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / name
    for name in (
        "cpu_kernels.c",
        "decode_stack.c",
        "moe_experts.c",
        "amx_linear.c",
        "panel_linear.c",
    )
)
#: Hashed with the sources: a change to the shared header rebuilds the library.
HEADERS = (CSRC / "cpu_kernels.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno") + (
    # gcc keeps to 256-bit vectors on x86 unless told; the kernels' tiles are 512 bits.
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()
)

#: gcc only: never split an accumulation's multiply-add into a multiply and an add. Tuned for
#: AMD's Zen (-march=native there means -mtune=znver*), gcc leaves a loop's chain of vector
#: FMAs as separate multiplies and adds where it judges the chain's latency the bottleneck,
#: loop by loop: on the AVX2 Zen 3 one of the int8 row streams' loops was split and its
#: sums came out an ulp or two from the float kernel's over the same weights, which fused.
#: Every sum in the kernels is written as fused; this keeps it fused wherever gcc compiles it.
GCC_FLAGS = ("--param=avoid-fma-max-bits=0",)

_error: str | None = None

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
#: A decoder stack's final norm, its eps and shape, dtypes and matrix layout, as both C stacks
#: (decode_stack.c) take them.
_STACK_SHAPE = [_P, ctypes.c_float, _I64, _I64] + [_INT] * 6 + [_I64, _INT]
#: A step's block tables, their stride, query starts, sequence lengths and ids, how many, the
#: block size, softmax scale and query tile, as both take them.
_STACK_ATTENTION = [_P, _I64, _P, _P, _P, _INT, _INT, ctypes.c_float, _INT]
#: Argument types of each exported function, checked by ctypes on every call.
_SIGNATURES = {
    "headrace_paged_attention": (
        [_P, _I64, _I64, _P, _P, _I64, _P, _P, _P]
        + [_INT] * 5
        + [ctypes.c_float, _INT, ctypes.c_float, _P]
        + [_INT] * 3
        + [_P],
        _INT,
    ),
    "headrace_soft_cap": ([_P, _I64, ctypes.c_float, _P], None),
    "headrace_write_kv_cache": ([_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64] + [_INT] * 5, None),
    "headrace_argmax_update": ([_P, _I64, _I64, _I64, _I64, _P, _P], None),
    "headrace_draw_tokens": ([_P, _I64, _I64, _I64, _P, _P, _P, _P, _P], None),
    "headrace_apply_token_bitmask": ([_P, _I64, _I64, _P, _I64, _P, _I64], None),
    "headrace_skinny_linear": (
        [_P, _I64, _INT, _I64, _P, _P, _INT, _I64, _I64, _P, _P, _I64, _INT],
        _INT,
    ),
    "headrace_panel_elements": ([_I64, _I64], _I64),
    "headrace_pack_panels": ([_P, _I64, _I64, _P], None),
    "headrace_skinny_bf16_pairs": ([], _INT),
    "headrace_skinny_part_lanes": ([], _INT),
    "headrace_amx_init": ([], _INT),
    "headrace_quantized_linear": (
        [_P, _I64, _INT, _I64, _P, _INT, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _INT],
        _INT,
    ),
    "headrace_quantized_linear_a8": (
        [_P, _I64, _INT, _I64, _P, _INT, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _INT],
        _INT,
    ),
    "headrace_dequantize": ([_P, _INT, _I64, _I64, _I64, _P, _P, _P, _INT], None),
    "headrace_rms_norm": ([_P, _I64, _P, _I64, _P, ctypes.c_float, _P, _P, _I64, _I64, _INT], None),
    "headrace_silu_and_mul": ([_P, _I64, _P, _I64, _I64, _INT], None),
    "headrace_apply_rotary": (
        [_P, _I64, _I64, _I64, _P, _I64, _I64, _I64] + [_P] * 4 + [_I64, _I64, _INT],
        None,
    ),
    "headrace_decode_layers": (
        [_P, _P, _INT, _INT, _I64, _INT, _P, _P] + _STACK_SHAPE + [_P] * 3 + _STACK_ATTENTION,
        _INT,
    ),
    "headrace_decode_greedy_runs": (
        [_INT, _I64, _P, _P, _P, _P, _I64]
        + [_P] * 4
        + [_INT, _P, _P]
        + _STACK_SHAPE
        + _STACK_ATTENTION,
        _INT,
    ),
    "headrace_moe_experts": ([_P, _P, _INT, _P, _P, _I64, _I64, _INT, _INT, _I64, _INT], _INT),
}


def cache_root() -> Path:
    root = os.environ.get("HEADRACE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "headrace"


def compiler() -> str | None:
    name = os.environ.get("HEADRACE_CC") or os.environ.get("CC") or "cc"
    return shutil.which(name)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None if it cannot be built."""
    global _error
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _error = str(exc)
        logger.warning("CPU kernels unavailable, using the torch reference kernels: %s", exc)
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    # The kernel's leave to use AMX tiles, where the CPU has them (cpu_kernels.h).
    library.headrace_amx_init()
    return library


def build_error() -> str | None:
    """Why `load()` returned None (after it did)."""
    return _error


def _build() -> Path:
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set HEADRACE_CC or CC, or install gcc)")
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    version = _compiler_version(cc)
    flags = FLAGS + (GCC_FLAGS if b"Free Software Foundation" in version else ())
    for part in (version, " ".join(flags).encode(), _cpu_identity()):
        key.update(part)
    target = cache_root() / "kernels" / key.hexdigest()[:20] / "libheadrace_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", str(partial), *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            names = ", ".join(path.name for path in SOURCES)
            raise RuntimeError(f"{cc} failed to build {names}:\n{done.stderr.strip()}")
        partial.replace(target)  # atomic: a concurrent builder's file is equal
    finally:
        partial.unlink(missing_ok=True)
    logger.info("built the CPU kernels into %s", target)
    return target


def _compiler_version(cc: str) -> bytes:
    done = subprocess.run([cc, "--version"], capture_output=True, timeout=60)
    return done.stdout


def _cpu_identity() -> bytes:
    """What -march=native depends on: the CPU's model name and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine.encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted)).encode()
