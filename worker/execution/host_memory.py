"""Host memory of a serving process: the garbage collector kept out of the steps
(`quiet_collector`: the heap built at start-up frozen, a step's short-lived objects below the
youngest generation's threshold), and on a CPU what a step frees kept for the next step
(`keep_freed_memory`).

glibc's malloc serves a block past its mmap threshold (128 KiB at first, raised as blocks are
freed, at most 32 MiB) with fresh pages from the kernel and gives them back when it is freed,
and it trims freed memory from the top of its heaps. A CPU step allocates and frees the same
activations every time (25 MB for SmolLM2's MLP at 2048 prefill tokens), so every step faulted
its pages in again, zero-filled: measured on this project's 2-core machine, SmolLM2-135M float32,
1.29 million page faults over a 24-request run, and a 2048-token prefill step took 3.6-4.2 s
where the same step with memory kept takes 1.7-2.1 s. `keep_freed_memory` fixes the threshold
at its maximum and lets the heap keep up to 1 GiB free, so a step's blocks come back from the
heap. What is freed stays with the process (as with jemalloc or tcmalloc, which vLLM's CPU
backend recommends preloading); larger blocks (the KV cache, logits past 32 MiB) are still
mapped, and those the engine reuses itself.

A CPU runner's weights and KV cache live in transparent huge pages, not on the heap
(`headrace.kernels.huge_pages`).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging

logger = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The largest mmap threshold glibc accepts on 64-bit hosts.
MMAP_THRESHOLD = 32 << 20
#: Free memory a heap may keep at its top.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for the process as above; False where malloc is not glibc's."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    kept = bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not kept:
        logger.warning("malloc refused its thresholds: CPU steps fault fresh pages in")
    return kept


#: Container objects allocated (net of those freed) that start a collection of the youngest
#: generation; Python's default is 700. A step makes about six a sequence that live until it
#: ends (its chunks, sampled tokens, deltas and outputs), so at the default a 256-sequence
#: step of the tiny bench ran two collections, 0.2 ms of its 3 ms of host work; at this
#: threshold a 1024-sequence step runs none, and an idle server's collection walks at most
#: this many young objects (a few ms).
YOUNG_THRESHOLD = 50_000


def quiet_collector() -> None:
    """Keep the garbage collector out of the steps of a process that serves from here on (a
    worker, a benchmark):

    - everything alive now leaves the collector's view: the heap built at start-up (the model,
      its tokenizer, torch's and transformers' modules). Without it a full collection walks
      all of that: measured on the tiny bench, one took 149 ms inside a decode step (step p99
      174 ms; frozen, 0.5 ms). vLLM freezes after start-up too. Frozen objects are still freed
      by their reference counts, not as cycles; the heap is thawed at exit, so the
      interpreter's last collection finalizes it (nanobind, in triton, reports every object
      it did not see finalized);
    - the youngest generation is collected past `YOUNG_THRESHOLD` objects, not 700: a step's
      objects die by their reference counts when it ends, and a collection in the middle of
      a step walks them and promotes them for nothing. Cycles are still collected, later.

    Not for the offline `LLM`, whose heap is the user's."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    _, *older = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *older)
