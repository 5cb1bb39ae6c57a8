"""Micro-benchmark: what a drafter's few-row products cost when their weights come from DRAM, as they do in a
speculative step, against the same products with the weights already in the cache, and how much a core keeps.

A batch-1 verify step streams the target's ~96 MB of blocks, so the drafter's ~11 MB (DFlash: its layer, its context
projection, the draft head) arrive cold every step. `cold` times a product right after streaming a 256 MB buffer;
`hot` times it again and again on one copy. The second table sweeps a working set of N copies of the draft head,
called in turn: where the time per call jumps is what the cache holds for one core here (docs/profiling.md,
"Where a DFlash draft's time goes", session 41).

    python experiments/bench_draft_weights.py               # the drafter's products, Q8_0 against Q4_1
    python experiments/bench_draft_weights.py --sweep 1,2,4,8,12,16,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.models import native_gemv, native_tiles, weight_blocks

SMOLLM2_DRAFT = {"draft head 8192x576": (8192, 576), "mlp gate_up 3072x576": (3072, 576),
                 "mlp down 576x1536": (576, 1536), "context fc 576x2880": (576, 2880)}


def blocks_of(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """`weight` rounded to `fmt`, as the drafter streams it: AMX tiles where this CPU has them, else AVX blocks."""
    blocks = weight_blocks.quantize(weight, fmt)
    return native_tiles.pack(blocks) if native_tiles.available() else blocks


def median_us(fn, calls: int, before=None) -> float:
    """Median microseconds of fn() over `calls` calls (the first left out), each after before() if given."""
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e6


def products_table(rows: list[int], calls: int) -> None:
    generator = torch.Generator().manual_seed(0)
    flood = torch.ones(64 * 2**20)                        # 256 MB: streaming it leaves nothing of ours cached
    print("| product | format | MB | " + " | ".join(f"{m} rows hot / cold (us)" for m in rows) + " |")
    print("|---|---|---:|" + "---:|" * len(rows))
    for name, (out, inn) in SMOLLM2_DRAFT.items():
        weight = torch.randn(out, inn, generator=generator) * 0.05
        for fmt in ("q8_0", "q4_1"):
            blocks = blocks_of(weight, fmt)
            cells = []
            for m in rows:
                x = torch.randn(m, inn, generator=generator)
                hot = median_us(lambda: native_gemv.gemv(x, blocks), calls)
                cold = median_us(lambda: native_gemv.gemv(x, blocks), calls, before=lambda: flood.add_(1.0))
                cells.append(f"{hot:.0f} / {cold:.0f}")
            print(f"| {name} | {fmt} | {blocks.numel() / 2**20:.1f} | " + " | ".join(cells) + " |")


def sweep_table(copies: list[int], calls: int) -> None:
    generator = torch.Generator().manual_seed(1)
    head = blocks_of(torch.randn(*SMOLLM2_DRAFT["draft head 8192x576"], generator=generator) * 0.05, "q8_0")
    x = torch.randn(4, SMOLLM2_DRAFT["draft head 8192x576"][1], generator=generator)
    print("\n| copies of the Q8_0 draft head called in turn | working set (MB) | us a call |")
    print("|---:|---:|---:|")
    for n in copies:
        working = [head.clone() for _ in range(n)]
        per_call = median_us(lambda: [native_gemv.gemv(x, w) for w in working], calls) / n
        print(f"| {n} | {n * head.numel() / 2**20:.0f} | {per_call:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,9", help="rows a product serves (a DFlash block: 4-9)")
    parser.add_argument("--sweep", default="", help="copies of the draft head for the working-set table")
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if native_gemv.load_kernel() is None:
        raise SystemExit("needs the native kernels (lab/models/native_gemv.py)")
    print(f"# bench_draft_weights: 1 thread, {'AMX tiles' if native_tiles.available() else 'AVX blocks'}")
    products_table([int(m) for m in args.rows.split(",")], args.calls)
    if args.sweep:
        sweep_table([int(n) for n in args.sweep.split(",")], args.calls)


if __name__ == "__main__":
    main()
