"""Micro-benchmark: fp32 one-row GEMV on SmolLM2-135M's real projection shapes, native kernel vs MKL, and
the same linears on a few rows (a verify step's k + 1 tokens, a small decode batch): native vs oneDNN.

Each shape is timed over enough distinct weight copies (>= 256 MB, as the model's 30 layers are) that
every call streams its matrix from DRAM, as a decode step does; GB/s = weight bytes / time per call.
Variants: `mkl-rowmajor` F.linear on the (out, in) contiguous weight (MKL's dot-product sgemv),
`mkl-colmajor` F.linear on the column-major weight (what ModelRunner used before, MKL's axpy form),
`native` lab/models/native_gemv.py on the row-major weight (its default: one thread), `native-Nt` the same
split over the N threads of --threads.

`--rows 2,3,5,8` adds a second table: each linear on M rows, the native kernel (weights read once for
all rows) against oneDNN on its prepacked weight (what PackedLinear used for 2+ rows before), as time per
call over the native one-row time of the same shape.

`--floor` (with --rows) adds a third table: the arithmetic floor of M rows. The kernel runs on one weight that
stays in the L3 cache (gate_up's 7 MB), so no call waits on DRAM and M rows cost what their FMAs cost; that rate
against the one-row DRAM rate of the streaming table says how many one-row calls M rows can never go below on
this core, however the weight traffic is hidden under the arithmetic (docs/speculative.md, session 19).

`--tiles` times the same blocks through the AVX kernel against AMX tiles (lab/models/native_tiles.py; a CPU with
AMX-BF16), with each row count's cost in one-row calls and the tiles' error against the exact product.

`--blocks` (with --rows) times the weights as GGUF blocks (lab/models/weight_blocks.py) against the same values in
fp32: all 120 projections of SmolLM2's 30 layers (random values rounded to Q4_1, one copy each, as a decode step
streams them) and the Q8_0 head, per row count, through the AVX2 kernel and, where the CPU has AVX-512F/VL, the
AVX-512 one (two weight rows to a 16-wide register at every row count, session 59), checking every output is
bit-identical (docs/benchmarks.md).

    OMP_WAIT_POLICY=PASSIVE python experiments/bench_gemv.py --threads 1 --rows 2,3,5,8
    python experiments/bench_gemv.py --rows 1,2,3,4,5,8,12 --floor
    python experiments/bench_gemv.py --rows 1,2,3,5,8,12 --blocks
`--head` times the Q8_0 head's greedy screen (lab/models/native_head.py: a row's argmax without its logits, on
a CPU with AVX-512 VNNI) against the full head (the block GEMV's logits, then their argmax), the head cold in every
call as in a decode step (SmolLM2's 120 projections streamed between calls), checking every argmax is the same.

    python experiments/bench_gemv.py --tiles        # AVX blocks against AMX tiles, 1-64 rows
    python experiments/bench_gemv.py --head --rows 1,2,3,5,7,12
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from lab.models import native_gemv, native_head, native_tiles, weight_blocks

SHAPES = {"qkv 576->960": (960, 576), "o 576->576": (576, 576), "gate_up 576->3072": (3072, 576),
          "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}
STREAM_BYTES = 256 * 2**20


def time_variant(fn, weights, x, reps: int) -> float:
    """Median seconds per call over `reps` sweeps of all weight copies."""
    for w in weights:
        fn(x, w)
    per_sweep = []
    for _ in range(reps):
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        per_sweep.append((time.perf_counter() - start) / len(weights))
    return statistics.median(per_sweep)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rows", default="", help="comma-separated row counts for the few-rows table")
    parser.add_argument("--floor", action="store_true", help="also the arithmetic floor of each row count")
    parser.add_argument("--blocks", action="store_true", help="only the GGUF-blocks table: blocks against fp32")
    parser.add_argument("--tiles", action="store_true",
                        help="only the AMX table: GGUF blocks through AVX against AMX tiles (a CPU with AMX-BF16)")
    parser.add_argument("--head", action="store_true",
                        help="only the greedy head's table: its screen against the full head (AVX-512 VNNI)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native_gemv.load_kernel()
    kernel = native_gemv._KERNEL
    print(f"# bench_gemv: {args.threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"load average {os.getloadavg()[0]:.2f}, native available: {native_gemv.AVAILABLE}")
    if args.tiles:
        if not native_tiles.available():
            raise SystemExit("--tiles needs the native kernel and a CPU with AMX-BF16")
        tiles_table([int(m) for m in (args.rows or "1,2,3,4,8,16,32,64").split(",")], args.reps)
        return
    if args.head:
        if not native_head.supported():
            raise SystemExit("--head needs the native kernel and a CPU with AVX-512 VNNI")
        head_table([int(m) for m in (args.rows or "1,2,3,5,7,12").split(",")], args.reps)
        return
    if args.blocks:
        if kernel is None:
            raise SystemExit("--blocks needs the native kernel")
        blocks_table([int(m) for m in (args.rows or "1,2,3,5,8").split(",")], args.reps)
        return
    variants = {"mkl-rowmajor": lambda x, w: F.linear(x, w),
                "mkl-colmajor": lambda x, w: F.linear(x, w)}
    if kernel is not None:
        variants["native"] = lambda x, w: kernel.gemv(x, w, None, 1)
        if args.threads > 1:
            variants[f"native-{args.threads}t"] = lambda x, w: kernel.gemv(x, w, None, 0)
    print("| shape | MB | " + " | ".join(f"{v} GB/s" for v in variants) + " |")
    print("|---|---:|" + "---:|" * len(variants))
    dram_gbps: list[float] = []
    with torch.inference_mode():
        for name, (out, inn) in SHAPES.items():
            nbytes = out * inn * 4
            copies = max(2, -(-STREAM_BYTES // nbytes))
            row = [torch.randn(out, inn) for _ in range(copies)]
            col = [w.t().contiguous().t() for w in row]
            x = torch.randn(1, 1, inn)
            cells = []
            for vname, fn in variants.items():
                seconds = time_variant(fn, col if vname == "mkl-colmajor" else row, x, args.reps)
                cells.append(f"{nbytes / seconds / 1e9:.1f}")
                if vname == "native":
                    dram_gbps.append(nbytes / seconds / 1e9)
            print(f"| {name} | {nbytes / 1e6:.1f} | " + " | ".join(cells) + " |")
            del row, col
        if args.rows and kernel is not None:
            few_rows_table(kernel, [int(m) for m in args.rows.split(",")], args.reps)
            if args.floor:
                floor_table(kernel, [int(m) for m in args.rows.split(",")], statistics.median(dram_gbps))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def few_rows_table(kernel, row_counts: list[int], reps: int) -> None:
    """Per shape and row count M: native and oneDNN time per call / native time for one row."""
    onednn = torch.ops.mkldnn
    print("\n| shape | " + " | ".join(f"M={m} native | M={m} oneDNN" for m in row_counts) + " |")
    print("|---|" + "---:|---:|" * len(row_counts))
    for name, (out, inn) in SHAPES.items():
        copies = max(2, -(-STREAM_BYTES // (out * inn * 4)))
        weights = [torch.randn(out, inn) for _ in range(copies)]
        packed = [onednn._reorder_linear_weight(w, 64) for w in weights]
        one_row = time_variant(lambda x, w: kernel.gemv(x, w, None, 1), weights, torch.randn(1, 1, inn), reps)
        cells = []
        for m in row_counts:
            x = torch.randn(1, m, inn)
            native = time_variant(lambda x, w: kernel.gemv(x, w, None, 1), weights, x, reps)
            dnn = time_variant(lambda x, w: onednn._linear_pointwise(x, w, None, "none", [], ""), packed, x, reps)
            cells += [f"{native / one_row:.2f}", f"{dnn / one_row:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
        del weights, packed


def floor_table(kernel, row_counts: list[int], dram_gbps: float, calls: int = 300) -> None:
    """Per row count M: the kernel on one cache-resident weight (no DRAM traffic), as weight GB/s, 8-wide FMAs
    per ns, and its time in one-row DRAM calls (dram_gbps: the streaming table's median native rate)."""
    out, inn = SHAPES["gate_up 576->3072"]
    weight = torch.randn(out, inn)
    print(f"\n| rows | cache-resident weight GB/s | 8-wide FMAs per ns "
          f"| floor (one-row DRAM calls at {dram_gbps:.1f} GB/s) |")
    print("|---:|---:|---:|---:|")
    for m in row_counts:
        x = torch.randn(1, m, inn)
        seconds = time_variant(lambda x, w: kernel.gemv(x, w, None, 1), [weight] * calls, x, 5)
        gbps = out * inn * 4 / seconds / 1e9
        print(f"| {m} | {gbps:.1f} | {out * inn * m / 8 / seconds / 1e9:.2f} | {dram_gbps / gbps:.2f} |")


def sweep_ms(weights: list[tuple[torch.Tensor, ...]], pick: int, xs: dict[int, torch.Tensor], reps: int) -> float:
    """Best of `reps` sweeps, in ms: every weight's variant `pick` (0: the fp32 weight (out, in), then its other
    forms) against the input rows of its width."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for weight in weights:
            native_gemv.gemv(xs[weight[0].shape[1]], weight[pick])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


BlockPair = tuple[torch.Tensor, torch.Tensor]     # (fp32 weight, its GGUF blocks)


def block_weights(layers: int, generator: torch.Generator
                  ) -> tuple[list[tuple[int, int]], list[BlockPair], BlockPair]:
    """SmolLM2's 4 * `layers` projection shapes, (fp32 weight, its Q4_1 blocks) for each (random values rounded to
    Q4_1, one copy each, as a decode step streams them), and (head, its Q8_0 blocks)."""
    shapes = [shape for name, shape in SHAPES.items() if not name.startswith("lm_head")] * layers
    projections = []
    for out, inn in shapes:
        weight = weight_blocks.round_to_q4_1(torch.randn(out, inn, generator=generator) * 0.05)
        projections.append((weight, weight_blocks.find_blocks(weight, "q4_1")))
    head = weight_blocks.round_to_q8_0(torch.randn(*SHAPES["lm_head 576->49152"], generator=generator) * 0.05)
    return shapes, projections, (head, weight_blocks.find_blocks(head, "q8_0"))


def blocks_table(row_counts: list[int], reps: int, layers: int = 30) -> None:
    """Per row count M: ms for SmolLM2's 4 * `layers` projections and for its head, fp32 against GGUF blocks of
    the same values (Q4_1 projections, Q8_0 head), and whether every output is bit-identical."""
    generator = torch.Generator().manual_seed(0)
    shapes, projections, (head, head_blocks) = block_weights(layers, generator)
    default = native_gemv.blocks_avx512()
    isas = [False] + ([True] if native_gemv.blocks_avx512(True) else [])   # NOTE: AVX2, and AVX-512 where present
    native_gemv.blocks_avx512(default)
    print(f"\n| rows | {len(shapes)} projections fp32 ms | as Q4_1 blocks, AVX2 ms | AVX-512 ms | speedup "
          f"| head fp32 ms | as Q8_0 blocks, AVX2 ms | AVX-512 ms | speedup | bit-identical |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    for m in row_counts:
        xs = {inn: torch.randn(m, inn, generator=generator) for inn in {inn for _, inn in shapes}}
        fp32, head_fp32 = sweep_ms(projections, 0, xs, reps), sweep_ms([(head, head_blocks)], 0, xs, reps)
        blocks, head_q8, same = {}, {}, True
        for isa in isas:
            native_gemv.blocks_avx512(isa)
            same &= all(torch.equal(native_gemv.gemv(xs[w.shape[1]], w), native_gemv.gemv(xs[w.shape[1]], b))
                        for w, b in projections[:4] + [(head, head_blocks)])
            blocks[isa], head_q8[isa] = sweep_ms(projections, 1, xs, reps), sweep_ms([(head, head_blocks)], 1, xs, reps)
        native_gemv.blocks_avx512(default)
        used = isas[-1]   # NOTE: the path engines take where it measures faster at load (AVX-512); speedups are its
        print(f"| {m} | {fp32:.1f} | {blocks[False]:.1f} | {_ms(blocks.get(True))} | {fp32 / blocks[used]:.2f}x "
              f"| {head_fp32:.1f} | {head_q8[False]:.1f} | {_ms(head_q8.get(True))} | {head_fp32 / head_q8[used]:.2f}x "
              f"| {same} |")


def tiles_table(row_counts: list[int], reps: int, layers: int = 30) -> None:
    """Per row count M: ms for SmolLM2's 4 * `layers` projections (Q4_1) and its head (Q8_0) on the AVX blocks
    against the same blocks in AMX tile order (lab/models/native_tiles.py), each also as one-row calls (what a
    verify step of M tokens costs against a decode), and the tiles' largest error against the exact product,
    relative to the sum of the terms' magnitudes (fp32 rounding is ~6e-8)."""
    generator = torch.Generator().manual_seed(0)
    shapes, pairs, head = block_weights(layers, generator)
    projections = [(weight, blocks, native_tiles.pack(blocks)) for weight, blocks in pairs]
    heads = [(*head, native_tiles.pack(head[1]))]
    print(f"\n| rows | {len(shapes)} projections, AVX blocks ms | AMX tiles ms | speedup "
          f"| as one-row calls (AVX / AMX) "
          f"| head, AVX blocks ms | AMX tiles ms | speedup | max error / sum of terms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def rows_of(m: int) -> dict[int, torch.Tensor]:
        return {inn: torch.randn(m, inn, generator=generator) for inn in {inn for _, inn in shapes}}

    ones = rows_of(1)
    sweep_ms(projections, 1, ones, 1), sweep_ms(projections, 2, ones, 1)     # NOTE: warm-up, not timed
    one_row = sweep_ms(projections, 1, ones, reps), sweep_ms(projections, 2, ones, reps)
    for m in row_counts:
        xs = rows_of(m)
        avx, amx = sweep_ms(projections, 1, xs, reps), sweep_ms(projections, 2, xs, reps)
        head_avx, head_amx = sweep_ms(heads, 1, xs, reps), sweep_ms(heads, 2, xs, reps)
        error = 0.0
        for weight, _, tiles in projections[:4] + heads:
            x = xs[weight.shape[1]].double()
            exact, scale = x @ weight.double().T, x.abs() @ weight.double().abs().T
            error = max(error, float(((native_gemv.gemv(xs[weight.shape[1]], tiles).double() - exact).abs()
                                      / scale).max()))
        print(f"| {m} | {avx:.1f} | {amx:.1f} | {avx / amx:.2f}x | {avx / one_row[0]:.2f} / {amx / one_row[1]:.2f} "
              f"| {head_avx:.2f} | {head_amx:.2f} "
              f"| {head_avx / head_amx:.2f}x | {error:.1e} |")


def head_table(row_counts: list[int], reps: int, layers: int = 30) -> None:
    """Per row count M: ms for the Q8_0 head's logits and their argmax (the full head) against the greedy screen's
    argmax alone, each the best of `reps` calls with SmolLM2's 4 * `layers` projections streamed before it (the
    head cold, as in a decode step), and whether every argmax is the same."""
    generator = torch.Generator().manual_seed(0)
    shapes, projections, (_, head_blocks) = block_weights(layers, generator)
    screen = native_head.HeadScreen(head_blocks)
    print("\n| rows | full head ms (logits + argmax) | greedy screen ms | speedup | same argmax |")
    print("|---:|---:|---:|---:|---|")

    def cold_ms(call, xs: dict[int, torch.Tensor]) -> float:
        best = float("inf")
        for _ in range(reps):
            sweep_ms(projections, 1, xs, 1)
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        return best * 1e3

    for m in row_counts:
        xs = {inn: torch.randn(m, inn, generator=generator) for inn in {inn for _, inn in shapes}}
        x = xs[head_blocks.shape[1] // weight_blocks.Q8_0_BYTES * 32]
        full = cold_ms(lambda: native_gemv.argmax_rows(native_gemv.gemv(x, head_blocks)), xs)
        screened = cold_ms(lambda: screen.argmax(x), xs)
        same = torch.equal(screen.argmax(x), native_gemv.argmax_rows(native_gemv.gemv(x, head_blocks)))
        print(f"| {m} | {full:.2f} | {screened:.2f} | {full / screened:.2f}x | {same} |")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()
