"""The `native` attention backend (C++ decode kernel over KV blocks) and the oneDNN-packed linears give
the same greedy tokens as `ar`, and the kernel's output matches the gather reference numerically.

The kernel is compiled on first use (minutes on a loaded 2-core machine, then cached), so the tests that
need it are skipped where it cannot be built.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.kv_cache import PagedKVCacheConfig, SlotKVCacheConfig
from lab.kv_cache.block_kv import BlockKVCache, SeqSlice
from lab.kv_cache.native_attention import MAX_KERNEL_QUERY_TOKENS, NativeMeta, load_kernel
from lab.models.packed_linear import NATIVE_MAX_ROWS, PackedLinear, can_pack
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from tests.helpers import make_requests
from tests.test_continuous_batching import assert_matches_ar, assert_nothing_held, random_prompts

needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="the native kernel cannot be built here")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@needs_kernel
def test_kernel_matches_sdpa_over_gathered_blocks() -> None:
    generator = torch.Generator().manual_seed(0)
    num_seqs, num_kv_heads, group, head_dim, block_size, num_blocks = 5, 2, 3, 16, 4, 40
    k_store = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
    v_store = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
    lens = torch.tensor([1, 4, 5, 13, 16])
    tables = torch.randperm(num_blocks, generator=generator)[:num_seqs * 4].view(num_seqs, 4)
    q = torch.randn(num_seqs, num_kv_heads, group, head_dim, generator=generator)
    out = torch.empty_like(q)
    no_hidden = torch.empty(0, dtype=torch.long)
    load_kernel().paged_decode(q, k_store, v_store, tables, lens, no_hidden, 1 / math.sqrt(head_dim), out)
    for i in range(num_seqs):
        keys = k_store[:, tables[i]].reshape(num_kv_heads, -1, head_dim)[:, :lens[i]]        # (Hkv, S, D)
        values = v_store[:, tables[i]].reshape(num_kv_heads, -1, head_dim)[:, :lens[i]]
        reference = F.scaled_dot_product_attention(q[i], keys, values)                       # (Hkv, G, D)
        torch.testing.assert_close(out[i], reference, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_short_chunks_take_the_kernel_and_match_the_gather_reference() -> None:
    """Verify-shaped steps (k + 1 tokens after a context), short fresh prompts and decodes go through the
    kernel one row per token; a longer chunk after them still goes to SDPA. Same result as `gather`."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 48
    assert MAX_KERNEL_QUERY_TOKENS == 64
    seqs = [SeqSlice([3, 7, 1], 9, 3),                     # a verify step: 3 tokens after 9 of context
            SeqSlice([5], 0, 1),                           # a one-token prompt
            SeqSlice([8, 2], 4, 1),                        # a decode
            SeqSlice([11, 12], 0, 8),                      # a short fresh prompt
            SeqSlice(list(range(20, 38)), 6, MAX_KERNEL_QUERY_TOKENS + 1)]   # a longer chunk after context: SDPA
    num_tokens = sum(s.num_query_tokens for s in seqs)
    q = torch.randn(1, num_tokens, heads, head_dim, generator=generator)
    k = torch.randn(1, num_tokens, kv_heads, head_dim, generator=generator)
    v = torch.randn(1, num_tokens, kv_heads, head_dim, generator=generator)
    outputs = {}
    for backend in ("native", "gather"):
        cache = BlockKVCache(1, kv_heads, head_dim, num_blocks, block_size, torch.float32, torch.device("cpu"), backend)
        stores = torch.Generator().manual_seed(1)
        cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=stores))
        cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=stores))
        cache.begin_step(seqs)
        if backend == "native":
            assert isinstance(cache._meta, NativeMeta) and cache._meta.num_rows == num_tokens - 65
        outputs[backend] = cache.attend(0, q, k, v)
    torch.testing.assert_close(outputs["native"], outputs["gather"], atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kv_cache", [PagedKVCacheConfig(block_size=8, num_blocks=160, attention="native"),
                                      PagedKVCacheConfig(block_size=4, num_blocks=30, attention="native"),
                                      SlotKVCacheConfig(max_len=96, attention="native")],
                         ids=["paged", "paged_preempt", "slots"])
def test_native_backend_greedy_equals_ar(kv_cache: PagedKVCacheConfig | SlotKVCacheConfig,
                                         tiny_runner: ModelRunner) -> None:
    prompts = random_prompts(12, tiny_runner.vocab_size, seed=1)
    references = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 16, ignore_eos=True)).requests]
    requests = make_requests(prompts, 16, ignore_eos=True)
    for i, request in enumerate(requests):
        request.arrival_time = 0.004 * i
    engine = ContinuousBatchingEngine(tiny_runner, SchedulerConfig(16, 32), kv_cache)
    for request, reference in zip(engine.run(requests).requests, references):
        assert_matches_ar(tiny_runner, request, reference, "native")
    assert_nothing_held(engine)


def test_packed_linear_matches_plain_linear_and_falls_back_when_the_weight_changes(
        tiny_runner: ModelRunner) -> None:
    if not can_pack(tiny_runner.device, tiny_runner.dtype):
        pytest.skip("oneDNN packing needs fp32 on a CPU build with mkldnn")
    layer = tiny_runner.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, PackedLinear), "the runner packs every linear in fp32 on CPU"
    x = torch.randn(1, NATIVE_MAX_ROWS + 4, layer.in_features)   # more rows than the native GEMV takes
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)
    saved = layer.weight.data.clone()
    with torch.no_grad():
        layer.weight.mul_(2)
    try:
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5,
                                   msg="a stale packed copy must not be used")
    finally:
        with torch.no_grad():
            layer.weight.copy_(saved)
        layer.pack()


@needs_kernel
@pytest.mark.parametrize("group,head_dim,block_size", [(3, 64, 16), (1, 8, 4), (2, 40, 16), (5, 72, 8)])
def test_rows_of_one_sequence_attended_in_pairs_are_bit_identical_to_one_at_a_time(group: int, head_dim: int,
                                                                                   block_size: int) -> None:
    """Consecutive rows on the same blocks (a verify step's tokens) are attended two at a time in AVX-512 registers
    (attention_pairs): every row's output equals, bit for bit, the row attended alone, whatever its key count
    (quads, tails, a shorter row first or second), its hidden keys (a tree's siblings), or q's row stride (the query
    heads of a fused QKV row); a row of another sequence stays alone."""
    kernel = load_kernel()
    if not kernel.attention_pairs(1):
        pytest.skip("AVX-512 is off here (a CPU without AVX-512F/VL, or LAB_BLOCKS_AVX512=0): rows go one at a time")
    generator = torch.Generator().manual_seed(0)
    kv_heads, num_blocks = 2, 40
    k_store = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    v_store = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    mine, other = torch.randperm(num_blocks, generator=generator)[:24].view(2, 12)
    tables = torch.stack([mine] * 4 + [other, mine]).contiguous()
    try:
        for context in (1, 3, 8, 16, 37):
            lens = torch.tensor([context + 1, context + 2, context + 4, context + 3, context + 2, context + 1])
            hidden = torch.tensor([0, 0b10, 0b1010, 0b110, 0, 0b10 * (context > 1)])
            for keys_hidden in (torch.empty(0, dtype=torch.long), hidden):
                fused = torch.randn(6, kv_heads * group + 3, head_dim, generator=generator)
                q = fused[:, :kv_heads * group].view(6, kv_heads, group, head_dim)          # rows apart
                outs = []
                for pairs in (1, 0):
                    kernel.attention_pairs(pairs)
                    out = torch.empty(q.shape)
                    kernel.paged_decode(q, k_store, v_store, tables, lens, keys_hidden, 1 / math.sqrt(head_dim), out)
                    outs.append(out)
                assert torch.equal(outs[0], outs[1])
    finally:
        kernel.attention_pairs(1)


def test_moving_a_path_natively_reads_every_source_before_writing() -> None:
    """BlockKVCache.move_tokens (a tree's accepted path moved to a chain's positions) in one native call equals
    index_select then index_copy_ on every layer's K and V, also where a destination is a later move's source."""
    if load_kernel() is None:
        pytest.skip("the native kernel cannot be built here")
    cache = BlockKVCache(3, 2, 8, num_blocks=6, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for seed, store in enumerate(cache.k + cache.v):
        store.copy_(torch.randn(store.shape, generator=torch.Generator().manual_seed(seed)))
    expected = [store.clone() for store in cache.k + cache.v]
    table, src, dst = [4, 1, 3], [5, 2, 9], [2, 7, 3]     # NOTE: position 2 is written by one move, read by the next
    slots = [[table[p // 4] * 4 + p % 4 for p in positions] for positions in (src, dst)]
    for store in expected:
        flat = store.view(2, -1, 8)
        flat.index_copy_(1, torch.tensor(slots[1]), flat.index_select(1, torch.tensor(slots[0])))
    cache.move_tokens(table, src, dst)
    assert all(torch.equal(store, want) for store, want in zip(cache.k + cache.v, expected))
