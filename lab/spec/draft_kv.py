"""DraftKV: a drafter's own paged KV cache and, per request, which prefix of it is still valid.

Rollback by recomputation: each propose keeps the longest stored prefix whose tokens still match the
request's context (at most all but the last token, which is always fed), so rejected drafts, preemptions
and aborts need no callbacks. Used by the draft-model / layerskip and the EAGLE proposers.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.kv_cache.block_kv import BlockKVCache, SeqSlice
from lab.kv_cache.paged import PagedKVCacheManager
from lab.request import Request, SamplingParams


@dataclass(slots=True)
class _DraftState:
    shadow: Request             # the draft's view: num_computed_tokens = its valid KV prefix
    stored_token_ids: list[int]  # the tokens whose KV the draft holds, in position order


class DraftKV:
    def __init__(self, cache: BlockKVCache, num_blocks: int, block_size: int) -> None:
        self.cache = cache
        self.manager = PagedKVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.states: dict[str, _DraftState] = {}
        self.num_skipped = 0   # catch-ups refused because the draft's KV pool was full

    def catch_up(self, request_id: str, context: list[int], num_extra_slots: int) -> SeqSlice | None:
        """Reserve KV for `context` + `num_extra_slots`; the slice feeds the context tokens the draft has not
        seen (at least the last one). None when the pool is full (the request is not drafted this step)."""
        state = self.states.get(request_id)
        if state is None:
            shadow = Request(request_id, [], SamplingParams(max_tokens=1))
            state = self.states[request_id] = _DraftState(shadow, [])
        valid = 0
        limit = min(state.shadow.num_computed_tokens, len(context) - 1)
        while valid < limit and state.stored_token_ids[valid] == context[valid]:
            valid += 1
        state.shadow.num_computed_tokens = valid
        if not self.manager.allocate_slots(state.shadow, len(context) + num_extra_slots - valid):
            self.num_skipped += 1
            return None
        return SeqSlice(self.manager.block_table(request_id), valid, len(context) - valid)

    def commit(self, request_id: str, stored_token_ids: list[int]) -> None:
        """After drafting: the draft's KV now validly holds these tokens (positions 0..len-1)."""
        state = self.states[request_id]
        state.stored_token_ids = stored_token_ids
        state.shadow.num_computed_tokens = len(stored_token_ids)

    def free(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.manager.free(state.shadow)
