"""BlockPool: the fixed set of KV blocks, their reference counts, the free queue and the prefix-cache map.

Owns: which block ids are free, how many block tables hold each block, which full blocks are cached
under a hash of their token prefix. Ignores: requests and tensor contents (PagedKVCacheManager maps
requests to blocks; BlockKVCache stores the keys and values).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from lab.errors import LabError

BlockHash = bytes


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None   # set while the block is in the prefix cache


class BlockPool:
    """`num_blocks` blocks. A block is free when no block table holds it (ref_cnt 0); a free block may
    still be cached, and is reused by a prefix hit until a new allocation evicts it (LRU order)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise LabError(f"a block pool needs at least one block, got {num_blocks}",
                           "raise engine.kv_cache.num_blocks or the KV memory budget")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # NOTE: an OrderedDict is a doubly linked list with O(1) removal from the middle, which a prefix
        # hit on a free cached block needs; allocation pops the least recently freed block first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (ref_cnt 1 each), evicting their old cache entries."""
        if num_blocks > len(self._free):
            raise LabError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """A block table starts sharing `blocks` (prefix hit): one more reference each."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Publish a full block under the hash of its token prefix (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def free_blocks(self, blocks: list[KVCacheBlock], uncache: set[int] = frozenset()) -> None:
        """Drop one reference from each block. Blocks in `uncache` (ids whose KV was never computed)
        leave the prefix cache when their last reference goes."""
        # NOTE: freed in reverse so a request's tail blocks are evicted before its shared prefix.
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise LabError(f"block {block.block_id} freed more often than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_id in uncache:
                    self._evict(block)
                self._free[block.block_id] = None

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._evict(block)
