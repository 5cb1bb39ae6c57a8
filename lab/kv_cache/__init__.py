"""KV caches: the objects the decoder's attention writes keys/values into and attends over."""

from lab.kv_cache.base import AttentionCache, NoCache
from lab.kv_cache.block_kv import BlockKVCache, SeqSlice
from lab.kv_cache.block_pool import BlockPool, KVCacheBlock
from lab.kv_cache.contiguous import ContiguousKVCache
from lab.kv_cache.manager import CachedPrefix, KVCacheConfig, KVCacheManager
from lab.kv_cache.paged import PagedKVCacheConfig, PagedKVCacheManager
from lab.kv_cache.slots import SlotKVCacheConfig, SlotKVCacheManager

__all__ = ["AttentionCache", "NoCache", "ContiguousKVCache", "BlockKVCache", "SeqSlice", "BlockPool",
           "KVCacheBlock", "CachedPrefix", "KVCacheConfig", "KVCacheManager", "PagedKVCacheConfig",
           "PagedKVCacheManager", "SlotKVCacheConfig", "SlotKVCacheManager"]
