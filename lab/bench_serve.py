"""`lab-bench-serve` / `python -m lab.bench_serve`: benchmark any OpenAI-compatible endpoint (ours, vLLM,
SGLang, TensorRT-LLM's trtllm-serve, llama.cpp's server) with a workload group's prompts and arrivals:
  lab-bench-serve endpoint=http://127.0.0.1:8000/v1 workload=sharegpt workload.request_rate=4
Writes results.json with vLLM's `bench serve` field names into the Hydra run directory.

The only module of the benchmark client that touches DictConfig (conf/bench_serve.yaml).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

import hydra
from omegaconf import DictConfig, OmegaConf

from lab.bench.client import Api, BenchRequest
from lab.config_check import check_call
from lab.bench.driver import Target, benchmark
from lab.bench.metrics import calculate, detailed
from lab.errors import LabError
from lab.hydra_job import console_script, run_job
from lab.metrics.report import speculative_rows
from lab.metrics.summary import check_slo, percentile_word
from lab.request import Request
from lab.run import build_requests, split_workload

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
PromptFormat = Literal["auto", "text", "token_ids"]
PROMPT_FORMATS: tuple[str, ...] = get_args(PromptFormat)
# NOTE: not the bench's own settings: composed groups (checked where they are built) and experiment=serving's
# `serving` (the servers experiments/serving.py starts; a plain run against an endpoint ignores it)
CONFIG_GROUPS = ("workload", "sampling", "hydra", "serving")

log = logging.getLogger("lab.bench_serve")   # NOTE: the job's record in run.log


# NOTE: vLLM's printed sections: (result key, label, header)
LATENCY_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
                    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                    ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"),
                    ("client_queue_time", "Client Queue Time", "Client-side Queueing"),
                    ("e2el_including_client_queue", "E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"))


@dataclass(frozen=True)
class BenchOptions:
    """conf/bench_serve.yaml's own settings (beside its workload and sampling groups), typed: checked against these
    annotations before anything runs (lab/config_check.py), so `api=grpc` fails before a request is sent."""

    endpoint: str
    api: Api
    model: str | None
    tokenizer: str
    prompt_format: PromptFormat
    label: str | None
    seed: int
    percentiles: list[float]
    slo: dict[str, Any]
    save_detailed: bool
    extra_body: dict[str, Any]
    ready_timeout_s: float
    warmup_max_tokens: int | None
    metrics_url: str | None
    request_timeout_s: float
    print_table: bool

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> "BenchOptions":
        values = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in CONFIG_GROUPS}
        check_call(cls, values, "")
        check_slo(values["slo"], "slo")
        if values["warmup_max_tokens"] is not None and values["warmup_max_tokens"] < 1:
            raise LabError(f"warmup_max_tokens must be >= 1 or null, got {values['warmup_max_tokens']}",
                           "use null (each warm-up generates its request's length, as vLLM) or e.g. 4")
        return cls(**values)


@dataclass
class TokenizerOnly:
    """What build_requests needs from a runner, without loading any weights."""

    tokenizer: Any
    vocab_size: int


def load_tokenizer(name: str) -> Any:
    """`smollm2` (the bundled model's tokenizer, also `tiny`'s) or a local HF directory / cached hub id."""
    from transformers import AutoTokenizer

    if name in ("smollm2", "tiny"):
        from lab.models.sources import convert_smollm2, default_cache_dir

        return AutoTokenizer.from_pretrained(convert_smollm2(default_cache_dir()))
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except OSError as exc:
        raise LabError(f"tokenizer {name!r} is neither `smollm2` nor a local/cached HF tokenizer ({exc})",
                       "set tokenizer=smollm2 or tokenizer=/path/to/hf/model") from None


def to_bench_request(request: Request, tokenizer: Any, prompt_format: str) -> BenchRequest:
    """The workload's text when it has one (auto, text), else its token ids (auto, token_ids) or their decoding."""
    if prompt_format not in PROMPT_FORMATS:
        raise LabError(f"prompt_format={prompt_format!r} is unknown", f"use one of {', '.join(PROMPT_FORMATS)}")
    prompt: str | list[int]
    if prompt_format == "token_ids" or (prompt_format == "auto" and request.prompt is None):
        prompt = list(request.prompt_token_ids)
    else:
        prompt = request.prompt if request.prompt is not None else tokenizer.decode(request.prompt_token_ids)
    p = request.sampling_params
    return BenchRequest(prompt, request.num_prompt_tokens, p.max_tokens, p.ignore_eos, p.temperature, p.top_p,
                        p.top_k, p.seed, request.request_id)


def result_table(result: dict[str, Any], percentiles: list[float]) -> str:
    """vLLM's summary block."""
    rows = [("Successful requests:", result["completed"]), ("Failed requests:", result["failed"]),
            ("Benchmark duration (s):", result["duration"]), ("Total input tokens:", result["total_input_tokens"]),
            ("Total generated tokens:", result["total_output_tokens"]),
            ("Request throughput (req/s):", result["request_throughput"]),
            ("Output token throughput (tok/s):", result["output_throughput"]),
            ("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
            ("Peak concurrent requests:", result["max_concurrent_requests"]),
            ("Total token throughput (tok/s):", result["total_token_throughput"])]
    if "prefix_cache_hit_rate" in result:   # NOTE: from the server's /metrics, where it exports them
        rows.append(("Prefix cache hit rate (%):", 100.0 * result["prefix_cache_hit_rate"]))
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    for label, value in rows:
        lines.append(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")
    for name, label, header in LATENCY_SECTIONS:
        if f"mean_{name}_ms" not in result:
            continue   # NOTE: the client-queue ones exist under a max_concurrency only
        lines.append("{:-^50}".format(header))
        for stat in ("mean", "median", *[f"p{percentile_word(p)}" for p in percentiles]):
            lines.append(f"{stat.capitalize() + ' ' + label + ' (ms):':<40} {result[f'{stat}_{name}_ms']:<10.2f}")
    spec = speculative_rows(result)   # NOTE: from the server's /metrics, when it speculates and exports them
    if spec:
        lines.append("{:-^50}".format("Speculative Decoding"))
        for label, value in spec:
            lines.append(f"{label + ':':<40} {value:<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def bench(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    options = BenchOptions.from_cfg(cfg)
    split_workload(cfg)   # NOTE: checks the workload's settings too, before the tokenizer loads
    tokenizer = load_tokenizer(options.tokenizer)
    requests, warmups, arrival, workload_name = build_requests(cfg, TokenizerOnly(tokenizer, len(tokenizer)))
    bench_requests = [to_bench_request(r, tokenizer, options.prompt_format) for r in requests]
    target = Target(options.endpoint, options.api, options.model, options.extra_body,
                    float(options.request_timeout_s), options.metrics_url)
    offsets = [r.arrival_time for r in requests]
    measured = asyncio.run(benchmark(target, bench_requests, offsets, arrival.max_concurrency, len(warmups),
                                     float(options.ready_timeout_s), options.warmup_max_tokens))
    outputs, duration, model = measured.outputs, measured.duration, measured.model
    percentiles = [float(p) for p in options.percentiles]
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": f"openai-{options.api}",
        "backend": f"openai-{options.api}", "label": options.label, "model_id": model,
        "tokenizer_id": options.tokenizer, "endpoint": options.endpoint, "workload": workload_name,
        "num_prompts": len(requests),
        "request_rate": arrival.request_rate, "burstiness": arrival.burstiness,
        "max_concurrency": arrival.max_concurrency, "num_warmups": len(warmups),
        **calculate(outputs, duration, tokenizer, tuple(percentiles), options.slo, arrival.max_concurrency,
                    arrival.request_rate),
        # NOTE: as vLLM's, only where the window verified drafts (a speculative server that drafted nothing has none)
        **(measured.spec.summary() if measured.spec is not None and measured.spec.num_draft_tokens else {}),
        **(measured.prefix_cache.summary() if measured.prefix_cache is not None else {})}
    if options.save_detailed:
        result.update(detailed(outputs, tokenizer))
    errors = [o.error for o in outputs if not o.success]
    result["first_errors"] = errors[:5]
    run_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: inf is not JSON; vLLM writes it as the string "inf".
    (run_dir / "results.json").write_text(json.dumps(
        {k: (str(v) if isinstance(v, float) and v == float("inf") else v) for k, v in result.items()}, indent=2))
    table = result_table(result, percentiles)
    log.info(f"results ({run_dir / 'results.json'}):\n{table}")
    if options.print_table:
        print(table)
        print(f"results: {run_dir / 'results.json'}")
    return result


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_serve")
def main(cfg: DictConfig) -> float | None:
    return run_job(lambda run_dir: bench(cfg, run_dir))


cli = console_script(main)   # NOTE: the `lab-bench-serve` console script

if __name__ == "__main__":
    cli()
