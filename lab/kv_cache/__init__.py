"""KV caches: the objects the decoder's attention writes keys/values into and attends over."""

from lab.kv_cache.base import AttentionCache, NoCache
from lab.kv_cache.contiguous import ContiguousKVCache

__all__ = ["AttentionCache", "NoCache", "ContiguousKVCache"]
