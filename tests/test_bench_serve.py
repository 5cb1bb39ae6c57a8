"""The serving benchmark client: vLLM's metric definitions on hand-made timings, and end to end against
our server in-process (127.0.0.1, tiny model): counts, chunk timings, closed-loop concurrency, failures,
and the Hydra entry writing results.json with vLLM's field names."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
from aiohttp import web
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from lab.bench.client import BenchRequest, StreamOutput, send
from lab.bench.driver import Target, benchmark
from lab.bench.server_metrics import ServerCounters, parse_server_counters, parse_spec_counters
from lab.bench.metrics import calculate, peak_concurrency
from lab.bench_serve import bench
from lab.engines.ar import AREngine
from lab.kv_cache.counters import PrefixCacheCounters
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.serve.app import OpenAIServer, ServeOptions, create_app
from lab.serve.engine_loop import ThreadEngineClient
from lab.serve.server import ServerThread
from lab.spec.counters import SpecCounters
from tests.conftest import CONF_DIR, compose_cfg

VLLM_FIELDS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
               "max_output_tokens_per_s", "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms",
               "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
               "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
               "std_e2el_ms", "p99_e2el_ms"]


def compose_cfg_bench(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="bench_serve", overrides=overrides)


def test_metrics_follow_vllm_definitions() -> None:
    # request a: sent at 0, chunks at 0.1, 0.3, 0.6 (3 tokens); b: sent at 0.5, one token at 0.7;
    # c: failed (not timed, counted as failed)
    a = StreamOutput(True, "abc", prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.2, 0.3], latency=0.6, start_time=0.0)
    b = StreamOutput(True, "d", prompt_len=4, output_tokens=1, ttft=0.2, itl=[], latency=0.2, start_time=0.5)
    c = StreamOutput(False, error="HTTP 429")
    result = calculate([a, b, c], duration=2.0, slo={"ttft_ms": 150.0})
    assert (result["completed"], result["failed"]) == (2, 1)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (14, 4)
    assert result["output_throughput"] == pytest.approx(2.0) and result["request_throughput"] == pytest.approx(1.0)
    assert result["mean_tpot_ms"] == pytest.approx(250.0), "TPOT = (latency - ttft) / (tokens - 1), only a counts"
    assert result["mean_itl_ms"] == pytest.approx(250.0) and result["max_itl_ms"] == pytest.approx(300.0)
    assert result["mean_ttft_ms"] == pytest.approx(150.0) and result["median_e2el_ms"] == pytest.approx(400.0)
    assert result["request_goodput"] == pytest.approx(0.5), "only a meets TTFT <= 150 ms"
    assert result["max_concurrent_requests"] == 2 and result["max_output_tokens_per_s"] == 4.0


def test_peak_concurrency_treats_intervals_as_half_open() -> None:
    back_to_back = [StreamOutput(True, start_time=0.0, latency=1.0), StreamOutput(True, start_time=1.0, latency=1.0)]
    assert peak_concurrency(back_to_back) == 1


@pytest.fixture(scope="module")
def server_url(tiny_text_runner: ModelRunner) -> Iterator[str]:
    engine = instantiate(compose_cfg(["model=tiny", "engine=cb_paged"]).engine, runner=tiny_text_runner, seed=0)
    server = OpenAIServer(ThreadEngineClient(engine), tiny_text_runner.tokenizer, tiny_text_runner.vocab_size,
                          ServeOptions("tiny", max_queue_len=256))
    with ServerThread(create_app(server)) as thread:
        yield thread.url + "/v1"


def requests_of(lengths: list[tuple[int, int]]) -> list[BenchRequest]:
    return [BenchRequest([100 + i + j for j in range(n_in)], n_in, n_out) for i, (n_in, n_out) in enumerate(lengths)]


def test_end_to_end_counts_tokens_and_times_every_chunk(server_url: str) -> None:
    lengths = [(8, 5), (16, 9), (4, 1), (12, 7), (20, 3), (6, 11)]
    run = asyncio.run(benchmark(Target(server_url), requests_of(lengths), [0.0, 0.05, 0.1, 0.1, 0.2, 0.3],
                                max_concurrency=2, ready_timeout_s=10))
    outputs, duration = run.outputs, run.duration
    assert run.model == "tiny" and run.spec is None, "cb_paged does not speculate: no spec_decode counters"
    assert all(o.success for o in outputs), [o.error for o in outputs]
    assert [o.output_tokens for o in outputs] == [n for _, n in lengths]
    assert [o.prompt_len for o in outputs] == [n for n, _ in lengths]
    # NOTE: our server sends one chunk per token, so every output token after the first is one ITL gap
    assert [len(o.itl) for o in outputs] == [n - 1 for _, n in lengths]
    assert all(0 < o.ttft <= o.latency <= duration for o in outputs)
    result = calculate(outputs, duration)
    assert result["max_concurrent_requests"] <= 2, "closed loop exceeded max_concurrency"
    assert result["total_output_tokens"] == sum(n for _, n in lengths)


def test_the_servers_prefix_cache_hits_are_read_over_the_measured_requests(server_url: str) -> None:
    """cb_paged exports vLLM's prefix_cache_queries / _hits counters; the run's window counts the measured
    requests' prompt tokens, and a prompt seen before (the warm-up copies the first request) is served from the
    cache but for its last block's worth."""
    prompt = [300 + j for j in range(40)]
    requests = [BenchRequest(prompt, 40, 2), BenchRequest([400 + j for j in range(24)], 24, 2)]
    run = asyncio.run(benchmark(Target(server_url), requests, [0.0, 0.0], max_concurrency=1, num_warmups=1,
                                ready_timeout_s=10))
    assert run.prefix_cache is not None and run.prefix_cache.queries == 64, run.prefix_cache
    assert 24 <= run.prefix_cache.hits < 40, "the first prompt's full blocks but never its last token"
    assert run.prefix_cache.summary()["prefix_cache_hit_rate"] == run.prefix_cache.hits / 64


def test_warmups_can_stop_after_a_few_tokens(server_url: str) -> None:
    """warmup_max_tokens: the probe and each warm-up generate at most that many tokens; the measured requests
    their full length (the server's generation counter tells)."""
    def generated() -> float:
        text = httpx.get(server_url.removesuffix("/v1") + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("lab:generation_tokens_total"))

    lengths = [(8, 9), (6, 7), (5, 8)]
    before = generated()
    run = asyncio.run(benchmark(Target(server_url), requests_of(lengths), [0.0] * 3, num_warmups=2,
                                ready_timeout_s=10, warmup_max_tokens=3))
    assert [o.output_tokens for o in run.outputs] == [9, 7, 8]
    # NOTE: the server counts a request once its stream has closed, which may be just after the client saw [DONE]
    deadline = time.monotonic() + 5
    while generated() - before < 24 + 3 + 2 * 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert generated() - before == 24 + 3 + 2 * 3, "measured 24, probe 3, two warm-ups of 3"


def test_client_queue_time_is_reported_under_a_client_side_max_concurrency() -> None:
    """vLLM's: a request held back for a concurrency slot waited client_queue_time before it was sent; at a
    finite rate the E2EL a user sees includes that wait."""
    a = StreamOutput(True, "a", prompt_len=4, output_tokens=2, ttft=0.1, itl=[0.1], latency=0.2, start_time=0.0)
    b = StreamOutput(True, "b", prompt_len=4, output_tokens=2, ttft=0.1, itl=[0.1], latency=0.2, start_time=0.2,
                     client_queue_time=0.15)
    assert "mean_client_queue_time_ms" not in calculate([a, b], duration=1.0)
    closed = calculate([a, b], duration=1.0, max_concurrency=1)
    assert closed["mean_client_queue_time_ms"] == pytest.approx(75.0) and "mean_e2el_including_client_queue_ms" not in closed
    paced = calculate([a, b], duration=1.0, max_concurrency=1, request_rate=4.0)
    assert paced["max_e2el_including_client_queue_ms"] == pytest.approx(350.0)


def test_failed_requests_are_counted_with_their_error(server_url: str) -> None:
    requests = requests_of([(4, 2), (4, 5000), (4, 2)])   # the second exceeds the context: HTTP 400
    run = asyncio.run(benchmark(Target(server_url), requests, [0.0] * 3, ready_timeout_s=10))
    outputs, duration = run.outputs, run.duration
    assert [o.success for o in outputs] == [True, False, True]
    assert outputs[1].error.startswith("HTTP 400") and "context" in outputs[1].error
    assert calculate(outputs, duration)["failed"] == 1


def test_a_stream_message_that_is_not_an_object_fails_its_request_not_the_run() -> None:
    async def send_to_a_broken_server() -> StreamOutput:
        async def completions(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"data: [1, 2]\n\n")
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                return await send(session, f"http://127.0.0.1:{port}/v1/completions", {}, "completions", 3)
        finally:
            await runner.cleanup()

    output = asyncio.run(send_to_a_broken_server())
    assert not output.success and "not a JSON object" in output.error, output


def test_chat_api_streams_text(server_url: str) -> None:
    requests = [BenchRequest("Tell me a story about a cat.", 8, 6), BenchRequest("Hello!", 3, 4)]
    run = asyncio.run(benchmark(Target(server_url, api="chat"), requests, [0.0, 0.0], ready_timeout_s=10))
    outputs = run.outputs
    assert all(o.success and o.generated_text for o in outputs), [o.error for o in outputs]
    assert [o.output_tokens for o in outputs] == [6, 4]
    assert outputs[0].prompt_len > 8, "the server's usage (chat template included) replaces the local count"


def test_hydra_entry_writes_vllm_result_fields(server_url: str, tmp_path: Path) -> None:
    cfg = compose_cfg_bench([f"endpoint={server_url}", "workload.num_prompts=6", "workload.input_len=16",
                             "workload.output_len=4", "workload.request_rate=50", "workload.num_warmups=1",
                             "print_table=false", "save_detailed=true"])
    result = bench(cfg, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    missing = [k for k in VLLM_FIELDS if k not in saved]
    assert not missing, f"results.json lacks vLLM fields {missing}"
    assert (saved["completed"], saved["total_input_tokens"], saved["total_output_tokens"]) == (6, 96, 24)
    assert saved["request_rate"] == 50 and len(saved["ttfts"]) == 6 and result["num_warmups"] == 1


VLLM_EXPOSITION = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 18.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
"""


def test_a_sweep_against_a_dead_endpoint_records_each_failure_and_exits_1(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "lab.bench_serve", "-m", "endpoint=http://127.0.0.1:9/v1",
                           "ready_timeout_s=1", "workload.num_prompts=1,2", f"hydra.sweep.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [json.loads(p.read_text())["error"] for p in sorted(tmp_path.rglob("error.json"))]
    assert len(errors) == 2 and all("is not ready after 1 s" in e for e in errors)   # the second job still ran
    assert "2 of 2 jobs failed" in proc.stderr


def test_spec_counters_are_read_from_any_servers_prometheus_text() -> None:
    counts = parse_spec_counters(VLLM_EXPOSITION)
    assert counts == SpecCounters(15, 30, 18, (9, 6, 3)), "summed over engines, positions in order, _created skipped"
    assert parse_spec_counters(VLLM_EXPOSITION.replace("vllm:", "lab:")) == counts
    assert parse_spec_counters('vllm:num_requests_running{model_name="m"} 0.0\n') is None, "no speculation"
    assert parse_spec_counters("<html>not found</html>") is None
    prefix = ('# TYPE vllm:prefix_cache_queries_total counter\n'
              'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
              'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 60.0\n'
              '# TYPE vllm:prefix_cache_hits_total counter\n'
              'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0\n')
    both = parse_server_counters(VLLM_EXPOSITION + prefix)
    assert both == ServerCounters(counts, PrefixCacheCounters(160, 40))
    assert parse_server_counters(prefix).spec is None and parse_server_counters(VLLM_EXPOSITION).prefix_cache is None
    window = both - ServerCounters(SpecCounters(5, 10, 8, (4, 3, 1)), PrefixCacheCounters(60, 0))
    assert window.prefix_cache.summary() == {"prefix_cache_queries": 100, "prefix_cache_hits": 40,
                                             "prefix_cache_hit_rate": 0.4}
    assert (both - ServerCounters()).spec is None, "a family missing from either snapshot has no window"
    window = counts - SpecCounters(5, 10, 8, (4, 3, 1))
    assert window.summary() == {"spec_decode_num_drafts": 10, "spec_decode_draft_tokens": 20,
                                "spec_decode_accepted_tokens": 10, "spec_decode_acceptance_rate": 50.0,
                                "spec_decode_acceptance_length": 2.0,
                                "spec_decode_per_position_acceptance_rates": [0.5, 0.3, 0.2]}
    assert Target("http://h:8000/v1/").prometheus_url == "http://h:8000/metrics"
    assert Target("http://h:8000/v1", metrics_url="http://h:9000/m").prometheus_url == "http://h:9000/m"


def test_a_speculating_server_exports_vllms_counters_and_the_bench_reports_them(
        tiny_text_runner: ModelRunner, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """engine=speculative behind the server (drafting with the target itself: drafts get accepted), two streams
    at a time: the answers are AR's, /metrics carries lab:spec_decode_*, and lab-bench-serve reports the measured
    requests' acceptance (warm-ups and the probe excluded) in results.json and its table."""
    engine = instantiate(compose_cfg(["model=tiny", "engine=speculative", "engine/proposer=draft_model",
                                      "engine.num_spec_tokens=3"]).engine, runner=tiny_text_runner, seed=0)
    server = OpenAIServer(ThreadEngineClient(engine), tiny_text_runner.tokenizer, tiny_text_runner.vocab_size,
                          ServeOptions("tiny", max_queue_len=64))
    requests = requests_of([(8, 12), (5, 10), (11, 12), (6, 9)])
    with ServerThread(create_app(server)) as thread:
        run = asyncio.run(benchmark(Target(thread.url + "/v1"), requests, [0.0] * 4, max_concurrency=2,
                                    num_warmups=1, ready_timeout_s=10))
        text = httpx.get(thread.url + "/metrics").text
        engine_counts = engine.spec_counters()
        cfg = compose_cfg_bench([f"endpoint={thread.url}/v1", "workload.num_prompts=3", "workload.input_len=8",
                                 "workload.output_len=6", "print_table=true"])
        saved = bench(cfg, tmp_path)
    printed = capsys.readouterr().out
    assert saved["spec_decode_num_drafts"] > 0 and saved["spec_decode_acceptance_length"] > 1.0
    assert json.loads((tmp_path / "results.json").read_text())["spec_decode_draft_tokens"] > 0
    assert "Speculative Decoding" in printed and "Acceptance length (tau):" in printed
    assert all(o.success for o in run.outputs), [o.error for o in run.outputs]
    expected = AREngine(tiny_text_runner).run([Request(f"r{i}", list(r.prompt), SamplingParams(
        max_tokens=r.output_len, ignore_eos=True)) for i, r in enumerate(requests)]).requests
    assert [o.generated_text for o in run.outputs] == \
        [tiny_text_runner.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in expected]
    for name in ("lab:spec_decode_num_drafts_total", "lab:spec_decode_num_draft_tokens_total",
                 "lab:spec_decode_num_accepted_tokens_total", 'lab:spec_decode_num_accepted_tokens_per_pos_total'
                 '{model_name="tiny",position="2"}'):
        assert name in text, f"{name} missing from /metrics"
    assert parse_spec_counters(text) == engine_counts, "/metrics is the engine's own cumulative counts"
    spec = run.spec
    assert spec is not None and 0 < spec.num_drafts < engine_counts.num_drafts, "the probe and warm-up excluded"
    assert 0 < spec.num_accepted_tokens == sum(spec.accepted_per_position) <= spec.num_draft_tokens
    assert len(spec.accepted_per_position) == 3


def test_serving_experiment_and_serve_configs_compose() -> None:
    cfg = compose_cfg_bench(["+experiment=serving"])
    assert set(cfg.serving.servers) == {"replicas1", "replicas2", "tp2"} and cfg.workload.num_warmups == 2
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        serve = compose(config_name="serve", overrides=["model=tiny", "serve.replicas=2"])
    assert serve.engine.name == "cb_paged" and serve.serve.host == "127.0.0.1" and serve.serve.replicas == 2
    spec = compose_cfg_bench(["+experiment=serving_spec"])
    assert {name: server.engine for name, server in spec.serving.servers.items()} == \
        {"no_spec": "cb_paged", "suffix": "speculative", "dflash": "dflash", "dflash_adaptive": "dflash_adaptive"} and spec.api == "chat"
