"""Result files in the run dir (results.json, requests.jsonl) and the summary table printed at the end.

Owns: serialization and presentation. Ignores: how the numbers were measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lab.metrics.summary import request_latencies
from lab.request import Request
from lab.sample.logprobs import TokenLogprobs


def request_record(request: Request, tokenizer: Any | None) -> dict[str, Any]:
    latencies = request_latencies(request)
    text = tokenizer.decode(request.output_token_ids) if tokenizer is not None else None
    return {"request_id": request.request_id, "prompt_len": request.num_prompt_tokens,
            "output_len": request.num_output_tokens, "output_token_ids": request.output_token_ids,
            "output_text": text, "finish_reason": request.status.value, "error": request.error, **latencies,
            **({"output_logprobs": [_logprobs_record(e) for e in request.output_logprobs]}
               if request.sampling_params.logprobs is not None else {}),
            **({"prompt_logprobs": [_logprobs_record(e) for e in request.prompt_logprobs or [None]]}
               if request.sampling_params.prompt_logprobs is not None else {})}


def _logprobs_record(entry: TokenLogprobs | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"logprob": entry.logprob, "rank": entry.rank, "top": [list(t) for t in entry.top]}


def write_results(run_dir: Path, results: dict[str, Any], requests: list[Request], tokenizer: Any | None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    with open(run_dir / "requests.jsonl", "w", encoding="utf-8") as f:
        for request in requests:
            f.write(json.dumps(request_record(request, tokenizer)) + "\n")


def format_table(results: dict[str, Any]) -> str:
    """A compact table in the spirit of vLLM's `bench serve` printout."""
    rows: list[tuple[str, str]] = [
        ("Engine", str(results.get("engine"))), ("Model", str(results.get("model_id"))),
        ("Successful requests", f"{results['completed']}"), ("Failed requests", f"{results['failed']}"),
        ("Benchmark duration (s)", f"{results['duration']:.2f}"),
        ("Total input tokens", f"{results['total_input_tokens']}"),
        ("Total generated tokens", f"{results['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{results['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{results['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{results['total_token_throughput']:.2f}"),
    ]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows.append((f"{title} mean / median / p99 (ms)",
                     f"{results[f'mean_{name}_ms']:.2f} / {results[f'median_{name}_ms']:.2f} / "
                     f"{results[f'p99_{name}_ms']:.2f}"))
    if "kv/prefix_cache_hit_rate" in results:   # NOTE: engines on the paged KV cache
        rows.append(("Prefix cache hit rate (%)", f"{100 * results['kv/prefix_cache_hit_rate']:.1f}"))
    rows.append(("Peak memory, CPU RSS (MB)", f"{results['peak_memory_mb']:.0f}"))
    for key in ("peak_mem_allocated_mb", "peak_mem_reserved_mb"):
        if key in results:
            rows.append((f"Peak CUDA memory, {key.split('_')[2]} (MB)", f"{results[key]:.0f}"))
    spec = speculative_rows(results)
    width = max(len(k) for k, _ in rows + spec)
    bar = "=" * (width + 28)
    lines = [bar, "Serving Benchmark Result".center(len(bar)), bar]
    lines += [f"{k:<{width}}  {v:>26}" for k, v in rows]
    if spec:
        lines.append(" Speculative Decoding ".center(len(bar), "-"))
        lines += [f"{k:<{width}}  {v:>26}" for k, v in spec]
    return "\n".join(lines + [bar])


def speculative_rows(results: dict[str, Any]) -> list[tuple[str, str]]:
    """What vLLM logs as its SpecDecoding metrics (drafts, acceptance rate and length, per position), with the
    draft / verify time split and, when the run measured it, the speedup over its baseline; [] without speculation."""
    if "spec_decode_num_drafts" not in results:
        return []
    per_position = results.get("spec_decode_per_position_acceptance_rates", [])
    rows = [("Drafts / draft tokens / accepted", f"{results['spec_decode_num_drafts']} / "
             f"{results['spec_decode_draft_tokens']} / {results['spec_decode_accepted_tokens']}"),
            ("Acceptance rate (%)", f"{results['spec_decode_acceptance_rate']:.1f}"),
            ("Acceptance length (tau)", f"{results['spec_decode_acceptance_length']:.2f}")]
    if per_position:
        rows.append(("Per-position acceptance (%)", ", ".join(f"{100 * rate:.0f}" for rate in per_position)))
    if "spec/draft_s" in results:
        rows.append(("Draft / verify time (s)", f"{results['spec/draft_s']:.2f} / {results['spec/verify_s']:.2f}"))
    if "spec/goodput_kept_draft_share" in results:   # NOTE: engine.draft_policy=goodput
        rows.append(("Goodput: drafts verified (%)", f"{100 * results['spec/goodput_kept_draft_share']:.1f}"))
        rows.append(("Goodput: steps not drafted (%)", f"{100 * results.get('spec/goodput_paused_share', 0.0):.1f}"))
        if "spec/fallback_drafts" in results:   # NOTE: a cascade: the steps drafted by its primary alone
            rows.append(("Goodput: steps without the fallback (%)",
                         f"{100 * results.get('spec/goodput_fallback_paused_share', 0.0):.1f}"))
        if results.get("spec/goodput_calibrated_max_rows"):
            rows.append(("Goodput: calibrated up to (rows)", f"{results['spec/goodput_calibrated_max_rows']}"))
        prefix = "spec/goodput_step_cost/"
        costs = sorted((int(k[len(prefix):].split("_")[0]), v) for k, v in results.items() if k.startswith(prefix))
        if costs:
            rows.append(("Goodput: step cost by rows", ", ".join(f"{n}: {cost:.2f}" for n, cost in costs[:3])))
    if "spec/speedup_tpot" in results:
        same = "same output" if results.get("spec/same_output_as_baseline") else "OUTPUT DIFFERS"
        turns = f", turns by {results['spec/speedup_turns']}" if "spec/speedup_turns" in results else ""
        rows.append((f"TPOT speedup over {results.get('spec/speedup_baseline', 'engine')}",
                     f"{results['spec/speedup_tpot']:.3f}x ({same}{turns})"))
    return rows
