"""PhaseTracker: wall time, step counts and memory per phase (load, prefill, decode) of a run.

On CUDA each phase synchronizes and resets the allocator's peak on entry, so `max_memory_allocated`
is read per phase; on CPU the process RSS is read at each phase's end. Owns: phase bookkeeping.
Ignores: what a phase computes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch

from lab.profiling.ranges import profile_range


class PhaseTracker:
    def __init__(self, device: torch.device, track_memory: bool = True) -> None:
        self.device = device
        self.track_memory = track_memory
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.peak_memory_mb: dict[str, float] = defaultdict(float)
        self._process = psutil.Process()

    @contextmanager
    def phase(self, name: str, num_tokens: int = 0) -> Iterator[None]:
        is_cuda = self.device.type == "cuda"
        if is_cuda and self.track_memory:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            with profile_range(name):
                yield
        finally:
            if is_cuda:
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start
            self.steps[name] += 1
            self.tokens[name] += num_tokens
            if self.track_memory:
                used = (torch.cuda.max_memory_allocated(self.device) if is_cuda
                        else self._process.memory_info().rss) / 2**20
                self.peak_memory_mb[name] = max(self.peak_memory_mb[name], used)

    def summary(self) -> dict[str, float]:
        total = sum(v for k, v in self.seconds.items() if k != "load") or 1e-12
        out: dict[str, float] = {}
        for name in sorted(self.seconds):
            out[f"phase/{name}_s"] = self.seconds[name]
            out[f"phase/{name}_steps"] = self.steps[name]
            out[f"phase/{name}_tokens"] = self.tokens[name]
            if name != "load":
                out[f"phase/{name}_share"] = self.seconds[name] / total
            if self.track_memory:
                out[f"memory/{name}_peak_mb"] = self.peak_memory_mb[name]
        return out
