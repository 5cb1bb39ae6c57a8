"""The benchmark run: wait for the endpoint, warm up, then send each request at its arrival offset (the
workload's ArrivalProcess: rate, burstiness) under an optional max_concurrency (closed loop: a request
waits for a free slot and its clock starts when it is sent, as in vLLM), and gather every stream.

Owns: timing of sends and the HTTP session. Ignores: what the requests contain and the statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from lab.bench.client import Api, BenchRequest, StreamOutput, build_payload, send
from lab.bench.server_metrics import read_server_counters
from lab.errors import LabError
from lab.kv_cache.counters import PrefixCacheCounters
from lab.spec.counters import SpecCounters


@dataclass
class Target:
    endpoint: str                         # base URL ending in /v1
    api: Api = "completions"
    model: str | None = None              # None: the first model /models lists
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 6 * 3600
    metrics_url: str | None = None        # Prometheus /metrics; None: the endpoint's server root + /metrics

    @property
    def url(self) -> str:
        return self.endpoint.rstrip("/") + ("/completions" if self.api == "completions" else "/chat/completions")

    @property
    def prometheus_url(self) -> str:
        if self.metrics_url:
            return self.metrics_url
        root = self.endpoint.rstrip("/")
        return root.removesuffix("/v1") + "/metrics"


@dataclass
class BenchmarkRun:
    outputs: list[StreamOutput]           # in request order
    duration: float                       # first send to last answer (s)
    model: str                            # the model the requests named
    spec: SpecCounters | None = None      # the server's speculative-decoding counts over the measured requests
    prefix_cache: PrefixCacheCounters | None = None   # ... and its prefix-cache lookups, where it exports them


async def wait_ready(session: aiohttp.ClientSession, target: Target, timeout_s: float) -> str:
    """Poll /models until the server answers; returns the model to use."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            async with session.get(target.endpoint.rstrip("/") + "/models") as response:
                if response.status == 200:
                    models = [m["id"] for m in (await response.json()).get("data", [])]
                    if target.model is not None:
                        return target.model
                    if models:
                        return models[0]
                    last_error = "the server lists no models"
                else:
                    last_error = f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise LabError(f"endpoint {target.endpoint} is not ready after {timeout_s:.0f} s ({last_error})",
                           "start the server first, or check `endpoint` (it should end in /v1)")
        await asyncio.sleep(0.5)


async def run_requests(session: aiohttp.ClientSession, target: Target, model: str, requests: list[BenchRequest],
                       offsets: list[float], max_concurrency: int | None) -> tuple[list[StreamOutput], float]:
    """Send every request at its offset; returns (outputs in request order, duration in seconds)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(request: BenchRequest) -> StreamOutput:
        arrived = time.perf_counter()
        async with semaphore:
            payload = build_payload(request, target.api, model, target.extra_body)
            output = await send(session, target.url, payload, target.api, request.prompt_len)
        output.client_queue_time = output.start_time - arrived
        return output

    start = time.perf_counter()
    tasks = []
    for request, offset in zip(requests, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start


async def benchmark(target: Target, requests: list[BenchRequest], offsets: list[float],
                    max_concurrency: int | None = None, num_warmups: int = 0,
                    ready_timeout_s: float = 120.0, warmup_max_tokens: int | None = None) -> BenchmarkRun:
    """One ready check, a probe (the first request), `num_warmups` unmeasured copies of the probe (as vLLM's:
    copies of other requests would reach the run with their prompts already in the prefix cache), then the run;
    the server's speculative-decoding and prefix-cache counters are read before and after the measured requests,
    where it exports them. warmup_max_tokens: the probe and the warm-ups
    generate at most that many tokens (None: their request's own length), so a server that learns from what it
    serves (suffix decoding's history) is not handed the measured answers in advance."""
    first = requests[0]
    unmeasured = (first if warmup_max_tokens is None
                  else dataclasses.replace(first, output_len=min(first.output_len, warmup_max_tokens)))
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await wait_ready(session, target, ready_timeout_s)
        probe = await send(session, target.url, build_payload(unmeasured, target.api, model, target.extra_body),
                           target.api, unmeasured.prompt_len)
        if not probe.success:
            raise LabError(f"the first test request to {target.url} failed: {probe.error}",
                           "check the endpoint, `api` (completions | chat) and `model`")
        if num_warmups:
            await run_requests(session, target, model, [unmeasured] * num_warmups, [0.0] * num_warmups,
                               max_concurrency)
        before = await read_server_counters(session, target.prometheus_url)
        outputs, duration = await run_requests(session, target, model, requests, offsets, max_concurrency)
        after = await read_server_counters(session, target.prometheus_url)
    window = after - before
    return BenchmarkRun(outputs, duration, model, window.spec, window.prefix_cache)
