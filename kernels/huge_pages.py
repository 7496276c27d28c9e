"""Memory in transparent huge pages, for what a CPU step streams (weights, their packed copies,
the KV cache).

A one-row decode step reads every weight once; with 4 KiB pages it walks ~130,000 page
translations a step (on a VM, two-level ones). Where Linux's ``transparent_hugepage`` is
``madvise`` (as on this project's machines) a process gets huge pages only where it asks
(`madvise(MADV_HUGEPAGE)`), and neither glibc's malloc nor torch's allocator asks.
`huge_page_bytes` maps memory that asks; `HugePageChunks` hands out tensors made one at a
time (packed copies of weights) from such mappings, so that small ones share huge pages.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

#: A transparent huge page: 2 MiB on x86-64 (and on arm64 with 4 KiB pages).
HUGE_PAGE_BYTES = 2 << 20
#: Where each tensor of an arena starts: a cache line, as torch's allocator aligns.
TENSOR_ALIGNMENT = 64


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of memory (uint8) in a mapping of their own that starts on a huge page and
    asks for transparent huge pages; each page is faulted in, zeroed, where it is first
    touched. The tensor keeps the mapping alive; it is unmapped when the last view of it goes.
    Where the kernel takes no such advice (THP off, not Linux) the pages are plain ones."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    # A huge page more than the whole pages nbytes needs: room to start on one.
    region = mmap.mmap(-1, round_up(nbytes, HUGE_PAGE_BYTES) + HUGE_PAGE_BYTES, flags=flags)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        logger.debug("no transparent huge pages: %d bytes in plain pages", nbytes)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start : start + nbytes]


class HugePageChunks:
    """Tensors taken one after another from `huge_page_bytes` mappings of ``chunk_bytes``
    (one of its own for a larger tensor). A chunk is unmapped when no tensor taken from it is
    alive and it is no longer the one being filled."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` (zeros where nothing was written)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.chunk_bytes:
            return huge_page_bytes(nbytes).view(dtype).view(tuple(shape))
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = huge_page_bytes(self.chunk_bytes), 0
        start = self._used
        self._used = round_up(start + nbytes, TENSOR_ALIGNMENT)
        return self._chunk[start : start + nbytes].view(dtype).view(tuple(shape))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
