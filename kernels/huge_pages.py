"""Memory in transparent huge pages, for what a CPU step streams (weights, their packed copies,
the KV cache).

A one-row decode step reads every weight once; with 4 KiB pages it walks ~130,000 page
translations a step (on a VM, two-level ones). Where Linux's ``transparent_hugepage`` is
``madvise`` (as on this project's machines) a process gets huge pages only where it asks
(`madvise(MADV_HUGEPAGE)`), and neither glibc's malloc nor torch's allocator asks. Measured
on the 2-core Zen 4 VM, alternating processes: the C matmul read SmolLM2's LM head (113 MB)
at 27.4-27.9 GB/s from the heap and 30.7-31.3 from huge pages.

`huge_page_bytes` maps memory that asks; a `HugePageArena` lays tensors sized up front end
to end in one such mapping (a CPU runner's weights and KV cache), and `HugePageChunks` hands
out tensors made one at a time (packed copies of weights) from arenas of a fixed size, so
that small ones share huge pages.
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


class HugePageArena:
    """Tensors laid end to end in one `huge_page_bytes` mapping, sized for them up front."""

    def __init__(self, nbytes: int) -> None:
        self.memory = huge_page_bytes(nbytes)
        self.used = 0

    @staticmethod
    def footprint(shape: Sequence[int], dtype: torch.dtype) -> int:
        """The bytes a tensor of ``shape`` and ``dtype`` takes in an arena."""
        return round_up(math.prod(shape) * dtype.itemsize, TENSOR_ALIGNMENT)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit after what the arena holds."""
        return self.used + nbytes <= self.memory.numel()

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The next contiguous tensor of the arena (zeros, where nothing was written)."""
        start, nbytes = self.used, math.prod(shape) * dtype.itemsize
        if not self.fits(nbytes):
            raise ValueError(f"{nbytes} bytes past the arena's end ({self.memory.numel()})")
        self.used += self.footprint(shape, dtype)
        return self.memory[start : start + nbytes].view(dtype).view(tuple(shape))

    def copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in the arena (contiguous)."""
        return self.take(tensor.shape, tensor.dtype).copy_(tensor)


class HugePageChunks:
    """Tensors taken one after another from arenas of ``chunk_bytes`` (an arena of its own
    for a larger tensor). An arena is unmapped when no tensor taken from it is alive and it
    is no longer the one being filled."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._arena: HugePageArena | None = None

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` (zeros where nothing was written)."""
        nbytes = HugePageArena.footprint(shape, dtype)
        if nbytes > self.chunk_bytes:
            return HugePageArena(nbytes).take(shape, dtype)
        if self._arena is None or not self._arena.fits(nbytes):
            self._arena = HugePageArena(self.chunk_bytes)
        return self._arena.take(shape, dtype)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
