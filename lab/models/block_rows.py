"""How many rows a step may have for GGUF blocks to serve its projections, measured on this machine at load.

A projection that streams GGUF blocks (lab/models/weight_blocks.py) reads a fifth of the fp32 weights' bytes, but
widens every block to fp32 once per call, arithmetic that grows with the rows. Where blocks stop paying depends
on the machine's bandwidth against its arithmetic: session 31's machine was 0.90x at 12 rows, session 32's and
33's 1.15-1.35x at 6-12 (docs/benchmarks.md). Up to BLOCK_MAX_ROWS rows blocks always pay (1.5-2.3x measured on
every machine so far); above it, up to NATIVE_MAX_ROWS (where the native GEMV, which blocks feed bit-identically,
still serves), `measure_block_rows` times both on the model's own projections and keeps blocks where they win.

The kernel's two instruction sets are measured the same way (`measure_block_isa`): on a CPU with AVX-512 the block
GEMV can run two weight rows to a 16-wide register (half the instructions, bit-identical outputs), which was 1.5x
faster at one row and 1.9x at seven on a Zen 5 EPYC (session 59) but measured no faster on session 32's Xeon, whose
clock drops under 512-bit work. Which one serves is a per-process choice, timed on the model's own projections.

Owns: the measurements. Ignores: which call takes which weights (PackedLinear, DecoderModel).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lab.models import native_gemv

# NOTE: the row counts the instruction sets are timed at: a decode, a chain verify of 2 drafts, a graft's ~7 rows.
ISA_ROWS: tuple[int, ...] = (1, 3, 7)
# NOTE: the row counts tried above BLOCK_MAX_ROWS (5); between two of them blocks are taken to win as at the larger
# (every machine measured so far fell monotonically with the rows). 12 = NATIVE_MAX_ROWS.
CANDIDATE_ROWS: tuple[int, ...] = (6, 8, 12)


@dataclass(frozen=True, slots=True)
class BlockRowsMeasurement:
    max_rows: int                   # blocks serve steps of up to this many rows
    speedups: dict[int, float]      # rows -> fp32 seconds / blocks seconds, for the counts measured
    seconds: float                  # what the measurement took


@dataclass(frozen=True, slots=True)
class BlockIsaMeasurement:
    avx512: bool                    # whether the AVX-512 path serves from now on
    speedups: dict[int, float]      # rows -> AVX2 seconds / AVX-512 seconds
    seconds: float                  # what the measurement took


def _sweep_seconds(sample: Sequence[tuple[torch.Tensor, torch.Tensor]], pick: int, xs: dict[int, torch.Tensor]
                   ) -> float:
    began = time.perf_counter()
    for pair in sample:
        native_gemv.gemv(xs[pair[0].shape[1]], pair[pick])
    return time.perf_counter() - began


def measure_block_isa(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[int] = ISA_ROWS,
                      reps: int = 3, every: int = 3, switch_below: float = 0.95) -> BlockIsaMeasurement | None:
    """pairs as measure_block_rows' -> the block GEMV's AVX2 and AVX-512 paths timed at each of `rows` (the best of
    `reps` alternating sweeps over every `every`-th pair's blocks); AVX-512, the default, is kept unless AVX2 took
    under `switch_below` of its time over all of them together (a clear loss, not noise), and the choice is set for
    this process (paged attention's rows-in-pairs path follows the same switch: the kernel's attention_pairs; both are
    bit-identical either way). None where there is nothing to choose: the CPU lacks AVX-512F/VL, or
    LAB_BLOCKS_AVX512 fixed the choice. Needs the native kernel."""
    if native_gemv.blocks_isa_fixed() or not native_gemv.blocks_avx512(True):
        return None
    start = time.perf_counter()
    sample = list(pairs[::every])
    generator = torch.Generator().manual_seed(0)
    speedups, totals = {}, [0.0, 0.0]
    for count in rows:
        xs = {inn: torch.randn(count, inn, generator=generator) for inn in {w.shape[1] for w, _ in sample}}
        best = [float("inf"), float("inf")]
        for _ in range(reps):
            for isa in (0, 1):
                native_gemv.blocks_avx512(bool(isa))
                best[isa] = min(best[isa], _sweep_seconds(sample, 1, xs))
        speedups[count] = best[0] / best[1]
        totals = [totals[0] + best[0], totals[1] + best[1]]
    avx512 = native_gemv.blocks_avx512(not totals[0] < switch_below * totals[1])
    return BlockIsaMeasurement(avx512, speedups, time.perf_counter() - start)


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
                best[pick] = min(best[pick], _sweep_seconds(sample, pick, xs))
        speedups[rows] = best[0] / best[1]
        if speedups[rows] < 1.0:
            break
        max_rows = rows
    return BlockRowsMeasurement(max_rows, speedups, time.perf_counter() - start)
