"""How many rows a step may have for GGUF blocks to serve its projections, measured on this machine at load.

A projection that streams GGUF blocks (lab/models/weight_blocks.py) reads a fifth of the fp32 weights' bytes, but
widens every block to fp32 once per call, arithmetic that grows with the rows. Where blocks stop paying depends
on the machine's bandwidth against its arithmetic: session 31's machine was 0.90x at 12 rows, session 32's and
33's 1.15-1.35x at 6-12 (docs/benchmarks.md). Up to BLOCK_MAX_ROWS rows blocks always pay (1.5-2.3x measured on
every machine so far); above it, up to NATIVE_MAX_ROWS (where the native GEMV, which blocks feed bit-identically,
still serves), `measure_block_rows` times both on the model's own projections and keeps blocks where they win.

Owns: the measurement. Ignores: which call takes which weights (PackedLinear, DecoderModel).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lab.models import native_gemv

# NOTE: the row counts tried above BLOCK_MAX_ROWS (5); between two of them blocks are taken to win as at the larger
# (every machine measured so far fell monotonically with the rows). 12 = NATIVE_MAX_ROWS.
CANDIDATE_ROWS: tuple[int, ...] = (6, 8, 12)


@dataclass(frozen=True, slots=True)
class BlockRowsMeasurement:
    max_rows: int                   # blocks serve steps of up to this many rows
    speedups: dict[int, float]      # rows -> fp32 seconds / blocks seconds, for the counts measured
    seconds: float                  # what the measurement took


def measure_block_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], floor: int,
                       candidates: Sequence[int] = CANDIDATE_ROWS, reps: int = 3, every: int = 3
                       ) -> BlockRowsMeasurement:
    """pairs: (fp32 weight (out, in), its GGUF blocks) of a model's projections -> the largest candidate row count
    up to which blocks were faster than the fp32 weights at every candidate (`floor` where the first loses).

    Every `every`-th pair is timed (a model's projections in order: enough bytes to stream from memory, as a step
    does), fp32 and blocks alternating, the best of `reps` sweeps each. Needs the native kernel."""
    start = time.perf_counter()
    sample = list(pairs[::every])
    generator = torch.Generator().manual_seed(0)
    max_rows, speedups = floor, {}
    for rows in sorted(candidates):
        xs = {inn: torch.randn(rows, inn, generator=generator) for inn in {w.shape[1] for w, _ in sample}}
        best = [float("inf"), float("inf")]
        for _ in range(reps):
            for pick in (0, 1):
                began = time.perf_counter()
                for pair in sample:
                    native_gemv.gemv(xs[pair[0].shape[1]], pair[pick])
                best[pick] = min(best[pick], time.perf_counter() - began)
        speedups[rows] = best[0] / best[1]
        if speedups[rows] < 1.0:
            break
        max_rows = rows
    return BlockRowsMeasurement(max_rows, speedups, time.perf_counter() - start)
