"""Metric definitions on hand-made timestamps (vLLM's), and arrival processes' rate and burstiness."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lab.errors import LabError
from lab.request import Request, RequestStatus, SamplingParams
from lab.metrics.summary import latency_stats, peak_concurrency, request_latencies, summarize
from lab.workloads.arrivals import ArrivalProcess


def _request(rid: str, arrival: float, token_times: list[float], scheduled: float | None = None,
             num_prompt_tokens: int = 4) -> Request:
    request = Request(rid, [1] * num_prompt_tokens, SamplingParams(max_tokens=max(1, len(token_times))))
    request.arrival_time, request.first_scheduled_time = arrival, scheduled if scheduled is not None else arrival
    for t in token_times:
        request.append_output_token(5, set(), now=t)
    if not request.is_finished:
        request.finish(RequestStatus.FINISHED_LENGTH)
    return request


def test_single_token_request_has_ttft_and_no_tpot() -> None:
    latencies = request_latencies(_request("a", 1.0, [1.25]))
    assert latencies["ttft_ms"] == pytest.approx(250.0)
    assert latencies["e2el_ms"] == pytest.approx(250.0)
    assert latencies["tpot_ms"] is None and latencies["itl_ms"] == []


def test_a_speculative_step_is_one_itl_gap_but_tpot_counts_its_tokens() -> None:
    """vLLM's client times SSE chunks, and a step's accepted tokens stream as one: three tokens from one
    verify step are one 100 ms gap, not 100, 0 and 0 ms."""
    latencies = request_latencies(_request("a", 0.0, [0.5, 0.6, 0.6, 0.6, 0.7]))
    assert latencies["itl_ms"] == pytest.approx([100.0, 100.0])
    assert latencies["tpot_ms"] == pytest.approx(200.0 / 4)


def test_tpot_excludes_first_token_and_itl_pools_every_gap() -> None:
    a = _request("a", 0.0, [0.5, 0.6, 0.8])   # ttft 500, gaps 100, 200, tpot 150
    b = _request("b", 0.0, [1.0, 1.4])        # ttft 1000, gap 400, tpot 400
    result = summarize([a, b], duration=2.0, start=0.0)
    assert result["mean_tpot_ms"] == pytest.approx((150 + 400) / 2)
    assert result["mean_itl_ms"] == pytest.approx((100 + 200 + 400) / 3)    # pooled over requests
    assert result["median_itl_ms"] == pytest.approx(200)
    assert result["mean_ttft_ms"] == pytest.approx(750)
    assert result["p99_e2el_ms"] == pytest.approx(np.percentile([800, 1400], 99))
    assert result["output_throughput"] == pytest.approx(5 / 2.0)
    assert result["total_token_throughput"] == pytest.approx((5 + 8) / 2.0)
    assert result["request_throughput"] == pytest.approx(1.0)


def test_percentile_keys_are_vllms() -> None:
    stats = latency_stats("ttft", [1.0, 2.0], (50, 99.9, 99.99999))
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "p99.99999_ttft_ms"} <= set(stats), sorted(stats)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = _request("fast", 0.0, [0.1, 0.15, 0.2])   # ttft 100, tpot 50
    slow_start = _request("slow", 0.0, [0.9, 0.95])   # ttft 900
    slow_decode = _request("slowdec", 0.0, [0.1, 0.6])  # tpot 500
    result = summarize([fast, slow_start, slow_decode], duration=1.0, slo={"ttft_ms": 200, "tpot_ms": 100})
    assert result["request_goodput"] == pytest.approx(1.0)
    assert summarize([fast], duration=1.0)["request_goodput"] is None  # no SLO set


def test_failed_requests_are_counted_not_timed() -> None:
    ok = _request("ok", 0.0, [0.1])
    bad = Request("bad", [1, 2], SamplingParams(max_tokens=3))
    bad.arrival_time = 0.0
    bad.finish(RequestStatus.FINISHED_ABORTED, "rejected: over budget")
    result = summarize([ok, bad], duration=1.0)
    assert (result["completed"], result["failed"]) == (1, 1)
    assert result["total_input_tokens"] == 4


def test_queue_time_peak_rate_and_concurrency() -> None:
    a = _request("a", 0.0, [0.5, 0.6], scheduled=0.3)
    b = _request("b", 0.2, [0.7, 1.5], scheduled=0.6)
    c = _request("c", 2.0, [2.1])
    result = summarize([a, b, c], duration=2.1, start=0.0)
    assert result["mean_queue_ms"] == pytest.approx((300 + 400 + 0) / 3)
    assert result["max_output_tokens_per_s"] == 3       # bin [0, 1) s holds 0.5, 0.6 and 0.7
    assert peak_concurrency([a, b, c]) == 2


def test_poisson_arrivals_have_the_requested_rate() -> None:
    offsets = ArrivalProcess(request_rate=10.0, burstiness=1.0, seed=0).offsets(4001)
    gaps = np.diff([0.0, *offsets])   # vLLM's: the first request waits a gap too
    assert offsets[-1] == pytest.approx(4001 / 10.0)   # ... and the last is sent at exactly N / rate
    assert gaps.mean() == pytest.approx(0.1, rel=0.05), f"mean gap {gaps.mean():.4f}s, wanted 0.1s"
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_gap_variability(burstiness: float) -> None:
    gaps = np.diff(ArrivalProcess(request_rate=5.0, burstiness=burstiness, seed=1).offsets(8001))
    assert gaps.mean() == pytest.approx(0.2, rel=0.06)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08), f"CV {cv:.3f} for burstiness {burstiness}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_seed_offers_the_same_load(seed: int) -> None:
    """vLLM's rescale: whatever the draws, N requests at rate r are all sent by N / r."""
    offsets = ArrivalProcess(request_rate=1.0, seed=seed).offsets(5)
    assert offsets[-1] == pytest.approx(5.0) and offsets == sorted(offsets) and offsets[0] > 0


def test_infinite_rate_sends_everything_at_t0_and_bad_rates_are_rejected() -> None:
    assert ArrivalProcess().offsets(5) == [0.0] * 5
    assert ArrivalProcess(request_rate=2.0, burstiness=math.inf).offsets(3) == pytest.approx([0.5, 1.0, 1.5])
    with pytest.raises(LabError, match="request_rate must be > 0"):
        ArrivalProcess(request_rate=0)
    with pytest.raises(LabError, match="burstiness must be > 0"):
        ArrivalProcess(request_rate=1, burstiness=0)
