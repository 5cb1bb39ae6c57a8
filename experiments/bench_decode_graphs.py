"""CUDA graphs for decode steps (issue 6), measured on a GPU: cb_paged's decode step with graphs off vs on,
per batch size, in one run, on random-init weights of SmolLM2-135M's shape (where kernel launches dominate)
and of a ~1B Llama shape (where they matter less). scripts/gpu_check.sh runs it.

    python experiments/bench_decode_graphs.py                       # both shapes, batches 1,4,16,64, bf16
    python experiments/bench_decode_graphs.py --shapes smollm2 --batches 1,8 --steps 32
    python experiments/bench_decode_graphs.py --spec-tokens 7       # speculative: every step verifies 1 + 7 tokens
    python experiments/bench_decode_graphs.py --shapes smollm2 --batches 1 --spec-tokens 7 --profile 8
    python experiments/bench_decode_graphs.py --shapes smollm2 --batches 1 --spec-tokens 7 --tree-nodes 62

With `--spec-tokens k` the engine is speculative with an untrained DFlash drafter of the target's shape (one
layer, block k + 1): against a random target nearly every draft is rejected, so every timed step is a verify of
1 + k tokens per request plus one drafter forward, the cost side of speculation (acceptance needs real weights;
docs/speculative.md has the CPU's). The table then also gives the draft's ms per step. `--tree-nodes N` drafts
engine=dflash_tree's tree of the block's N likeliest paths instead: a verify of 1 + N tokens per request, with the
tree built on the host after the drafter's forward.

Each engine holds `batch` requests of `--prompt-len` random tokens, all past their prefill; the timed
window is `--steps` whole engine steps (schedule, inputs, forward or graph replay, sampling, bookkeeping)
between two CUDA synchronisations. Prints a markdown table; `--out` also writes it as JSON.

`--profile N` then profiles N more steps of each engine with torch.profiler, the engine's labelled ranges on
(schedule, prepare_inputs, draft, verify, sample, attention), and prints where their time goes: the ranges and
the top operators by self host time and, on a GPU, by self device time (session 15 left an eager verify step on
the H200 at 86-101 ms against 17.8 ms for a plain one, unexplained).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench_batched import filled_engine  # NOTE: run as a script, experiments/ is on sys.path
from lab.engines.continuous import ContinuousBatchingEngine
from lab.models.sources import tiny
from lab.profiling import set_ranges_enabled
from lab.runner import ModelRunner
from lab.runner.cuda_graphs import CudaGraphConfig
from lab.spec.dflash import DFlashProposerConfig

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=49152, tie_word_embeddings=True),
}


def time_steps(engine: ContinuousBatchingEngine, steps: int) -> float:
    """Mean ms per engine step over `steps` decode steps (after 3 untimed ones: graph capture, warm-up)."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    for _ in range(3):
        engine.step()
    sync()
    graphs = engine.stats().get("cuda_graph/num_graphs", 0)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    if engine.stats().get("cuda_graph/num_graphs", 0) != graphs:
        print(f"  WARNING: {engine.name} captured a graph inside the timed window: its mean includes the capture")
    return 1000 * (time.perf_counter() - start) / steps


def profile_steps(engine: ContinuousBatchingEngine, steps: int, top: int = 25) -> str:
    """torch.profiler over `steps` engine steps, labelled ranges on -> the key-averages tables as text."""
    on_cuda = engine.runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    set_ranges_enabled(True)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
            if on_cuda:
                torch.cuda.synchronize()
    finally:
        set_ranges_enabled(False)
    averages = prof.key_averages()
    tables = [f"host time by operator and range ({steps} steps):",
              averages.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)]
    if on_cuda:
        tables += [f"device time by kernel ({steps} steps):",
                   averages.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=48)]
    return "\n".join(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="smollm2,llama-1b")
    parser.add_argument("--batches", default="1,4,16,64")
    # NOTE: 160 = 10 blocks of 16: the tables stay in the 16-column bucket for the next 96 tokens, so no graph is
    # captured inside the timed window (a capture there, ~0.1-0.3 s, would add milliseconds to every step's mean;
    # time_steps warns if one is).
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run, graphs in `eager` mode (no capture)")
    parser.add_argument("--init-range", type=float, default=0.02,
                        help="random init's std; 0.2 separates the logits enough that fp32 greedy tokens can be compared")
    parser.add_argument("--spec-tokens", type=int, default=0, help="k > 0: speculative verify steps of 1 + k tokens")
    parser.add_argument("--tree-nodes", type=int, default=0,
                        help="with --spec-tokens: verify a tree of the block's N likeliest paths (tree_nodes)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", type=int, default=0, help="N > 0: then profile N steps of each engine")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_decode_graphs needs CUDA: run it on a GPU machine (scripts/gpu_check.sh), "
                         "or smoke-test it with --device cpu")
    graph_mode = "cuda" if args.device == "cuda" else "eager"
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    rows = []
    print(f"{device_name}, torch {torch.__version__}, {args.dtype}, prompt {args.prompt_len}, {args.steps} timed steps")
    for shape in args.shapes.split(","):
        source = tiny(seed=0, with_tokenizer=False, max_position_embeddings=4096, initializer_range=args.init_range,
                      **SHAPES[shape])
        runner = ModelRunner(source, dtype=args.dtype, device=args.device)
        for batch in [int(b) for b in args.batches.split(",")]:
            ms, tokens = {}, {}
            for mode in ("off", graph_mode):
                proposer = (DFlashProposerConfig(checkpoint=None, drafter={"block_size": args.spec_tokens + 1},
                                                 tree_nodes=args.tree_nodes)
                             if args.spec_tokens else None)
                # NOTE: room for every draft to the end (a request near max_tokens drafts fewer: another graph).
                most_drafts = max(args.spec_tokens, args.tree_nodes)
                engine = filled_engine(runner, batch, args.prompt_len,
                                       max_tokens=args.steps + args.profile + 8 + most_drafts,
                                       cuda_graphs=CudaGraphConfig(mode=mode), proposer=proposer,
                                       num_spec_tokens=args.spec_tokens)
                draft_s = engine.stats().get("spec/draft_s", 0.0)
                ms[mode] = time_steps(engine, args.steps)
                draft_ms = 1000 * (engine.stats().get("spec/draft_s", 0.0) - draft_s) / (args.steps + 3)
                tokens[mode] = [list(r.output_token_ids) for r in engine.scheduler.running]
                graphs = engine.stats().get("cuda_graph/num_graphs", 0)
                if args.profile:
                    print(f"  {shape} batch {batch} k {args.spec_tokens}, graphs {mode}: "
                          + profile_steps(engine, args.profile), flush=True)
                engine.abort_running("benchmark over")
            same = sum(a == b for a, b in zip(tokens["off"], tokens[graph_mode])) / batch
            rows.append({"shape": shape, "batch": batch, "spec_tokens": args.spec_tokens,
                         "tree_nodes": args.tree_nodes, "draft_ms": draft_ms,
                         "eager_ms": ms["off"], "graph_ms": ms[graph_mode],
                         "speedup": ms["off"] / ms[graph_mode], "graph_tok_s": batch * 1000 / ms[graph_mode],
                         "num_graphs": graphs, "same_tokens": same})
            print(f"  {shape} batch {batch} k {args.spec_tokens}: eager {ms['off']:.2f} ms, graphs {ms[graph_mode]:.2f} "
                  f"ms/step ({ms['off'] / ms[graph_mode]:.2f}x; draft {draft_ms:.2f} ms), identical sequences {same:.0%}",
                  flush=True)
        del runner
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print("\n| shape | batch | drafts k | tree nodes | eager ms/step | graph ms/step | speedup "
          "| draft ms/step (graphs) | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['spec_tokens']} | {r['tree_nodes'] or '-'} | {r['eager_ms']:.2f} "
              f"| {r['graph_ms']:.2f} "
              f"| {r['speedup']:.2f}x | {r['draft_ms']:.2f} | {r['same_tokens']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
