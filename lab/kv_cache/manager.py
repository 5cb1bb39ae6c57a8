"""KVCacheManager: the interface the scheduler uses to reserve KV space for requests, in blocks.

Owns: the contract (can a request ever fit, prefix-cache lookup, allocate for the next tokens, free).
Ignores: tensor contents. A manager hands out block ids; BlockKVCache turns a request's block table
into storage locations, so the slot allocator (one block of `max_len` tokens per request) and the
paged manager (many `block_size`-token blocks) share one attention path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lab.kv_cache.block_pool import KVCacheBlock
from lab.request import Request


@dataclass(slots=True, frozen=True)
class CachedPrefix:
    """Full blocks whose KV another request already computed for the same token prefix."""

    blocks: tuple[KVCacheBlock, ...] = ()
    num_tokens: int = 0


NO_PREFIX = CachedPrefix()


class KVCacheManager(Protocol):
    block_size: int   # tokens per block
    num_blocks: int   # blocks in the storage

    def can_fit(self, num_tokens: int) -> bool:
        """Could one request holding `num_tokens` tokens of KV fit if it ran alone?"""
        ...

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest run of cached full blocks matching the request's tokens (never all of them: the
        last token is always recomputed so the request has logits to sample from)."""
        ...

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        """Hold blocks for `request.num_computed_tokens + prefix.num_tokens + num_new_tokens` tokens.
        False (and nothing changed) when there are not enough free blocks."""
        ...

    def free(self, request: Request) -> None:
        """Release every block the request holds (finished, preempted or aborted)."""
        ...

    def block_table(self, request_id: str) -> list[int]:
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (blocks held by running requests stay theirs)."""
        ...

    @property
    def num_held_blocks(self) -> int:
        """Blocks held by at least one request."""
        ...

    def stats(self) -> dict[str, float]:
        ...


class KVCacheConfig(Protocol):
    """A conf/engine/kv_cache/*.yaml target: plain numbers in, a manager out once the model is known."""

    attention: str   # BlockKVCache backend: "native", "fast" or "gather"

    def build_manager(self, max_model_len: int, max_num_seqs: int, bytes_per_token: int,
                      device: torch.device) -> KVCacheManager:
        ...
