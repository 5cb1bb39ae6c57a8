"""Prometheus metrics for /metrics: engine gauges, request latencies, counters (vLLM's names, `lab:` prefix).

Owns: one registry per app (so several servers can live in one process, as tests do) and what each
finished request adds to it. Ignores: how the numbers are produced.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lab.kv_cache.counters import PrefixCacheCounters
from lab.metrics.summary import step_gaps
from lab.serve.engine_loop import EngineStats
from lab.spec.counters import SpecCounters

# NOTE: vLLM's upper ranges (a long request under load takes minutes); finer at the bottom for CPU-sized models
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, 7680.0)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                   0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.num_running = Gauge("lab:num_requests_running", "Requests in the engine's running batch.", labels, registry=r)
        self.num_waiting = Gauge("lab:num_requests_waiting", "Requests queued for the engine.", labels, registry=r)
        self.num_outstanding = Gauge("lab:num_requests_outstanding", "Requests accepted and not yet answered.",
                                     labels, registry=r)
        self.kv_usage = Gauge("lab:kv_cache_usage_perc", "Share of the KV pool's blocks held by requests (0-1; 1 = "
                              "full); 0 for engines whose cache has no fixed pool.", labels, registry=r)
        self.kv_used = Gauge("lab:kv_cache_used_bytes", "KV bytes holding live tokens (a shared prefix counts once "
                             "per request).", labels, registry=r)
        self.kv_reserved = Gauge("lab:kv_cache_reserved_bytes", "KV bytes reserved (by running requests; the whole pool "
                                 "where the engine takes it up front, hf_cb).", labels,
                                 registry=r)
        self.ttft = Histogram("lab:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("lab:inter_token_latency_seconds", "Between consecutive steps that gave a request "
                             "tokens (a speculative step's tokens come together).", labels, buckets=TOKEN_BUCKETS_S,
                             registry=r)
        self.tpot = Histogram("lab:request_time_per_output_token_seconds", "Per request: (E2EL - TTFT) / (tokens - 1); "
                              "0 for a one-token request, as vLLM records it.", labels, buckets=TOKEN_BUCKETS_S,
                              registry=r)
        self.e2el = Histogram("lab:e2e_request_latency_seconds", "Arrival to last token.", labels,
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.finished = Counter("lab:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.rejected = Counter("lab:request_rejected", "Requests refused before reaching the engine.",
                                labels + ["reason"], registry=r)
        self.prompt_tokens = Counter("lab:prompt_tokens", "Prompt tokens of admitted requests.", labels, registry=r)
        self.generation_tokens = Counter("lab:generation_tokens", "Generated tokens.", labels, registry=r)
        self.model_name = model_name
        self.spec: SpecMetrics | None = None   # registered once the engine reports speculative counts
        self.prefix_cache: PrefixCacheMetrics | None = None   # ... prefix-cache counts (a paged KV cache)

    def observe_finished(self, finish_reason: str, arrival: float, token_times: list[float]) -> None:
        m = self.model_name
        self.finished.labels(m, finish_reason).inc()
        self.generation_tokens.labels(m).inc(len(token_times))
        if not token_times:
            return
        ttft, e2el = token_times[0] - arrival, token_times[-1] - arrival
        self.ttft.labels(m).observe(ttft)
        self.e2el.labels(m).observe(e2el)
        self.tpot.labels(m).observe((e2el - ttft) / (len(token_times) - 1) if len(token_times) > 1 else 0.0)
        for gap in step_gaps(token_times):
            self.itl.labels(m).observe(gap)

    def render(self, stats: EngineStats, num_outstanding: int) -> bytes:
        m = self.model_name
        self.num_running.labels(m).set(stats.num_running)
        self.num_waiting.labels(m).set(stats.num_waiting)
        self.num_outstanding.labels(m).set(num_outstanding)
        self.kv_used.labels(m).set(stats.kv_used_bytes)
        self.kv_reserved.labels(m).set(stats.kv_reserved_bytes)
        self.kv_usage.labels(m).set(stats.kv_cache_usage or 0.0)
        if stats.spec is not None:
            if self.spec is None:
                self.spec = SpecMetrics(self.registry)
            self.spec.update(m, stats.spec)
        if stats.prefix_cache is not None:
            if self.prefix_cache is None:
                self.prefix_cache = PrefixCacheMetrics(self.registry)
            self.prefix_cache.update(m, stats.prefix_cache)
        return generate_latest(self.registry)


class PrefixCacheMetrics:
    """vLLM v1's prefix-cache counters, in tokens: `lab:prefix_cache_queries_total` (prompt tokens looked up at
    admission) and `lab:prefix_cache_hits_total` (of those, served from the cache). Each scrape adds what the
    engine's cumulative counts grew by since the last one."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.queries = Counter("lab:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
                               labels, registry=registry)
        self.hits = Counter("lab:prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache.",
                            labels, registry=registry)
        self.last = PrefixCacheCounters()

    def update(self, model_name: str, counts: PrefixCacheCounters) -> None:
        grown = counts - self.last
        if min(grown.queries, grown.hits) < 0:
            grown = counts   # NOTE: a new engine's counts (they only grow otherwise): all of them are new
        self.queries.labels(model_name).inc(grown.queries)
        self.hits.labels(model_name).inc(grown.hits)
        self.last = counts


class SpecMetrics:
    """vLLM's speculative-decoding counters (`lab:spec_decode_num_drafts_total`, `_num_draft_tokens_total`,
    `_num_accepted_tokens_total`, `_num_accepted_tokens_per_pos_total{position}`). The engine keeps cumulative
    counts; each scrape adds what they grew by since the last one (all of them after an engine-side reset)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.num_drafts = Counter("lab:spec_decode_num_drafts", "Drafts verified (one per request and step).",
                                  labels, registry=registry)
        self.num_draft_tokens = Counter("lab:spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                        registry=registry)
        self.num_accepted_tokens = Counter("lab:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                           registry=registry)
        self.accepted_per_pos = Counter("lab:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", labels + ["position"],
                                        registry=registry)
        self.last = SpecCounters()

    def update(self, model_name: str, counts: SpecCounters) -> None:
        grown = counts - self.last
        if min((grown.num_drafts, grown.num_draft_tokens, grown.num_accepted_tokens, *grown.accepted_per_position),
               default=0) < 0:
            grown = counts   # NOTE: the engine's counts were reset (reset_stats): all of them are new
        self.num_drafts.labels(model_name).inc(grown.num_drafts)
        self.num_draft_tokens.labels(model_name).inc(grown.num_draft_tokens)
        self.num_accepted_tokens.labels(model_name).inc(grown.num_accepted_tokens)
        for position, accepted in enumerate(grown.accepted_per_position):
            self.accepted_per_pos.labels(model_name, str(position)).inc(accepted)
        self.last = counts
