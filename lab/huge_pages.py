"""Streamed weights on 2 MiB pages (Linux transparent huge pages).

Owns: one anonymous mapping per model, advised MADV_HUGEPAGE, that the tensors a decode step streams (the GGUF
blocks of lab/models/weight_blocks.py, a drafter's fp16 copies) are copied into, in the order the forward reads
them; and reading back how much memory the kernel really backs with huge pages. Ignores: what the tensors hold.

NOTE: why. Batch-1 decode streams SmolLM2's ~96 MB of blocks once a step. On 4 KiB pages that is ~24k pages, each a
TLB miss, and in a virtual machine a miss walks two page tables (the guest's and the host's). PyTorch's CPU allocator
takes 64-byte-aligned blocks from malloc, so the weights lie on 4 KiB pages unless THP_MEM_ALLOC_ENABLE=1 (only for
tensors >= 2 MiB; most of a layer's blocks are smaller). On 2 MiB pages the same bytes are ~48 pages: `ar` ran
~9 % faster on this machine, with the same output (docs/benchmarks.md, "2 MiB pages"). The KV caches stay on the
allocator's pages: on 2 MiB pages the paged engine ran ~10 % slower (its pool is written while requests run).
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from lab.errors import LabError

HugePages = Literal["auto", "on", "off"]
HUGE_PAGES: tuple[HugePages, ...] = ("auto", "on", "off")
HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 4096       # NOTE: every tensor starts on its own 4 KiB line, so no two share a cache line or a page edge
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this OS backs an madvise'd anonymous mapping with huge pages: Linux with THP `always` or
    `madvise` (not `never`)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def resolve(huge_pages: HugePages) -> bool:
    """Whether to place streamed weights on huge pages: `auto` where available(), `on` or an error, `off` never."""
    if huge_pages not in HUGE_PAGES:
        raise LabError(f"model.huge_pages={huge_pages!r} is not one of {', '.join(HUGE_PAGES)}",
                       "use model.huge_pages=auto (2 MiB pages where Linux offers them), on or off")
    if huge_pages == "on" and not available():
        raise LabError("model.huge_pages=on, but this OS offers no transparent huge pages (not Linux, or "
                       f"{_THP_SETTING} says [never])",
                       "use model.huge_pages=auto (ordinary pages here) or off, or enable THP: "
                       f"echo madvise > {_THP_SETTING}")
    return huge_pages != "off" and available()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def allocate(num_bytes: int) -> torch.Tensor:
    """A (num_bytes,) uint8 tensor that starts on a 2 MiB boundary of a private anonymous mapping advised
    MADV_HUGEPAGE; the tensor keeps the mapping alive."""
    # NOTE: private, not Python's default shared mapping: shared anonymous memory is shmem, whose huge pages follow
    # another setting (shmem_enabled, `never` by default). One spare huge page lets the start be aligned.
    size = _round_up(num_bytes, HUGE_PAGE_BYTES) + HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)     # NOTE: before the first touch, so the faults take 2 MiB pages
    raw = torch.frombuffer(mapping, dtype=torch.uint8)     # (size,)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start:start + num_bytes]


def move(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) laid out back to back in one allocate()d mapping, in the given order;
    the same shapes, dtypes and values."""
    if not all(t.is_cpu and t.is_contiguous() for t in tensors):
        raise ValueError("huge_pages.move takes contiguous CPU tensors")
    sizes = [t.numel() * t.element_size() for t in tensors]
    arena = allocate(sum(_round_up(size, _ALIGN) for size in sizes))
    moved, offset = [], 0
    for tensor, size in zip(tensors, sizes):
        piece = arena[offset:offset + size].view(tensor.dtype).view(tensor.shape)
        piece.copy_(tensor)
        moved.append(piece)
        offset += _round_up(size, _ALIGN)
    return moved


def process_huge_page_bytes() -> int:
    """How many bytes of this process's memory the kernel backs with huge pages now (AnonHugePages in
    /proc/self/smaps_rollup): the streamed weights moved here; 0 where that cannot be read."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("AnonHugePages:")), 0)
