"""vLLM's `bench serve` metrics from client-side stream timings, with its result field names.

Per completed request: output_len = usage.completion_tokens (else the tokenizer's count of the text);
TPOT = (latency - TTFT) / (output_len - 1) when output_len > 1; ITLs pooled over requests; E2EL = latency.
Duration is the whole run (first send to last answer); goodput counts requests meeting every SLO (a
one-token request has TPOT 0); max_output_tokens_per_s is the fullest 1-s bucket of token times;
max_concurrent_requests the peak of overlapping [start, end) intervals.
Owns: numbers. Ignores: HTTP. The percentile statistics are lab/metrics/summary.py's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lab.bench.client import StreamOutput
from lab.metrics.summary import DEFAULT_PERCENTILES, check_slo, latency_stats, meets_slo


def output_len(output: StreamOutput, tokenizer: Any | None) -> int:
    if output.output_tokens:
        return int(output.output_tokens)
    if tokenizer is None:
        return 1
    # NOTE: vLLM's fallback for servers without usage; several tokens may share one chunk, so not len(itl).
    return len(tokenizer(output.generated_text, add_special_tokens=False).input_ids)


def token_times(output: StreamOutput) -> list[float]:
    times = [output.start_time + output.ttft]
    for gap in output.itl:
        times.append(times[-1] + gap)
    return times


def peak_output_rate(outputs: list[StreamOutput]) -> float:
    if not outputs:
        return 0.0
    origin = min(o.start_time for o in outputs)
    bins = [int(t - origin) for o in outputs for t in token_times(o)]
    return float(np.bincount(bins).max()) if bins else 0.0


def peak_concurrency(outputs: list[StreamOutput]) -> int:
    # NOTE: an end sorts before a start at the same instant (half-open intervals), as in vLLM.
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs])
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def calculate(outputs: list[StreamOutput], duration: float, tokenizer: Any | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
              slo: dict[str, float | None] | None = None, max_concurrency: int | None = None,
              request_rate: float = math.inf) -> dict[str, Any]:
    """The result fields of one run, in vLLM's names (per-request lists are added by `detailed`). Under a
    client-side max_concurrency, vLLM's client queue time too (sent late for want of a slot) and, at a finite
    rate, the E2EL a user would see including it."""
    completed = [o for o in outputs if o.success]
    lens = [output_len(o, tokenizer) for o in completed]
    per_request = []
    for o, n in zip(completed, lens):
        tpot = (o.latency - o.ttft) / (n - 1) * 1000 if n > 1 else None
        per_request.append({"ttft_ms": o.ttft * 1000, "tpot_ms": tpot, "e2el_ms": o.latency * 1000})
    slo = check_slo(slo, "slo")
    total_input = sum(o.prompt_len for o in completed)
    total_output = sum(lens)
    duration = max(duration, 1e-9)
    result: dict[str, Any] = {
        "duration": duration, "completed": len(completed), "failed": len(outputs) - len(completed),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration,
        "request_goodput": sum(meets_slo(m, slo) for m in per_request) / duration if slo else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_output_rate(completed),
        "max_concurrent_requests": peak_concurrency(completed),
    }
    series = {"ttft": [m["ttft_ms"] for m in per_request],
              "tpot": [m["tpot_ms"] for m in per_request if m["tpot_ms"] is not None],
              "itl": [gap * 1000 for o in completed for gap in o.itl],
              "e2el": [m["e2el_ms"] for m in per_request]}
    if max_concurrency is not None:
        series["client_queue_time"] = [o.client_queue_time * 1000 for o in completed]
        if not math.isinf(request_rate):
            series["e2el_including_client_queue"] = [(o.latency + o.client_queue_time) * 1000 for o in completed]
    for name, values in series.items():
        result.update(latency_stats(name, values, percentiles))
    return result


def detailed(outputs: list[StreamOutput], tokenizer: Any | None = None) -> dict[str, list[Any]]:
    """vLLM's per-request lists (seconds), kept with save_detailed."""
    return {"input_lens": [o.prompt_len for o in outputs],
            "output_lens": [output_len(o, tokenizer) if o.success else 0 for o in outputs],
            "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
            "latencies": [o.latency for o in outputs], "start_times": [o.start_time for o in outputs],
            "queue_times": [o.client_queue_time for o in outputs],
            "generated_texts": [o.generated_text for o in outputs], "errors": [o.error for o in outputs]}
