"""FeatureStore: features are kept by the target's block tables, so a prefix-cache hit shares them."""

from __future__ import annotations

import torch

from lab.kv_cache import PagedKVCacheManager
from lab.request import Request, SamplingParams
from lab.spec.features import FeatureStore


def _request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=8))


def test_features_follow_the_block_table_and_a_prefix_hit_shares_them() -> None:
    kv = PagedKVCacheManager(num_blocks=8, block_size=4)
    store = FeatureStore(kv, dim=3, dtype=torch.float32, device=torch.device("cpu"))
    first = _request("a", list(range(10)))
    assert kv.allocate_slots(first, 10)
    features = torch.arange(30, dtype=torch.float32).view(10, 3)
    store.write("a", 0, features[:6])
    store.write("a", 6, features[6:])                       # NOTE: a write that straddles a block boundary
    first.num_computed_tokens = 10
    torch.testing.assert_close(store.read("a", 0, 10), features)
    torch.testing.assert_close(store.read("a", 3, 9), features[3:9])
    assert store.read("a", 4, 7).data_ptr() == store.rows.data_ptr() + kv.block_table("a")[1] * 4 * 3 * 4, \
        "within one block a read is a view"
    assert store.num_valid(first) == 10

    second = _request("b", list(range(9)) + [99])           # the first 8 tokens: two full cached blocks
    prefix = kv.find_cached_prefix(second)
    assert prefix.num_tokens == 8
    assert kv.allocate_slots(second, 2, prefix)
    second.num_computed_tokens = 8
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    torch.testing.assert_close(store.read("b", 0, 8), features[:8])   # never written for "b"
    assert store.num_valid(second) == 8

    store.move("a", [9], [8])                                # a tree's accepted node moved onto the chain's slot
    torch.testing.assert_close(store.read("a", 8, 10), features[[9, 9]])
    assert store.nbytes == 8 * 4 * 3 * 4
