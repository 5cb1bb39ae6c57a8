"""Summary metrics with vLLM's serving-benchmark definitions and field names.

TTFT = first token - arrival (the time the request was sent); E2EL = last token - arrival;
TPOT = (E2EL - TTFT) / (output_len - 1) per request with more than one token; ITL = every gap between
consecutive steps that gave the request tokens, pooled over requests (vLLM's client times SSE chunks, and a
step's tokens, several under speculation, stream as one chunk); queue time = first scheduled - arrival.
Throughputs divide by the run's duration; goodput counts requests meeting every configured SLO.
Owns: numbers. Ignores: engines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from lab.errors import LabError
from lab.request import Request, RequestStatus

DEFAULT_PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "queue")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")   # vLLM's --goodput ttft:N tpot:N e2el:N, in ms


def check_slo(slo: Mapping[str, Any] | None, where: str = "metrics.slo") -> dict[str, float]:
    """The goodput SLOs that are set (null = not set), checked as vLLM checks --goodput: a known metric and a
    limit >= 0 in ms. A misspelt key would otherwise leave goodput equal to the request throughput."""
    limits: dict[str, float] = {}
    for key, limit in (slo or {}).items():
        if key not in SLO_KEYS:
            raise LabError(f"{where}.{key} is not a goodput SLO",
                           f"use {', '.join(f'{where}.{k}' for k in SLO_KEYS)} (limits in ms; null = not set)")
        if limit is None:
            continue
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0:
            raise LabError(f"{where}.{key} must be a number of ms >= 0 or null, got {limit!r}",
                           f"e.g. {where}.{key}=500")
        limits[key] = float(limit)
    return limits


def step_gaps(token_times: list[float]) -> list[float]:
    """The gaps between consecutive steps that gave a request tokens (seconds): tokens of one step share its
    timestamp, and their zero gaps are not latencies a user sees (vLLM's ITL, one per streamed chunk)."""
    return [later - earlier for earlier, later in zip(token_times, token_times[1:]) if later != earlier]


def request_latencies(request: Request) -> dict[str, Any]:
    """Per-request timings in ms (None where undefined)."""
    times = request.token_times
    queue = ((request.first_scheduled_time - request.arrival_time) * 1000
             if request.first_scheduled_time is not None else None)
    if not times:
        return {"ttft_ms": None, "tpot_ms": None, "itl_ms": [], "e2el_ms": None, "queue_ms": queue}
    ttft = (times[0] - request.arrival_time) * 1000
    e2el = (times[-1] - request.arrival_time) * 1000
    itl = [gap * 1000 for gap in step_gaps(times)]
    tpot = (e2el - ttft) / (len(times) - 1) if len(times) > 1 else None
    return {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl, "e2el_ms": e2el, "queue_ms": queue}


def percentile_word(p: float) -> str:
    """vLLM's key for a percentile: 99 -> "99", 99.9 -> "99.9" (never rounded: 99.99999 is not p100)."""
    return str(int(p)) if int(p) == p else str(p)


def latency_stats(name: str, values: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    data = np.asarray(values, dtype=np.float64) if values else np.zeros(1)
    out = {f"mean_{name}_ms": float(data.mean()), f"median_{name}_ms": float(np.median(data)),
           f"std_{name}_ms": float(data.std()), f"max_{name}_ms": float(data.max())}
    out.update({f"p{percentile_word(p)}_{name}_ms": float(np.percentile(data, p)) for p in percentiles})
    return out


def meets_slo(latencies: dict[str, Any], slo: dict[str, float | None]) -> bool:
    """vLLM's goodput: every configured SLO holds (a one-token request has TPOT 0)."""
    for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
        limit = slo.get(key)
        if limit is not None and (latencies[key] or 0.0) > limit:
            return False
    return True


def peak_output_rate(requests: list[Request], start: float) -> float:
    """vLLM's max_output_tokens_per_s: the most tokens produced in any one-second bin of the run."""
    times = [t for r in requests for t in r.token_times]
    if not times:
        return 0.0
    bins = np.floor((np.asarray(times) - start)).astype(np.int64)
    return float(np.bincount(bins - bins.min()).max())


def peak_concurrency(requests: list[Request]) -> int:
    """The most requests in flight (sent, not yet finished) at any instant."""
    events = sorted([(r.arrival_time, 1) for r in requests if r.finished_time is not None]
                    + [(r.finished_time, -1) for r in requests if r.finished_time is not None],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def summarize(requests: list[Request], duration: float, start: float | None = None,
              percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
              slo: dict[str, float | None] | None = None) -> dict[str, Any]:
    """vLLM's `bench serve` result fields (failed requests are counted, not timed)."""
    completed = [r for r in requests if r.is_finished and r.status is not RequestStatus.FINISHED_ABORTED]
    per_request = [request_latencies(r) for r in completed]
    total_input = sum(r.num_prompt_tokens for r in completed)
    total_output = sum(r.num_output_tokens for r in completed)
    duration = max(duration, 1e-9)
    slo = check_slo(slo)
    result: dict[str, Any] = {
        "num_prompts": len(requests), "completed": len(completed), "failed": len(requests) - len(completed),
        "duration": duration, "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(completed) / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "request_goodput": (sum(meets_slo(m, slo) for m in per_request) / duration) if slo else None,
        "max_output_tokens_per_s": peak_output_rate(completed, start if start is not None else 0.0),
        "max_concurrent_requests": peak_concurrency(completed),
    }
    series = {
        "ttft": [m["ttft_ms"] for m in per_request],
        "tpot": [m["tpot_ms"] for m in per_request if m["tpot_ms"] is not None],
        "itl": [x for m in per_request for x in m["itl_ms"]],
        "e2el": [m["e2el_ms"] for m in per_request],
        "queue": [m["queue_ms"] for m in per_request if m["queue_ms"] is not None],
    }
    for name in LATENCY_METRICS:
        result.update(latency_stats(name, series[name], percentiles))
    # what one user sees: its own output rate end to end, and its decode rate (1 / TPOT)
    user_e2e = [r.num_output_tokens / (m["e2el_ms"] / 1000) for r, m in zip(completed, per_request)
                if m["e2el_ms"]]
    user_decode = [1000 / t for t in series["tpot"] if t > 0]
    result["mean_user_output_tok_s"] = float(np.mean(user_e2e)) if user_e2e else 0.0
    result["mean_user_decode_tok_s"] = float(np.mean(user_decode)) if user_decode else 0.0
    result["median_user_decode_tok_s"] = float(np.median(user_decode)) if user_decode else 0.0
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def detailed_lists(requests: list[Request], tokenizer: Any | None = None) -> dict[str, list[Any]]:
    """vLLM's --save-detailed lists, one entry per request in request order."""
    lat = [request_latencies(r) for r in requests]
    return {"input_lens": [r.num_prompt_tokens for r in requests],
            "output_lens": [r.num_output_tokens for r in requests],
            # NOTE: seconds, as vLLM's detailed lists are
            "ttfts": [_seconds(m["ttft_ms"]) for m in lat], "itls": [[x / 1000 for x in m["itl_ms"]] for m in lat],
            "latencies": [_seconds(m["e2el_ms"]) for m in lat], "start_times": [r.arrival_time for r in requests],
            "generated_texts": [tokenizer.decode(r.output_token_ids) if tokenizer is not None else None
                                for r in requests],
            "errors": [r.error or "" for r in requests]}
