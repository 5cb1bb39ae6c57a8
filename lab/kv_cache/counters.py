"""PrefixCacheCounters: a paged KV cache's cumulative prefix-cache lookups, in vLLM v1's terms
(`prefix_cache_queries`: prompt tokens looked up at admission; `prefix_cache_hits`: of those, served from
the cache), and what a window of them says (the hit rate).

Owns: the counts a server exports on /metrics and a benchmark client reads back as before/after deltas.
Ignores: how they are counted (PagedKVCacheManager) and how they travel (Prometheus text, lab/serve, lab/bench).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixCacheCounters:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, served from the prefix cache

    def __add__(self, other: PrefixCacheCounters) -> PrefixCacheCounters:
        """Two engines' counts together (replicas)."""
        return PrefixCacheCounters(self.queries + other.queries, self.hits + other.hits)

    def __sub__(self, earlier: PrefixCacheCounters) -> PrefixCacheCounters:
        """What happened since `earlier` (a snapshot of the same counters)."""
        return PrefixCacheCounters(self.queries - earlier.queries, self.hits - earlier.hits)

    def summary(self) -> dict[str, float]:
        """The names lab's serving results.json uses; the hit rate is hit tokens / queried tokens (0 if none)."""
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0}
