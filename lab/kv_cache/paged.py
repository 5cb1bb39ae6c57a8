"""PagedKVCacheManager: per-request block tables over a BlockPool, with prefix caching (stage 2E).

Owns: which blocks each request holds, growing a table as the request's tokens grow, the hash chain of
each request's full blocks and prefix hits. Ignores: tensor contents and scheduling policy.

Prefix caching follows vLLM: block i of a request is keyed by a hash of (hash of block i-1, the token
ids of block i), so equal keys mean equal token prefixes and therefore equal KV. A full block is
published when it is allocated for tokens this step computes; a later request with the same prefix
shares it (reference count + 1) instead of recomputing it.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

import psutil
import torch

from lab.errors import LabError
from lab.kv_cache.block_pool import BlockHash, BlockPool, KVCacheBlock
from lab.kv_cache.counters import PrefixCacheCounters
from lab.kv_cache.manager import NO_PREFIX, CachedPrefix
from lab.request import Request


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    # NOTE: a cryptographic hash, so two different prefixes never share KV by accident.
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()[:16]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_published: dict[str, int] = {}   # leading blocks of a request already in the cache
        self.num_query_tokens = 0                   # prompt tokens looked up at first admission
        self.num_hit_tokens = 0                     # of those, served from the prefix cache

    def can_fit(self, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.num_blocks

    @property
    def num_held_blocks(self) -> int:
        return self.pool.num_used_blocks

    def block_table(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(request_id, ())]

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The hash chain of the request's first `num_blocks` full blocks (extended lazily)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            token_ids = request.all_token_ids
            bs = self.block_size
            for i in range(len(hashes), num_blocks):
                hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        if not self.enable_prefix_caching or request.request_id in self.req_blocks:
            return NO_PREFIX
        blocks: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return CachedPrefix(tuple(blocks), len(blocks) * self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        blocks = self.req_blocks.get(request.request_id, [])
        if prefix.blocks and blocks:
            raise ValueError(f"request {request.request_id}: a cached prefix is only taken at admission")
        num_tokens = request.num_computed_tokens + prefix.num_tokens + num_new_tokens
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(blocks) - len(prefix.blocks)
        # NOTE: a hit on a free cached block takes that block out of the free queue.
        num_free = self.pool.num_free_blocks - sum(1 for b in prefix.blocks if b.ref_cnt == 0)
        if num_new_blocks > num_free:
            return False
        if not blocks:
            if not request.num_preemptions:   # NOTE: vLLM counts a readmission's own blocks found again apart
                self.num_query_tokens += request.num_tokens
                self.num_hit_tokens += prefix.num_tokens
            self._num_published[request.request_id] = len(prefix.blocks)
        self.pool.touch(list(prefix.blocks))
        blocks = blocks + list(prefix.blocks) + self.pool.get_new_blocks(max(0, num_new_blocks))
        self.req_blocks[request.request_id] = blocks
        self._publish_full_blocks(request, blocks, num_tokens)
        return True

    def _publish_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        # NOTE: speculative tokens hold KV slots but are not the request's tokens yet: never publish them.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_published[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks. Call before resetting `num_computed_tokens` (preemption):
        blocks past the computed tokens were published for KV that was never written (an aborted
        step), so they leave the prefix cache instead of serving garbage to a later hit."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if not blocks:
            return
        computed = request.num_computed_tokens // self.block_size
        self.pool.free_blocks(blocks, uncache={b.block_id for b in blocks[computed:]})

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def prefix_cache_counters(self) -> PrefixCacheCounters:
        """Cumulative since the manager was built (what a server exports as vLLM's `prefix_cache_*` counters)."""
        return PrefixCacheCounters(self.num_query_tokens, self.num_hit_tokens)

    def stats(self) -> dict[str, float]:
        # NOTE: the prefix-cache counts are cumulative (prefix_cache_counters); the engine reports them per window
        return {"kv/num_blocks": self.num_blocks, "kv/block_size": self.block_size,
                "kv/num_held_blocks": self.num_held_blocks}


@dataclass(slots=True)
class PagedKVCacheConfig:
    """conf/engine/kv_cache/paged.yaml. The block count is `num_blocks` if set, else what
    `kv_cache_memory_mb` (or `memory_fraction` of free memory) holds, capped at what `max_num_seqs`
    requests of the model's full context could use."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_mb: float | None = 1024
    memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    attention: str = "native"

    def build_manager(self, max_model_len: int, max_num_seqs: int, bytes_per_token: int,
                      device: torch.device) -> PagedKVCacheManager:
        if self.block_size < 1:
            raise LabError(f"block_size must be >= 1, got {self.block_size}", "set engine.kv_cache.block_size=16")
        num_blocks = resolve_num_blocks(bytes_per_token * self.block_size, device, self.num_blocks,
                                        self.kv_cache_memory_mb, self.memory_fraction,
                                        max_num_seqs * cdiv(max_model_len, self.block_size))
        return PagedKVCacheManager(num_blocks, self.block_size, self.enable_prefix_caching)


def resolve_num_blocks(bytes_per_block: int, device: torch.device, num_blocks: int | None = None,
                       memory_mb: float | None = None, memory_fraction: float | None = None,
                       max_useful_blocks: int | None = None) -> int:
    """Block count: explicit `num_blocks`, else a budget in MB, else a fraction of the device's free
    memory (CUDA: free device memory; CPU: available RAM), capped at what `max_num_seqs` full-length
    requests could ever hold."""
    if num_blocks is not None:
        return int(num_blocks)
    if memory_mb is not None:
        budget = memory_mb * 2**20
    elif memory_fraction is not None:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        budget = memory_fraction * free
    else:
        raise LabError("the paged KV cache needs num_blocks, kv_cache_memory_mb or memory_fraction",
                       "set engine.kv_cache.num_blocks=N (or kv_cache_memory_mb)")
    count = int(budget // bytes_per_block)
    return max(1, min(count, max_useful_blocks) if max_useful_blocks else count)
