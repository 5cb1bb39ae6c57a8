"""Micro-benchmark: one layer's paged attention for a verify step of N rows of one sequence, the rows attended one
at a time against two at a time in AVX-512 registers (`native_gemv` `attention_pairs`; bit-identical outputs), on
SmolLM2's shape (3 KV heads x 3 query heads x 64) over `--context` keys in blocks of 16. The two settings take turns
call by call, in alternating order, so a machine whose speed drifts slows both alike.

    python experiments/bench_attention_pairs.py --rows 2,4,7,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.models import native_gemv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,7,8,16", help="comma-separated rows in the step")
    parser.add_argument("--context", type=int, default=200, help="keys before the step's rows")
    parser.add_argument("--calls", type=int, default=400, help="timed calls per setting and row count")
    args = parser.parse_args()
    kernel = native_gemv.load_kernel()
    if kernel is None or not kernel.attention_pairs(1):
        raise SystemExit("needs the native kernel on a CPU with AVX-512F/VL (and LAB_BLOCKS_AVX512 not 0)")
    torch.set_num_threads(1)
    kv_heads, group, head_dim, block_size, num_blocks = 3, 3, 64, 16, 64
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    v = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    rows = [int(n) for n in args.rows.split(",")]
    blocks = (args.context + max(rows)) // block_size + 1
    print(f"# bench_attention_pairs: 1 thread, context {args.context}, {args.calls} calls each, median per layer")
    print("| rows | one at a time (us) | in pairs (us) | speedup |")
    print("|---:|---:|---:|---:|")
    try:
        for n in rows:
            q = torch.randn(n, kv_heads, group, head_dim, generator=generator)
            out = torch.empty_like(q)
            tables = torch.arange(1, 1 + blocks).repeat(n, 1).contiguous()
            lens = torch.arange(args.context + 1, args.context + 1 + n)
            hidden = torch.empty(0, dtype=torch.long)
            times: dict[int, list[float]] = {0: [], 1: []}
            for call in range(args.calls):
                for pairs in ((0, 1) if call % 2 else (1, 0)):
                    kernel.attention_pairs(pairs)
                    start = time.perf_counter()
                    kernel.paged_decode(q, k, v, tables, lens, hidden, head_dim ** -0.5, out)
                    times[pairs].append(time.perf_counter() - start)
            alone, paired = statistics.median(times[0]), statistics.median(times[1])
            print(f"| {n} | {alone * 1e6:.1f} | {paired * 1e6:.1f} | {alone / paired:.2f}x |")
    finally:
        kernel.attention_pairs(1)


if __name__ == "__main__":
    main()
