"""Slot and block allocators: seeded random allocate / append / free / preempt sequences with the
invariants checked after every operation, plus prefix sharing and abort safety."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from lab.kv_cache import PagedKVCacheManager, SlotKVCacheManager
from lab.kv_cache.paged import cdiv
from lab.request import Request, SamplingParams


def _request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=10_000, ignore_eos=True))


def check_paged_invariants(manager: PagedKVCacheManager, live: dict[str, Request]) -> None:
    pool = manager.pool
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks, (
        f"free {pool.num_free_blocks} + used {pool.num_used_blocks} != total {pool.num_blocks}")
    holders = Counter(block.block_id for blocks in manager.req_blocks.values() for block in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders.get(block.block_id, 0)} tables")
        assert (block.ref_cnt == 0) == (block.block_id in pool._free), f"block {block.block_id} free-queue mismatch"
        if block.ref_cnt > 1:
            assert block.block_hash is not None, f"block {block.block_id} shared by {block.ref_cnt} without a hash"
    for block_hash, block in pool._cached.items():
        assert block.block_hash == block_hash, f"cache entry of block {block.block_id} has a stale hash"
    for request_id, blocks in manager.req_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids), f"{request_id} holds a block twice: {ids}"
        assert request_id in live, f"{request_id} holds blocks after it was freed"


class PagedDriver:
    """Plays a scheduler: admits requests (with prefix lookup), grows them, finishes or preempts them."""

    def __init__(self, manager: PagedKVCacheManager, rng: random.Random) -> None:
        self.manager, self.rng = manager, rng
        self.live: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.next_id = 0
        self.shared_prompt = [rng.randrange(100) for _ in range(3 * manager.block_size + 1)]

    def admit(self) -> None:
        if self.waiting and self.rng.random() < 0.5:
            request = self.waiting.pop(0)
        else:
            length = self.rng.randrange(1, 5 * self.manager.block_size)
            prompt = (self.shared_prompt[:length] if self.rng.random() < 0.4
                      else [self.rng.randrange(100) for _ in range(length)])
            request = _request(f"q{self.next_id}", prompt)
            self.next_id += 1
        prefix = self.manager.find_cached_prefix(request)
        assert prefix.num_tokens < request.num_tokens, "a cached prefix must leave a token to compute"
        num_new = self.rng.randrange(1, request.num_tokens - prefix.num_tokens + 1)
        before = self.manager.pool.num_free_blocks
        if self.manager.allocate_slots(request, num_new, prefix):
            request.num_computed_tokens = prefix.num_tokens + num_new
            self.live[request.request_id] = request
            assert len(self.manager.req_blocks[request.request_id]) == cdiv(request.num_computed_tokens,
                                                                             self.manager.block_size)
        else:
            assert self.manager.pool.num_free_blocks == before, "a failed allocation changed the pool"
            self.waiting.append(request)

    def append(self) -> None:
        request = self.rng.choice(list(self.live.values()))
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.extend(self.rng.randrange(100) for _ in range(self.rng.randrange(1, 4)))
        num_new = request.num_tokens - request.num_computed_tokens
        if self.manager.allocate_slots(request, num_new):
            request.num_computed_tokens += num_new

    def free(self, preempt: bool) -> None:
        request = self.live.pop(self.rng.choice(list(self.live)))
        self.manager.free(request)
        if preempt:
            request.num_computed_tokens = 0
            self.waiting.insert(0, request)

    def step(self) -> None:
        op = self.rng.random()
        if not self.live or op < 0.35:
            self.admit()
        elif op < 0.75:
            self.append()
        else:
            self.free(preempt=op < 0.85)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_random_block_operations_keep_the_pool_consistent(seed: int, enable_prefix_caching: bool) -> None:
    rng = random.Random(seed)
    manager = PagedKVCacheManager(num_blocks=rng.choice([8, 17, 40]), block_size=rng.choice([1, 4, 16]),
                                  enable_prefix_caching=enable_prefix_caching)
    driver = PagedDriver(manager, rng)
    for _ in range(400):
        driver.step()
        check_paged_invariants(manager, driver.live)
    for request_id in list(driver.live):
        manager.free(driver.live.pop(request_id))
        check_paged_invariants(manager, driver.live)
    assert manager.pool.num_free_blocks == manager.num_blocks, (
        f"{manager.num_blocks - manager.pool.num_free_blocks} blocks still held after freeing everything")
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)


def test_identical_prompts_share_full_blocks_with_ref_count_two() -> None:
    manager = PagedKVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 23))                       # 13 tokens: 3 full blocks + 1 partial
    first, second = _request("a", prompt), _request("b", prompt)
    assert manager.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    prefix = manager.find_cached_prefix(second)
    assert prefix.num_tokens == 12, f"expected 3 shared blocks (12 tokens), got {prefix.num_tokens}"
    assert manager.allocate_slots(second, second.num_tokens - prefix.num_tokens, prefix)
    shared = manager.req_blocks["a"][:3]
    assert manager.req_blocks["b"][:3] == shared
    assert [b.ref_cnt for b in shared] == [2, 2, 2]
    assert manager.req_blocks["a"][3] is not manager.req_blocks["b"][3], "the partial block must not be shared"
    assert manager.pool.num_used_blocks == 5, f"3 shared + 2 private blocks, got {manager.pool.num_used_blocks}"


def test_whole_prompt_hit_still_recomputes_the_last_token() -> None:
    manager = PagedKVCacheManager(num_blocks=8, block_size=4)
    first, second = _request("a", list(range(8))), _request("b", list(range(8)))
    assert manager.allocate_slots(first, 8)
    first.num_computed_tokens = 8
    prefix = manager.find_cached_prefix(second)
    assert prefix.num_tokens == 4, f"8-token prompt, blocks of 4: reuse 4 tokens, got {prefix.num_tokens}"


def test_blocks_published_for_uncomputed_kv_leave_the_cache_when_freed() -> None:
    manager = PagedKVCacheManager(num_blocks=8, block_size=4)
    aborted = _request("a", list(range(9)))
    assert manager.allocate_slots(aborted, 9)          # published blocks 0 and 1, KV never written
    manager.free(aborted)                               # num_computed_tokens is still 0
    assert manager.pool.num_cached_blocks == 0
    assert manager.find_cached_prefix(_request("b", list(range(9)))).num_tokens == 0


def test_free_cached_blocks_are_reused_by_a_hit_before_eviction() -> None:
    manager = PagedKVCacheManager(num_blocks=4, block_size=4)
    done = _request("a", list(range(9)))
    assert manager.allocate_slots(done, 9)
    done.num_computed_tokens = 9
    manager.free(done)
    again = _request("b", list(range(9)))
    prefix = manager.find_cached_prefix(again)
    assert prefix.num_tokens == 8
    assert manager.allocate_slots(again, 1, prefix)
    assert manager.pool.num_used_blocks == 3 and manager.pool.num_free_blocks == 1


@pytest.mark.parametrize("seed", range(4))
def test_random_slot_operations_keep_slots_unique_and_stable(seed: int) -> None:
    rng = random.Random(seed)
    manager = SlotKVCacheManager(num_slots=5, max_len=32)
    live: dict[str, Request] = {}
    slot_of: dict[str, int] = {}
    for i in range(300):
        if live and rng.random() < 0.45:
            request = live.pop(rng.choice(list(live)))
            manager.free(request)
            slot_of.pop(request.request_id)
        elif live and rng.random() < 0.5:
            request = rng.choice(list(live.values()))
            assert manager.allocate_slots(request, 1)
            assert manager.block_table(request.request_id) == [slot_of[request.request_id]], "slot id changed"
        else:
            request = _request(f"s{i}", [1, 2, 3])
            expected = min(set(range(5)) - set(slot_of.values()), default=None)
            assert manager.allocate_slots(request, 3) == (expected is not None)
            if expected is not None:
                live[request.request_id] = request
                slot_of[request.request_id] = manager.block_table(request.request_id)[0]
                assert slot_of[request.request_id] == expected, "the lowest free slot is reused first"
        held = list(manager.slot_ids.values())
        assert len(set(held)) == len(held), f"a slot is owned twice: {held}"
        assert len(held) + len(manager._free_slots) == manager.num_slots
        assert manager.slot_ids == slot_of
    for request in list(live.values()):
        manager.free(request)
    assert manager.num_held_blocks == 0 and sorted(manager._free_slots) == list(range(5))


def test_a_slot_never_grows_past_max_len() -> None:
    manager = SlotKVCacheManager(num_slots=2, max_len=8)
    request = _request("a", list(range(6)))
    assert manager.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    assert not manager.allocate_slots(request, 3)
    assert manager.can_fit(8) and not manager.can_fit(9)


def test_step_index_python_and_tensor_paths_agree() -> None:
    """Small steps build their positions and slots in Python, large ones with tensor ops: the same values."""
    from lab.kv_cache import block_kv
    from lab.kv_cache.block_kv import SeqSlice, build_step_index

    generator = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(6):
        context, query = int(torch.randint(0, 40, (1,), generator=generator)), 1 + (7 * i) % 9
        blocks = -(-(context + query) // 4)
        seqs.append(SeqSlice(torch.randperm(64, generator=generator)[:blocks].tolist(), context, query))
    small = build_step_index(seqs, 4, torch.device("cpu"))
    limit, block_kv.PYTHON_INDEX_MAX_TOKENS = block_kv.PYTHON_INDEX_MAX_TOKENS, 0
    try:
        large = build_step_index(seqs, 4, torch.device("cpu"))
    finally:
        block_kv.PYTHON_INDEX_MAX_TOKENS = limit
    assert torch.equal(small.positions, large.positions) and torch.equal(small.slot_mapping, large.slot_mapping)
    assert small.q_start == large.q_start
