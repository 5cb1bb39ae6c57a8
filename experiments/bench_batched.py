"""Batched-decode benchmark, all in one run (issues 5 and 6): the GEMM peak of this machine (best of MKL,
oneDNN and our native panel GEMM), cb_paged's decode tok/s and achieved GFLOP/s at batch 8/32/64
(attention `fast` vs `native`, linears on `--weights native,onednn[,mkl]`), the non-model share
of a decode step (timers, and a torch.profiler window with labelled ranges at batch 32), and cb_paged
vs hf_cb vs static on one mixed random workload at the same max batch.

    python experiments/bench_batched.py                      # 1 thread, mixed workload at half length
    python experiments/bench_batched.py --quick              # a short smoke run
    python experiments/bench_batched.py --length-scale 1 --num-requests 64 --max-batch 64   # the issue's full mix

Times are read twice: wall clock and the process's CPU time. On a shared machine (load above the core
count) the process is descheduled for long stretches, so wall-clock tok/s says more about the neighbours
than about the code; ratios are computed from CPU time and both are printed. GFLOP/s counts the linear
layers and the LM head only (2 x weights per token, ~270 MFLOP for SmolLM2-135M), as the issue does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab.engines.base import Engine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.hf_cb import HFCBEngine
from lab.engines.speculative import SpeculativeEngine
from lab.engines.static import StaticBatchEngine
from lab.kv_cache import PagedKVCacheConfig
from lab.metrics.summary import summarize
from lab.models import native_gemm, native_gemv
from lab.models.packed_linear import PACK_BATCH_HINT, pack_linear_weights, unpack_linear_weights
from lab.models.sources import smollm2
from lab.profiling import TorchProfiler
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.runner.cuda_graphs import CudaGraphConfig
from lab.sched import SchedulerConfig
from lab.spec.proposer import ProposerConfig
from lab.workloads import RandomWorkload
from lab.workloads.base import SamplingDefaults

# (M rows, K in, N out): the model's projections at decode and prefill row counts, plus a square reference.
GEMM_SHAPES = [(m, k, n) for m in (64, 256, 512) for k, n in ((576, 960), (576, 3072), (1536, 576), (576, 49152))]
GEMM_SHAPES.append((1024, 1024, 1024))


class Clock:
    """Wall and process-CPU seconds of a block: `with clock: ...` adds to .wall and .cpu."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> Clock:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu


def best_cpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # NOTE: the first call creates oneDNN primitives and touches pages
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def gemm_peak(repeats: int) -> dict[str, Any]:
    """Best GFLOP/s (CPU time) per shape of torch.mm (MKL), of oneDNN on a prepacked weight and of our native
    panel GEMM (lab/models/native_gemm.py) where built; the peak is the best of all of them."""
    rows = []
    for m, k, n in GEMM_SHAPES:
        a, weight = torch.randn(m, k), torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        flops = 2 * m * k * n
        row = {"shape": f"{m}x{k}x{n}",
               "mkl_gflops": flops / best_cpu_seconds(lambda: torch.mm(a, weight.t()), repeats) / 1e9,
               "onednn_gflops": flops / best_cpu_seconds(
                   lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), repeats) / 1e9}
        if native_gemv.load_kernel() is not None:
            panels = native_gemm.pack(weight)
            row["native_gflops"] = flops / best_cpu_seconds(lambda: native_gemm.gemm(a, panels, n), repeats) / 1e9
        rows.append(row)
    peak = max(v for r in rows for key, v in r.items() if key.endswith("_gflops"))
    return {"peak_gflops": peak, "shapes": rows}


def flops_per_token(runner: ModelRunner) -> int:
    """2 x the weights of every linear layer and the LM head (attention's own FLOPs not counted)."""
    return 2 * sum(m.weight.numel() for m in runner.model.modules() if isinstance(m, nn.Linear))


def filled_engine(runner: ModelRunner, batch: int, prompt_len: int, attention: str = "native", max_tokens: int = 64,
                  cuda_graphs: CudaGraphConfig | None = None, proposer: ProposerConfig | None = None,
                  num_spec_tokens: int = 0) -> ContinuousBatchingEngine:
    """A cb_paged engine (with `proposer`, a speculative one drafting `num_spec_tokens`) with `batch` requests
    of `prompt_len` random tokens, all past their prefill."""
    scheduler = SchedulerConfig(batch, 2048)
    kv_cache = PagedKVCacheConfig(attention=attention, kv_cache_memory_mb=None,
                                  num_blocks=batch * -(-(prompt_len + max_tokens + num_spec_tokens) // 16) + 8)
    engine = (ContinuousBatchingEngine(runner, scheduler, kv_cache, cuda_graphs=cuda_graphs) if proposer is None else
              SpeculativeEngine(runner, proposer, num_spec_tokens, scheduler, kv_cache, cuda_graphs=cuda_graphs))
    generator = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, runner.vocab_size - 1, (prompt_len,), generator=generator).tolist()
        engine.add_request(Request(f"d{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


def measure_decode(engine: ContinuousBatchingEngine, num_steps: int) -> dict[str, float]:
    """Step time and the share outside the model's forward (runner.execute) over `num_steps` decode steps."""
    step, model = Clock(), Clock()
    execute = engine.runner.execute

    def timed_execute(*args: Any, **kwargs: Any) -> torch.Tensor:
        with model:
            return execute(*args, **kwargs)

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    try:
        engine.step()  # NOTE: one unmeasured step: the first after a switch pays cache misses
        step.wall = step.cpu = model.wall = model.cpu = 0.0
        for _ in range(num_steps):
            with step:
                engine.step()
    finally:
        del engine.runner.execute
    return {"step_ms": 1000 * step.cpu / num_steps, "step_wall_ms": 1000 * step.wall / num_steps,
            "non_model_share": 1 - model.cpu / step.cpu}


def set_weights(runner: ModelRunner, weights: str) -> None:
    """`native` / `onednn`: the linears' packed copy for that GEMM; `mkl`: no copy (F.linear)."""
    if weights == "mkl":
        unpack_linear_weights(runner.model)
    else:
        pack_linear_weights(runner.model, weights)


def decode_sweep(runner: ModelRunner, args: argparse.Namespace, peak: float) -> list[dict[str, Any]]:
    """Per batch size, every (attention, weights) variant on the same filled engines, interleaved over
    `rounds` and the fastest round kept: on a shared machine a slow round is the neighbours, not the code."""
    rows = []
    weights = args.weights.split(",")
    for batch in [int(b) for b in args.batches.split(",")]:
        engines = {a: filled_engine(runner, batch, args.prompt_len, a) for a in args.attentions.split(",")}
        best: dict[tuple[str, str], dict[str, float]] = {}
        for _ in range(args.rounds):
            for weight in weights:
                set_weights(runner, weight)
                for attention, engine in engines.items():
                    result = measure_decode(engine, args.decode_steps)
                    if (attention, weight) not in best or result["step_ms"] < best[attention, weight]["step_ms"]:
                        best[attention, weight] = result
        set_weights(runner, weights[0])
        for engine in engines.values():
            engine.abort_running("benchmark over")
        for (attention, weight), result in best.items():
            tok_s = batch * 1000 / result["step_ms"]
            gflops = tok_s * flops_per_token(runner) / 1e9
            rows.append({"batch": batch, "attention": attention, "weights": weight, **result,
                         "tok_s": tok_s, "wall_tok_s": batch * 1000 / result["step_wall_ms"], "gflops": gflops,
                         "share_of_peak": gflops / peak})
            print(f"  decode batch {batch:3d} {attention:6s} {rows[-1]['weights']:6s}: {tok_s:6.1f} tok/s (CPU time), "
                  f"{gflops:5.1f} GFLOP/s = {gflops / peak:4.0%} of peak, non-model {result['non_model_share']:.1%}",
                  flush=True)
    return rows


def profile_decode(runner: ModelRunner, batch: int, prompt_len: int, attention: str, out_dir: Path) -> dict[str, Any]:
    """torch.profiler over 6 decode steps; the non-model share from the labelled ranges."""
    engine = filled_engine(runner, batch, prompt_len, attention)
    profiler = TorchProfiler(wait=1, warmup=1, active=6, record_shapes=False, profile_memory=False,
                             with_stack=False, memory_timeline=False)
    profiler.start(out_dir, runner.device)
    for _ in range(8):
        engine.step()
        profiler.step()
    summary = profiler.stop()
    engine.abort_running("benchmark over")
    ranges = {k: v["total_ms"] for k, v in summary["ranges"].items()}
    non_model = ranges.get("schedule", 0) + ranges.get("prepare_inputs", 0) + ranges.get("sample", 0)
    step = ranges.get("schedule", 0) + ranges.get("prepare_inputs", 0) + ranges.get("decode", 0)
    return {"ranges_ms": ranges, "non_model_share": non_model / step if step else float("nan")}


def mixed_requests(runner: ModelRunner, num: int, scale: float, seed: int) -> list[Request]:
    """The issue's mix, prompts 32-1024 and outputs 16-512 tokens (uniform), lengths times `scale`."""
    workload = RandomWorkload(num_prompts=num, input_len=round(528 * scale), output_len=round(264 * scale),
                              range_ratio=0.9394, seed=seed, name="mixed")
    return workload.build(runner.tokenizer, runner.vocab_size, SamplingDefaults())


def make_engines(runner: ModelRunner, max_batch: int) -> dict[str, Callable[[], Engine]]:
    return {"cb_paged": lambda: ContinuousBatchingEngine(runner, SchedulerConfig(max_batch, 512),
                                                         PagedKVCacheConfig(attention="native")),
            "static": lambda: StaticBatchEngine(runner, batch_size=max_batch),
            "hf_cb": lambda: HFCBEngine(runner, max_num_seqs=max_batch)}


def compare_engines(runner: ModelRunner, args: argparse.Namespace) -> list[dict[str, Any]]:
    requests = mixed_requests(runner, args.num_requests, args.length_scale, args.seed)
    rows, outputs = [], {}
    for name, make in make_engines(runner, args.max_batch).items():
        if name not in args.engines:
            continue
        engine = make()
        engine.run([_copy(r, f"warm{i}") for i, r in enumerate(mixed_requests(runner, 2, 0.1, args.seed + 1))])
        batch = [_copy(r, r.request_id) for r in requests]
        with Clock() as clock:
            result = engine.run(batch)
        num_tokens = sum(r.num_output_tokens for r in result.requests)
        outputs[name] = [r.output_token_ids for r in result.requests]
        summary = summarize(result.requests, result.duration)
        rows.append({"engine": name, "output_tokens": num_tokens, "tok_s": num_tokens / clock.cpu,
                     "wall_tok_s": num_tokens / clock.wall, "cpu_s": clock.cpu, "wall_s": clock.wall,
                     "completed": summary["completed"], "mean_ttft_ms": summary["mean_ttft_ms"],
                     "mean_tpot_ms": summary["mean_tpot_ms"], "same_tokens_as_cb_paged":
                         outputs[name] == outputs.get("cb_paged", outputs[name])})
        print(f"  {name:8s}: {rows[-1]['tok_s']:6.1f} output tok/s (CPU time), {rows[-1]['wall_tok_s']:6.1f} wall, "
              f"{num_tokens} tokens, same tokens as cb_paged: {rows[-1]['same_tokens_as_cb_paged']}", flush=True)
    return rows


def _copy(request: Request, request_id: str) -> Request:
    return Request(request_id, list(request.prompt_token_ids), SamplingParams(
        max_tokens=request.sampling_params.max_tokens, ignore_eos=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--attentions", default="fast,native")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=4, help="steps per measurement round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the fastest is kept")
    parser.add_argument("--gemm-repeats", type=int, default=5)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--length-scale", type=float, default=0.5)
    parser.add_argument("--engines", default="cb_paged,static,hf_cb", help='"" skips the mixed-workload comparison')
    parser.add_argument("--weights", default="native,onednn",
                        help="GEMMs to decode with: native (our panels), onednn (its packed copy), mkl (F.linear); "
                             "the first is kept for the profile and the workload comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.decode_steps, args.rounds, args.gemm_repeats = "8,32", 2, 1, 2
        args.num_requests, args.max_batch, args.length_scale = 6, 4, 0.1
    torch.set_num_threads(args.threads)
    runner = ModelRunner(smollm2(), dtype="float32", device="cpu", max_model_len=2048)
    set_weights(runner, args.weights.split(",")[0])
    print(f"threads {torch.get_num_threads()}, {flops_per_token(runner) / 1e6:.0f} MFLOP per token", flush=True)
    peak = gemm_peak(args.gemm_repeats)
    print(f"GEMM peak {peak['peak_gflops']:.1f} GFLOP/s (CPU time; best of MKL, oneDNN and native over "
          f"{len(GEMM_SHAPES)} shapes)", flush=True)
    for row in peak["shapes"]:
        print("  " + row["shape"] + ": " + ", ".join(f"{key[:-7]} {v:.1f}" for key, v in row.items()
                                                     if key.endswith("_gflops")), flush=True)
    results: dict[str, Any] = {"threads": args.threads, "gemm": peak, "args": {k: str(v) for k, v in vars(args).items()}}
    results["decode"] = decode_sweep(runner, args, peak["peak_gflops"])
    with tempfile.TemporaryDirectory() as tmp:
        results["profile_b32"] = profile_decode(runner, 32, args.prompt_len, args.attentions.split(",")[-1], Path(tmp))
    print(f"  profile, batch 32: non-model share {results['profile_b32']['non_model_share']:.1%} of a decode step")
    if args.engines:
        print(f"mixed workload: {args.num_requests} requests, max batch {args.max_batch}, lengths x{args.length_scale}")
    results["mixed"] = compare_engines(runner, args) if args.engines else []
    tok_s = {r["engine"]: r["tok_s"] for r in results["mixed"]}
    for other in ("hf_cb", "static"):
        if "cb_paged" in tok_s and other in tok_s:
            print(f"  cb_paged / {other}: {tok_s['cb_paged'] / tok_s[other]:.2f}x (CPU-time tok/s)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
