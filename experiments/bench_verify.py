"""Micro-benchmark: what a verify step of n tokens costs at batch 1, in plain (one-token) steps of the same
target: `ModelRunner.execute` on the paged cache over a context of `--context` tokens, logits for every row
(a verify with logprobs or a sampling temperature needs them all; `--greedy`: only each row's argmax, as a greedy
verify reads, through the head's greedy screen where it runs, lab/models/native_head.py), SmolLM2-135M fp32, the
engines' `native` attention unless `--attention` says otherwise (before session 19 this script used `fast`, SDPA per
layer: its tables in docs/ until then are of that path).

Speculation at batch 1 pays when tau > the cost of its verify step (plus the draft); a tree of drafts pays
only where its extra rows cost less than the tokens they add (docs/speculative.md, session 14). The row
counts take turns call by call, in alternating order, so a machine whose speed drifts slows all alike.

    python experiments/bench_verify.py --rows 1,2,3,4,5,6,8
    python experiments/bench_verify.py --rows 1,2,3,4,7,12 --greedy
    python experiments/bench_verify.py --model llama-1b --device cuda --dtype bfloat16 --rows 1,2,4,8,16,32,64

`--model smollm2` / `llama-1b` are random-init targets of those shapes (bench_decode_graphs.SHAPES): no weights
travel to a GPU machine, and a step's cost does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lab.kv_cache.block_kv import SeqSlice
from bench_decode_graphs import SHAPES  # NOTE: run as a script, experiments/ is on sys.path
from lab.models.sources import smollm2, tiny
from lab.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,5,6,8", help="comma-separated tokens per verify step")
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--calls", type=int, default=40, help="timed steps per row count")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="real", choices=["real", *SHAPES],
                        help="real: SmolLM2-135M's weights; else a random-init target of that shape")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention", default="native", choices=["native", "fast", "gather"],
                        help="the paged cache's attention backend (native: the engines' default; on CPU its steps of "
                             "a few tokens run all layers in one native call)")
    parser.add_argument("--greedy", action="store_true",
                        help="each row's argmax only (ModelRunner.execute(greedy=True)), as a greedy verify reads")
    args = parser.parse_args()
    rows = sorted({int(n) for n in args.rows.split(",")} | {1})
    torch.set_num_threads(args.threads)
    source = (smollm2() if args.model == "real" else
              tiny(seed=0, with_tokenizer=False, max_position_embeddings=4096, initializer_range=0.02,
                   **SHAPES[args.model]))
    runner = ModelRunner(source, dtype=args.dtype, device=args.device)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    block_size = 16
    block_table = list(range(1, 2 + (args.context + max(rows)) // block_size))
    cache = runner.allocate_block_kv_cache(len(block_table) + 1, block_size, backend=args.attention)
    generator = torch.Generator().manual_seed(0)
    cache.begin_step([SeqSlice(block_table, 0, args.context)])
    runner.execute(torch.randint(100, 5000, (1, args.context), generator=generator),
                   torch.arange(args.context)[None], cache, None)                        # the prompt
    positions = {n: torch.arange(args.context, args.context + n)[None] for n in rows}
    times: dict[int, list[float]] = {n: [] for n in rows}
    for call in range(args.calls + 2):
        for n in rows if call % 2 == 0 else reversed(rows):
            input_ids = torch.randint(100, 5000, (1, n), generator=generator)
            # NOTE: every step rewrites the same n slots after the context: the context never grows.
            cache.begin_step([SeqSlice(block_table, args.context, n)])
            sync()
            start = time.perf_counter()
            runner.execute(input_ids, positions[n], cache, None, greedy=args.greedy)   # (1, n, V) or (1, n)
            sync()
            if call >= 2:   # the first two rounds warm up
                times[n].append(time.perf_counter() - start)
    plain = statistics.median(times[1])
    where = (torch.cuda.get_device_name() if runner.device.type == "cuda"
             else f"CPU, {args.threads} thread(s), load average {os.getloadavg()[0]:.2f}")
    head = "each row's argmax" + (" (the greedy screen)" if runner.greedy_head else "") if args.greedy else "logits"
    print(f"# bench_verify: {args.model} ({args.dtype}) on {where}, {args.attention} attention, batch 1, "
          f"context {args.context}, {args.calls} steps each, {head}")
    print("| tokens in the step | median (ms) | plain steps |")
    print("|---:|---:|---:|")
    for n in rows:
        median = statistics.median(times[n])
        print(f"| {n} | {median * 1e3:.1f} | {median / plain:.2f} |")


if __name__ == "__main__":
    main()
