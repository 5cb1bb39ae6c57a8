"""The server's own counters, read from its Prometheus /metrics before and after a run (as vLLM users read
`vllm:spec_decode_*` and `vllm:prefix_cache_*`): whatever the prefix (`vllm:`, ours `lab:`), every
`<prefix>:spec_decode_num_drafts_total`, `_num_draft_tokens_total`, `_num_accepted_tokens_total`,
`_num_accepted_tokens_per_pos_total{position}`, `<prefix>:prefix_cache_queries_total` and
`<prefix>:prefix_cache_hits_total` sample is summed (over models, engines, replicas).

Owns: fetching and parsing the exposition. Ignores: what the counts mean (lab/spec/counters.py,
lab/kv_cache/counters.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from lab.kv_cache.counters import PrefixCacheCounters
from lab.spec.counters import SpecCounters

TOTALS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "num_draft_tokens",
          "spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
PREFIX_CACHE = {"prefix_cache_queries": "queries", "prefix_cache_hits": "hits"}


@dataclass(frozen=True, slots=True)
class ServerCounters:
    spec: SpecCounters | None = None                   # None: the server exports no spec_decode counters
    prefix_cache: PrefixCacheCounters | None = None    # None: ... no prefix_cache counters

    def __sub__(self, earlier: ServerCounters) -> ServerCounters:
        """What happened since `earlier`; a family missing from either snapshot is None."""
        spec = self.spec - earlier.spec if self.spec is not None and earlier.spec is not None else None
        prefix = (self.prefix_cache - earlier.prefix_cache
                  if self.prefix_cache is not None and earlier.prefix_cache is not None else None)
        return ServerCounters(spec, prefix)


def parse_server_counters(text: str) -> ServerCounters:
    """The summed counters in a Prometheus text exposition (families it lacks, or text that is not Prometheus's,
    come back as None)."""
    totals = dict.fromkeys(TOTALS.values(), 0)
    prefix = dict.fromkeys(PREFIX_CACHE.values(), 0)
    per_position: dict[int, int] = {}
    found_spec = found_prefix = False
    try:
        for family in text_string_to_metric_families(text):
            name = family.name.rsplit(":", 1)[-1]
            if name not in TOTALS and name != PER_POSITION and name not in PREFIX_CACHE:
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue   # NOTE: `_created` timestamps
                if name in PREFIX_CACHE:
                    found_prefix = True
                    prefix[PREFIX_CACHE[name]] += int(sample.value)
                    continue
                found_spec = True
                if name == PER_POSITION:
                    position = int(sample.labels.get("position", 0))
                    per_position[position] = per_position.get(position, 0) + int(sample.value)
                else:
                    totals[TOTALS[name]] += int(sample.value)
    except ValueError:   # NOTE: not Prometheus text (another service on that path)
        return ServerCounters()
    positions = tuple(per_position.get(p, 0) for p in range(max(per_position, default=-1) + 1))
    spec = (SpecCounters(totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"], positions)
            if found_spec else None)
    return ServerCounters(spec, PrefixCacheCounters(**prefix) if found_prefix else None)


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The summed speculative-decoding counters; None when there are none (no speculation, or not exported)."""
    return parse_server_counters(text).spec


async def read_server_counters(session: aiohttp.ClientSession, url: str) -> ServerCounters:
    """GET `url` and parse it; empty counters when the server has no such endpoint."""
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return ServerCounters()
            return parse_server_counters(await response.text())
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return ServerCounters()
