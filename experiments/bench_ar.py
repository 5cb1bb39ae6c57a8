"""Batch-1 decode benchmark: our `ar` engine against HF transformers' `generate` (`hf`), same weights,
same process, interleaved repetitions, plus the machine's memory-bandwidth roofline.

Decode tok/s excludes prefill: (n - 1) / (t_last - t_first) over the per-token timestamps. End-to-end
tok/s is n / (last token - scheduling), prefill included. The roofline for batch-1 decode is
bandwidth / weight bytes: every step streams every weight matrix once (a tied embedding is counted
once, since only its row is gathered but the lm_head reads the whole matrix). `ar` streams SmolLM2's
projections as their exact GGUF blocks (model.weight_blocks=auto, lab/models/weight_blocks.py), so its
roofline is the blocks' bytes; `ar-fp32` is the same engine on the fp32 weights (weight_blocks=off). Where the CPU
has AMX-BF16, `ar` streams them as AMX tiles (model.block_kernel=auto, lab/models/native_tiles.py) and `ar-avx`
is the same engine on the AVX blocks (block_kernel=avx, bit-identical to fp32). Where Linux offers transparent huge
pages, `ar` streams them from 2 MiB pages (model.huge_pages=auto, lab/huge_pages.py) and `ar-4k` is the same
engine with them on the allocator's 4 KiB pages (huge_pages=off).

    python experiments/bench_ar.py                 # fp32, 128 prompt + 128 new tokens, 5 reps each
    python experiments/bench_ar.py --quick         # a short run
    python experiments/bench_ar.py --dtype bfloat16  # also bf16
    python experiments/bench_ar.py --no-native --profile  # + `ar-mkl` (native kernels off), both profiled
    python experiments/bench_ar.py --llama-cpp     # + llama.cpp (llama-cpp-python) on an F32 GGUF of the same weights
    OMP_WAIT_POLICY=PASSIVE python experiments/bench_ar.py  # cores shared with other jobs: see docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.engines.ar import AREngine
from lab.engines.base import Engine
from lab.engines.hf import HFEngine
from lab.models import native_gemv
from lab.models.sources import smollm2
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner

BANDWIDTH_MIB = 256  # per buffer; far above the L3 cache so the copy streams from DRAM


@dataclass(slots=True)
class Samples:
    decode_tok_s: list[float] = field(default_factory=list)
    e2e_tok_s: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)

    def record(self, start: float, token_times: list[float], token_ids: list[int]) -> None:
        """One run: `start` when it was scheduled, then each output token's timestamp."""
        self.decode_tok_s.append((len(token_times) - 1) / (token_times[-1] - token_times[0]))
        self.e2e_tok_s.append(len(token_times) / (token_times[-1] - start))
        self.ttft_ms.append((token_times[0] - start) * 1e3)
        self.output_token_ids = list(token_ids)


@dataclass(slots=True)
class DtypeResult:
    weight_bytes: dict[str, int]       # engine name -> bytes one decode step streams (tied embedding once)
    samples: dict[str, Samples]        # engine name -> samples


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # NOTE: the first call pays page faults and thread start-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth_gb_s(repeats: int) -> dict[str, float]:
    """Copy (STREAM convention: read + write bytes) and read-only (a sum) bandwidth, medians in GB/s."""
    src = torch.randn(BANDWIDTH_MIB * 2**20 // 4)  # (N,) fp32
    dst = torch.empty_like(src)
    num_bytes = src.numel() * src.element_size()
    copy_s = median_seconds(lambda: dst.copy_(src), repeats)
    read_s = median_seconds(lambda: src.sum(), repeats)
    return {"copy": 2 * num_bytes / copy_s / 1e9, "read": num_bytes / read_s / 1e9}


class LlamaCppDecoder:
    """llama.cpp through llama-cpp-python on the F32 GGUF of the same weights (lab/models/gguf_export.py), the
    same threads; greedy, its tokens timed as they come out of `Llama.generate` (first one = after prefill)."""

    name = "llama.cpp"

    def __init__(self, threads: int, max_len: int) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise SystemExit("--llama-cpp needs llama-cpp-python: `pip install llama-cpp-python` (compiles "
                             "llama.cpp, ~10 min), or drop --llama-cpp") from exc

        from lab.models.gguf_export import smollm2_f32_gguf

        self.llm = Llama(str(smollm2_f32_gguf()), n_threads=threads, n_threads_batch=threads, n_ctx=max_len,
                         n_batch=max_len, verbose=False)

    def run(self, prompt_token_ids: list[int], num_new_tokens: int, samples: Samples) -> None:
        self.llm.reset()  # NOTE: otherwise generate() reuses the previous run's prompt KV and TTFT means nothing
        start, times, tokens = time.perf_counter(), [], []
        # NOTE: generate() never stops by itself (no EOS check), so every run yields num_new_tokens tokens.
        for token in self.llm.generate(prompt_token_ids, top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == num_new_tokens:
                break
        samples.record(start, times, tokens)


def run_once(engine: Engine | LlamaCppDecoder, prompt_token_ids: list[int], num_new_tokens: int,
             samples: Samples) -> None:
    if isinstance(engine, LlamaCppDecoder):
        engine.run(prompt_token_ids, num_new_tokens, samples)
    elif engine.name == "ar-mkl":  # NOTE: the ablation runs with the native kernels off, the others with them
        native_gemv.set_enabled(False)
        try:
            _run_once(engine, prompt_token_ids, num_new_tokens, samples)
        finally:
            native_gemv.set_enabled(True)
    else:
        _run_once(engine, prompt_token_ids, num_new_tokens, samples)


def _run_once(engine: Engine, prompt_token_ids: list[int], num_new_tokens: int, samples: Samples) -> None:
    params = SamplingParams(max_tokens=num_new_tokens, ignore_eos=True)
    request = Request(f"{engine.name}-{len(samples.decode_tok_s)}", list(prompt_token_ids), params)
    engine.run([request])
    if request.error or request.num_output_tokens != num_new_tokens:
        raise RuntimeError(f"{engine.name}: {request.num_output_tokens} tokens, error={request.error}")
    samples.record(request.first_scheduled_time, request.token_times, request.output_token_ids)


def row_major_runner(dtype: str) -> ModelRunner:
    """A runner whose projection weights are back in PyTorch's default (out, in) row-major layout."""
    runner = ModelRunner(smollm2(), dtype=dtype, device="cpu", weight_blocks="off")
    for module in runner.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.contiguous()
    return runner


def mkl_runner(dtype: str) -> ModelRunner:
    """A runner built with the native kernels off: column-major weights for MKL's gemv (the fallback)."""
    native_gemv.set_enabled(False)
    try:
        return ModelRunner(smollm2(), dtype=dtype, device="cpu")
    finally:
        native_gemv.set_enabled(True)


def bench_dtype(dtype: str, args: argparse.Namespace) -> DtypeResult:
    runner = ModelRunner(smollm2(), dtype=dtype, device="cpu")
    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, runner.vocab_size, (args.prompt_len,), generator=generator).tolist()
    engines: list[Engine | LlamaCppDecoder] = [AREngine(runner), HFEngine(runner, batch_size=1)]
    if runner.block_linears:     # NOTE: the baseline the blocks are measured against, in the same turns
        engines.append(AREngine(ModelRunner(smollm2(), dtype=dtype, device="cpu", weight_blocks="off"), name="ar-fp32"))
    if runner.block_kernel == "amx":   # NOTE: the AVX blocks (bit-identical to fp32) against the AMX tiles
        engines.append(AREngine(ModelRunner(smollm2(), dtype=dtype, device="cpu", block_kernel="avx"), name="ar-avx"))
    if runner.use_huge_pages:          # NOTE: the same blocks on the allocator's 4 KiB pages (model.huge_pages)
        engines.append(AREngine(ModelRunner(smollm2(), dtype=dtype, device="cpu", huge_pages="off"), name="ar-4k"))
    if args.llama_cpp and dtype == "float32":
        engines.append(LlamaCppDecoder(torch.get_num_threads(), args.prompt_len + args.new_tokens + 8))
    if args.row_major and dtype == "float32":  # NOTE: other dtypes already run row-major
        engines.append(AREngine(row_major_runner(dtype), name="ar-rowmajor"))
    if args.no_native and dtype == "float32" and native_gemv.AVAILABLE:
        engines.append(AREngine(mkl_runner(dtype), name="ar-mkl"))
    results = {engine.name: Samples() for engine in engines}
    for engine in engines:
        run_once(engine, prompt, min(8, args.new_tokens), Samples())  # warm-up: allocator, caches, threads
    # NOTE: interleave ar, hf, ar, hf ... so drift in the machine's load hits both engines alike.
    for _ in range(args.reps):
        for engine in engines:
            run_once(engine, prompt, args.new_tokens, results[engine.name])
    streamed = {engine.name: runner.weight_bytes for engine in engines}      # NOTE: hf (and llama.cpp) read fp32
    streamed.update({engine.name: engine.runner.streamed_weight_bytes for engine in engines
                     if isinstance(engine, AREngine)})
    return DtypeResult(streamed, results)


def profile_decode(dtype: str, args: argparse.Namespace, native: bool = True, num_steps: int = 16) -> str:
    """torch.profiler's top operators over `num_steps` decode steps of our model (after a prefill); the
    native kernels (pybind calls the profiler does not see) show up as `native::<name>` ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    saved = {name: getattr(native_gemv, name)
             for name in ("gemv", "rms_norm", "add_rms_norm", "rope", "silu_mul", "decode_attention")}

    def labelled(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object) -> torch.Tensor:
            with record_function(f"native::{name}"):
                return fn(*args)
        return call

    for name, fn in saved.items():
        setattr(native_gemv, name, labelled(name, fn))
    native_gemv.set_enabled(native)
    try:
        return _profile_decode(dtype, args, num_steps, profile, ProfilerActivity)
    finally:
        native_gemv.set_enabled(True)
        for name, fn in saved.items():
            setattr(native_gemv, name, fn)


def _profile_decode(dtype: str, args: argparse.Namespace, num_steps: int, profile: Any, activity: Any) -> str:
    runner = ModelRunner(smollm2(), dtype=dtype, device="cpu")
    cache = runner.allocate_kv_cache(1, args.prompt_len + 2 * num_steps)
    cache.begin_forward(0, args.prompt_len)
    runner.execute(torch.zeros((1, args.prompt_len), dtype=torch.long), torch.arange(args.prompt_len)[None], cache)

    def decode(position: int) -> None:
        cache.begin_forward(position, 1)
        runner.execute(torch.zeros((1, 1), dtype=torch.long), torch.tensor([[position]]), cache)

    for position in range(args.prompt_len, args.prompt_len + num_steps):
        decode(position)  # warm-up
    start = time.perf_counter()
    for position in range(args.prompt_len + num_steps, args.prompt_len + 2 * num_steps):
        decode(position)
    step_ms = (time.perf_counter() - start) / num_steps * 1e3
    with profile(activities=[activity.CPU]) as prof:
        for position in range(args.prompt_len + num_steps, args.prompt_len + 2 * num_steps):
            decode(position)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    linear_ops = {"native::gemv", "aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}
    linear = sum(e.self_cpu_time_total for e in events if e.key in linear_ops)
    return (f"unprofiled step {step_ms:.2f} ms ({1e3 / step_ms:.1f} tok/s); profiled: "
            f"{total / num_steps / 1e3:.2f} ms/step self CPU, linears (incl. lm_head) "
            f"{linear / num_steps / 1e3:.2f} ms = {linear / total:.0%}, everything else "
            f"{(total - linear) / num_steps / 1e3:.2f} ms\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=15))


def render_table(by_dtype: dict[str, DtypeResult], bandwidth_gb_s: float) -> str:
    lines = ["| engine | dtype | decode tok/s (median) | min-max | e2e tok/s | TTFT ms | vs hf | of roofline |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for dtype, result in by_dtype.items():
        results = result.samples
        hf_decode = statistics.median(results["hf"].decode_tok_s)
        for name in results:
            s = results[name]
            decode = statistics.median(s.decode_tok_s)
            roofline = bandwidth_gb_s * 1e9 / result.weight_bytes[name]
            lines.append(f"| {name} | {dtype} | {decode:.1f} | {min(s.decode_tok_s):.1f}-{max(s.decode_tok_s):.1f} "
                         f"| {statistics.median(s.e2e_tok_s):.1f} | {statistics.median(s.ttft_ms):.0f} "
                         f"| {decode / hf_decode:.2f}x | {decode / roofline:.0%} |")
        for size in sorted(set(result.weight_bytes.values())):
            roofline = bandwidth_gb_s * 1e9 / size
            lines.append(f"| roofline, {size / 1e6:.0f} MB a step | {dtype} | {roofline:.1f} | | | "
                         f"| {roofline / hf_decode:.2f}x | 100% |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16 runs fp32 and then bf16")
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 2 repetitions")
    parser.add_argument("--row-major", action="store_true",
                        help="ablation (fp32): also run `ar` with row-major (PyTorch's default) weights")
    parser.add_argument("--no-native", action="store_true",
                        help="ablation (fp32): also run `ar` with the native decode kernels off (`ar-mkl`: "
                             "column-major weights on MKL's gemv, F.rms_norm, SDPA)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="fp32: also run llama.cpp (llama-cpp-python, optional) on an F32 GGUF of the same weights")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of ar's decode step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.reps, args.new_tokens = 2, 32
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"# bench_ar: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average {os.getloadavg()[0]:.2f}")
    print(f"prompt {args.prompt_len} random tokens, {args.new_tokens} new tokens (ignore_eos), greedy, "
          f"{args.reps} interleaved repetitions per engine, medians")
    bandwidth = memory_bandwidth_gb_s(repeats=5 if args.quick else 9)
    best = max(bandwidth.values())
    print(f"memory bandwidth: copy {bandwidth['copy']:.1f} GB/s, read {bandwidth['read']:.1f} GB/s "
          f"(roofline uses the higher, {best:.1f} GB/s)")
    dtypes = ["float32"] + (["bfloat16"] if args.dtype == "bfloat16" else [])
    by_dtype = {dtype: bench_dtype(dtype, args) for dtype in dtypes}
    for dtype, result in by_dtype.items():
        same = result.samples["ar"].output_token_ids == result.samples["hf"].output_token_ids
        sizes = ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in result.weight_bytes.items())
        print(f"{dtype}: weights read per decode step: {sizes}; ar tokens == hf tokens: {same}")
        if "ar-fp32" in result.samples:
            ratio = statistics.median(result.samples["ar"].decode_tok_s) / statistics.median(
                result.samples["ar-fp32"].decode_tok_s)
            same = result.samples["ar"].output_token_ids == result.samples["ar-fp32"].output_token_ids
            print(f"{dtype}: GGUF blocks over fp32 weights: {ratio:.2f}x decode tok/s; same tokens: {same}")
        if "ar-4k" in result.samples:
            ratio = statistics.median(result.samples["ar"].decode_tok_s) / statistics.median(
                result.samples["ar-4k"].decode_tok_s)
            same = result.samples["ar"].output_token_ids == result.samples["ar-4k"].output_token_ids
            print(f"{dtype}: blocks on 2 MiB pages over 4 KiB ones: {ratio:.3f}x decode tok/s; same tokens: {same}")
        if "llama.cpp" in result.samples:
            ours, theirs = result.samples["ar"].output_token_ids, result.samples["llama.cpp"].output_token_ids
            agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
            print(f"{dtype}: llama.cpp's greedy tokens equal ar's for the first {agree} of {len(ours)}")
    print()
    print(render_table(by_dtype, best))
    if args.profile:
        for native in [True, False] if args.no_native else [True]:
            label = "native kernels" if native and native_gemv.AVAILABLE else "torch ops / MKL (no native kernels)"
            print(f"\nar decode step, {dtypes[-1]}, {label}, self CPU time per operator:\n"
                  f"{profile_decode(dtypes[-1], args, native)}")
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (other processes on these cores skew the numbers)")


if __name__ == "__main__":
    main()
