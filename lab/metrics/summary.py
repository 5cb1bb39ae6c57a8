"""Summary metrics with vLLM's serving-benchmark definitions and field names.

TTFT = first token - arrival; E2EL = last token - arrival; TPOT = (E2EL - TTFT) / (output_len - 1) per
request with more than one token; ITL = every gap between consecutive tokens, pooled over requests.
Throughputs divide by the run's duration. Owns: numbers. Ignores: engines.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lab.request import Request, RequestStatus

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def request_latencies(request: Request) -> dict[str, Any]:
    """Per-request timings in ms (None where undefined)."""
    times = request.token_times
    if not times:
        return {"ttft_ms": None, "tpot_ms": None, "itl_ms": [], "e2el_ms": None}
    ttft = (times[0] - request.arrival_time) * 1000
    e2el = (times[-1] - request.arrival_time) * 1000
    itl = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    tpot = (e2el - ttft) / (len(times) - 1) if len(times) > 1 else None
    return {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl, "e2el_ms": e2el}


def _stats(name: str, values: list[float]) -> dict[str, float]:
    data = np.asarray(values, dtype=np.float64) if values else np.zeros(1)
    out = {f"mean_{name}_ms": float(data.mean()), f"median_{name}_ms": float(np.median(data)),
           f"std_{name}_ms": float(data.std()), f"max_{name}_ms": float(data.max())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(data, p)) for p in PERCENTILES})
    return out


def summarize(requests: list[Request], duration: float) -> dict[str, Any]:
    """vLLM's `bench serve` result fields (failed requests are counted, not timed)."""
    completed = [r for r in requests if r.is_finished and r.status is not RequestStatus.FINISHED_ABORTED]
    per_request = [request_latencies(r) for r in completed]
    total_input = sum(r.num_prompt_tokens for r in completed)
    total_output = sum(r.num_output_tokens for r in completed)
    duration = max(duration, 1e-9)
    result: dict[str, Any] = {
        "num_prompts": len(requests), "completed": len(completed), "failed": len(requests) - len(completed),
        "duration": duration, "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    series = {
        "ttft": [m["ttft_ms"] for m in per_request],
        "tpot": [m["tpot_ms"] for m in per_request if m["tpot_ms"] is not None],
        "itl": [x for m in per_request for x in m["itl_ms"]],
        "e2el": [m["e2el_ms"] for m in per_request],
    }
    for name in LATENCY_METRICS:
        result.update(_stats(name, series[name]))
    return result
