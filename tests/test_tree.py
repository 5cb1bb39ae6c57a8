"""A tree of drafts (lab/spec/tree.py): its shape helpers, its attention (a node sees the context, its ancestors and
itself, in every backend, and the native kernel's hidden keys equal a plain attention over the keys it sees), and a
tree whose accepted path leaves the chain has its keys moved where a chain's would be. Engine-level losslessness
with trained drafters is in test_drafters.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lab.engines.ar import AREngine
from lab.engines.speculative import SpeculativeEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig, PagedKVCacheManager, SlotKVCacheConfig
from lab.kv_cache.block_kv import BlockKVCache, SeqSlice
from lab.kv_cache.tree_mask import tree_layout
from lab.kv_cache.native_attention import MAX_KERNEL_QUERY_TOKENS, NativeMeta, load_kernel
from lab.runner import ModelRunner
from lab.sample.rejection import RejectionSampler
from lab.sched import SchedulerConfig
from lab.spec.dflash import DFlashProposerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.proposer import Draft
from lab.spec.tree import (ROOT, DraftTree, chain_parents, depths, graft_chain, likeliest, likeliest_paths,
                           marginal_tree, subtree, walk_greedy, with_siblings)
from tests.helpers import make_requests

needs_kernel = pytest.mark.skipif(load_kernel() is None, reason="the native kernels need a compiler and AVX2")


def test_a_chain_plus_runners_up_is_a_depth_first_tree() -> None:
    tokens, parents = with_siblings([7, 8, 9], [7, 4, 5, 4])     # the best (7) is the chain's; 4 only once
    assert tokens == [7, 8, 9, 4, 5] and parents == [ROOT, 0, 1, ROOT, ROOT]
    assert depths(parents) == [1, 2, 3, 1, 1] and depths(chain_parents(3)) == [1, 2, 3]
    assert with_siblings([], [3, 4]) == ([], [])
    # DFlash's tails: the chain's later tokens under every runner-up too
    assert with_siblings([7, 8, 9], [4], tails=True) == ([7, 8, 9, 4, 8, 9], [ROOT, 0, 1, ROOT, 3, 4])
    assert subtree(tokens, parents, [d <= 1 for d in depths(parents)]) == ([7, 4, 5], [ROOT, ROOT, ROOT])
    assert subtree(tokens, parents, [d <= 2 for d in depths(parents)]) == ([7, 8, 4, 5], [ROOT, 0, ROOT, ROOT])
    with pytest.raises(ValueError, match="kept without its parent"):
        subtree(tokens, parents, [False, True, True, True, True])
    draft = Draft([7, 8, 9, 4], None, [ROOT, 0, 1, ROOT])
    draft.fit(2, 10)
    assert draft.token_ids == [7, 8, 4] and draft.parents == [ROOT, 0, ROOT]
    draft.fit(2, 2)   # NOTE: 2 tokens of room: no more nodes than that, whatever their depth
    assert draft.token_ids == [7, 8] and draft.parents == [ROOT, 0]
    chain = Draft([1, 2, 3])
    chain.fit(2, 10)
    assert chain.token_ids == [1, 2] and chain.parents is None
    with pytest.raises(ValueError, match="parents must come before"):
        depths([ROOT, 1])


def test_a_draft_tree_keeps_the_chain_and_the_likeliest_others() -> None:
    tree = DraftTree()
    tree.grow([(ROOT, 5, .6), (ROOT, 7, .3), (ROOT, 9, .1)], width=2, min_prob=0.0, chain=(ROOT, 5, .6))
    assert tree.token_ids == [5, 7] and tree.frontier == [0, 1] and tree.chain_tip == 0
    # depth 2: 5's children at .6 x .5 and .6 x .2, 7's at .3 x .9: the chain's, then the likelier other
    tree.grow([(0, 1, .3), (0, 2, .12), (1, 3, .27)], width=2, min_prob=0.2, chain=(0, 1, .3))
    assert tree.token_ids == [5, 7, 1, 3] and tree.parents == [ROOT, ROOT, 0, 1] and tree.chain_tip == 2
    assert tree.depth_first()[:2] == ([5, 1, 7, 3], [ROOT, 0, ROOT, 2])   # the chain leads
    assert tree.depth_first()[2] == pytest.approx([.6, .3, .3, .27])
    tree.grow([(2, 4, .05), (3, 6, .25)], width=2, min_prob=0.1, chain=None)   # the gate stopped the chain
    assert tree.frontier == [4] and tree.token_ids[4] == 6 and tree.chain_tip is None


def test_a_tree_of_the_likeliest_paths_is_built_best_first() -> None:
    """marginal_tree: each position's candidates (token, probability); a path's probability is the product of its
    tokens'. The N likeliest paths, depth first with the likelier child first, so the greedy chain leads."""
    candidates = [[(10, .6), (11, .3), (12, .1)], [(20, .5), (21, .4)], [(30, .9), (31, .1)]]
    # best first: 10 (.6), 10-20 (.3), 11 (.3), 10-20-30 (.27), 10-21 (.24), 10-21-30 (.216), 11-20 (.15), ...
    tokens, parents, probs = marginal_tree(candidates, 5)
    assert tokens == [10, 20, 30, 21, 11] and parents == [ROOT, 0, 1, 0, ROOT]
    assert probs == pytest.approx([.6, .3, .27, .24, .3])
    assert marginal_tree(candidates, 1)[:2] == ([10], [ROOT])
    assert len(marginal_tree(candidates, 100)[0]) == 3 + 3 * 2 + 3 * 2 * 2   # every path, at most that many
    assert marginal_tree(candidates, 100, min_prob=0.25)[:2] == ([10, 20, 30, 11], [ROOT, 0, 1, ROOT])
    assert marginal_tree([], 5) == ([], [], []) and marginal_tree([[(7, 1.0)]], 5)[:2] == ([7], [ROOT])
    # redrafts: the paths through a redrafted path take their later tokens from its redraft, the deepest along them:
    # 10's subtree from (10,)'s, except 10-21's from (10, 21)'s; 11's from (11,)'s; 12's from the block's own
    redrafts = {(10,): [[(20, .5), (21, .4)], [(30, .9)]], (11,): [[(25, .9)], [(35, 1.0)]], (10, 21): [[(33, .5)]]}
    grown = marginal_tree(candidates, 100, redrafts=redrafts)
    assert grown[:2] == ([10, 20, 30, 21, 33, 11, 25, 35, 12, 20, 30, 31, 21, 30, 31],
                         [ROOT, 0, 1, 0, 3, ROOT, 5, 6, ROOT, 8, 9, 9, 8, 12, 12])
    assert grown[2] == pytest.approx([.6, .3, .27, .24, .12, .3, .27, .27, .1, .05, .045, .005, .04, .036, .004])
    assert likeliest_paths(*grown, depth=2, count=2) == [(10, 20), (11, 25)]   # .3 and .27, not 10-21's .24
    assert likeliest_paths(*grown, depth=1, count=9) == [(10,), (11,), (12,)]
    # NOTE: every path's probability is at most its parent's, so the likeliest nodes are a tree
    assert likeliest(parents, probs, 3) == [True, True, False, False, True]
    draft = Draft(tokens, None, parents, path_probs=probs)
    draft.fit(3, 4)   # 4 tokens of room: the 4 likeliest, not the depth-first prefix [10, 20, 30, 21]
    assert draft.token_ids == [10, 20, 30, 11] and draft.parents == [ROOT, 0, 1, ROOT]
    assert draft.path_probs == pytest.approx([.6, .3, .27, .3])
    draft.fit(1, 4)
    assert draft.token_ids == [10, 11] and draft.parents == [ROOT, ROOT]


def test_a_grafted_chain_follows_the_tree_then_branches_off_and_is_kept_whole() -> None:
    """graft_chain: another proposer's chain (suffix decoding's) joins a tree: it reuses the nodes that spell it and
    goes on as new nodes, each as likely as its parent; cut back to max_nodes, the tree's least likely nodes leave."""
    candidates = [[(10, .6), (11, .3), (12, .1)], [(20, .5), (21, .4)], [(30, .9), (31, .1)]]
    tokens, parents, probs = marginal_tree(candidates, 5)   # 10-20-30, 10-21, 11 (see above)
    grown, grown_parents, grown_probs, grafted = graft_chain(tokens, parents, probs, [10, 21, 40, 41], 7)
    assert grafted == 2 and len(grown) == 7
    paths = {tuple(prefix) for prefix in _paths(grown, grown_parents)}
    assert {(10, 20, 30), (10, 21, 40, 41), (11,)} <= paths
    assert grown_probs[grown.index(41)] == pytest.approx(.24)   # 10-21's, handed down
    # NOTE: 5 nodes + 2 grafted, cut to 6: the least likely node off the chain (10-20-30, .27) leaves
    cut_tokens, cut_parents, _, _ = graft_chain(tokens, parents, probs, [10, 21, 40, 41], 6)
    assert {tuple(p) for p in _paths(cut_tokens, cut_parents)} == {(10, 20), (10, 21, 40, 41), (11,)}
    # NOTE: cut to 3: the chain's first 3 tokens alone, above the tree's likeliest nodes
    assert graft_chain(tokens, parents, probs, [10, 21, 40, 41], 3)[:2] == ([10, 21, 40], [ROOT, 0, 1])
    assert graft_chain(tokens, parents, probs, [11], 5) == (tokens, parents, probs, 0)   # already there
    assert graft_chain([], [], [], [5, 6], 4)[:3] == ([5, 6], [ROOT, 0], [1.0, 1.0])


def test_a_chain_grafted_by_confidence_competes_with_the_tree_node_by_node() -> None:
    """graft_chain with chain_probs (engine.proposer.graft_by_confidence): each chain node ranks by the chain's own
    path probability (the larger where the tree has it too), so an unsure chain tail gives way to likelier tree
    nodes, and a sure chain lifts the tree's nodes it runs through."""
    candidates = [[(10, .6), (11, .3), (12, .1)], [(20, .5), (21, .4)], [(30, .9), (31, .1)]]
    tokens, parents, probs = marginal_tree(candidates, 5)   # 10-20-30 (.6, .3, .27), 10-21 (.24), 11 (.3)
    chain, chain_probs = [10, 21, 40, 41], [.9, .5, .2, .05]
    grown, grown_parents, grown_probs, grafted = graft_chain(tokens, parents, probs, chain, 7, chain_probs)
    assert grafted == 2 and len(grown) == 7
    ranked = dict(zip(grown, grown_probs))
    assert ranked[10] == pytest.approx(.9) and ranked[21] == pytest.approx(.5) and ranked[41] == pytest.approx(.05)
    # NOTE: cut to 6, the chain's last token (.05) leaves, where chain-first would drop 10-20-30 (.27)
    cut_tokens, cut_parents, _, _ = graft_chain(tokens, parents, probs, chain, 6, chain_probs)
    assert {tuple(p) for p in _paths(cut_tokens, cut_parents)} == {(10, 20, 30), (10, 21, 40), (11,)}
    # NOTE: cut to 4: 10 (.9), 21 (.5), then 20 and 11 (.3 each) above the chain's 40 (.2)
    cut_tokens, cut_parents, _, _ = graft_chain(tokens, parents, probs, chain, 4, chain_probs)
    assert {tuple(p) for p in _paths(cut_tokens, cut_parents)} == {(10, 20), (10, 21), (11,)}
    assert graft_chain(tokens, parents, probs, chain, 4)[:2] == ([10, 21, 40, 41], [ROOT, 0, 1, 2]), "chain first"


def _paths(token_ids: list[int], parents: list[int]) -> list[list[int]]:
    """The path from the root to each leaf."""
    leaves = set(range(len(parents))) - set(parents)
    out = []
    for leaf in sorted(leaves):
        path, node = [], leaf
        while node != ROOT:
            path.append(token_ids[node])
            node = parents[node]
        out.append(path[::-1])
    return out


def test_greedy_walk_follows_the_child_the_target_picks() -> None:
    tokens, parents = [7, 8, 9, 4, 5], [ROOT, 0, 1, ROOT, ROOT]
    # rows: root, 7, 8, 9, 4, 5; the target's token at each
    assert walk_greedy([7, 8, 9, 1, 0, 0], tokens, parents) == ([0, 1, 2], 1)   # the whole chain, then a bonus
    assert walk_greedy([5, 0, 0, 0, 0, 6], tokens, parents) == ([4], 6)         # a runner-up, then its row's token
    assert walk_greedy([7, 3, 0, 0, 0, 0], tokens, parents) == ([0], 3)
    assert walk_greedy([2, 0, 0, 0, 0, 0], tokens, parents) == ([], 2)
    logits = torch.full((6, 10), -1.0)
    for row, token in enumerate([5, 0, 0, 0, 0, 6]):
        logits[row, token] = 1.0
    result = RejectionSampler.verify_tree_greedy(logits, tokens, parents)
    assert result.token_ids == [5, 6] and result.num_accepted == 1 and result.path == [4]


def test_tree_layout_gives_depths_and_the_keys_each_token_does_not_see() -> None:
    # root, a (root's), a's child, b (root's), c (root's)
    depth, hidden = tree_layout((0, 1, 0, 0))
    assert depth == [0, 1, 2, 1, 1]
    # bit i of hidden[j]: token j does not see token j - i
    assert hidden == [0, 0, 0, 0b110, 0b1110]   # b hides a's child and a; c hides b, a's child and a
    # a drafter's candidates: tokens 0 and 1 both hang on the context, 2 under 1
    assert tree_layout((-1, 1)) == ([0, 0, 1], [0, 0b10, 0b100])
    with pytest.raises(ValueError, match="parent must come before"):
        tree_layout((0, 3))


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q (Hq, D), keys/values (S, Hkv, D) -> (Hq, D): plain attention over exactly these keys."""
    group = q.shape[0] // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(group, 0)                                   # (Hq, S, D)
    v = values.transpose(0, 1).repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q[:, None], k, v)[:, 0]


def _attend(backend: str, seqs: list[SeqSlice]) -> tuple[BlockKVCache, torch.Tensor]:
    """One layer's attention over `seqs` in a fresh 40-block cache of random keys (6 query heads, 2 KV heads):
    the cache and every query token's output (N, Hq, D), each checked against plain attention over the context,
    its ancestors and itself."""
    if backend == "native" and load_kernel() is None:
        pytest.skip("the native kernels need a compiler and AVX2")
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 40
    num_tokens = sum(s.num_query_tokens for s in seqs)
    q = torch.randn(1, num_tokens, heads, head_dim, generator=generator)
    k = torch.randn(1, num_tokens, kv_heads, head_dim, generator=generator)
    v = torch.randn(1, num_tokens, kv_heads, head_dim, generator=generator)
    cache = BlockKVCache(1, kv_heads, head_dim, num_blocks, block_size, torch.float32, torch.device("cpu"), backend)
    stores = torch.Generator().manual_seed(1)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=stores))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=stores))
    cache.begin_step(seqs)
    out = cache.attend(0, q, k, v)[0]                                                       # (N, Hq, D)

    def stored(seq: SeqSlice, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.tensor([seq.block_table[p // block_size] * block_size + p % block_size for p in positions])
        flat = (kv_heads, -1, head_dim)
        return (cache.k[0].view(flat)[:, slots].transpose(0, 1), cache.v[0].view(flat)[:, slots].transpose(0, 1))

    row = 0
    for seq in seqs:
        parents = (seq.tree if seq.tree is not None else tuple(range(seq.num_query_tokens - 1)))
        for j in range(seq.num_query_tokens):
            seen, node = [], j
            while True:
                seen.append(node)
                if node == 0:
                    break
                node = parents[node - 1]
            positions = list(range(seq.num_context_tokens)) + [seq.num_context_tokens + i for i in sorted(seen)]
            keys, values = stored(seq, positions)
            torch.testing.assert_close(out[row], _reference(q[0, row], keys, values), atol=1e-5, rtol=1e-5)
            row += 1
    return cache, out


@pytest.mark.parametrize("backend", ["native", "gather", "fast"])
def test_a_tree_step_attends_each_token_to_its_ancestors_only(backend: str) -> None:
    """A decode, a tree of 6 tokens (root; a chain of 2; 3 runners-up), a chain verify, a prefill chunk and a tree
    after it (which `native` leaves to SDPA with the chunk): every token's output is plain attention over the
    context, its ancestors and itself."""
    tree = (0, 1, 0, 0, 0)
    seqs = [SeqSlice([8, 2], 5, 1), SeqSlice([3, 7, 1, 9], 9, 6, tree), SeqSlice([11, 12, 13], 6, 3),
            SeqSlice([*range(14, 30), 32, 33], 6, MAX_KERNEL_QUERY_TOKENS + 1), SeqSlice([30, 31], 2, 4, (0, 0, 1))]
    cache, _ = _attend(backend, seqs)
    # NOTE: the trees' positions by depth
    assert cache.index.positions.tolist() == [5, 9, 10, 11, 10, 10, 10, 6, 7, 8, *range(6, 71), 2, 3, 3, 4]
    if backend == "native":
        assert isinstance(cache._meta, NativeMeta) and cache._meta.num_rows == 10
        assert cache._meta.hidden.tolist()[1:7] == tree_layout(tree)[1] and len(cache._meta.chunks.chunks) == 2


@pytest.mark.parametrize("backend", ["native", "gather", "fast"])
def test_side_by_side_verify_steps_attend_as_one_group(backend: str) -> None:
    """Verify steps of a batch (chains of 3 over contexts of several blocks, trees of 6, chains of 2 within one
    block each): `fast` attends each run of equal query lengths in one SDPA call, with the query heads folded over
    the mask, and every token still sees exactly its context, its ancestors and itself."""
    tree = (0, 1, 0, 0, 0)
    seqs = [SeqSlice([1, 2, 3], 9, 3), SeqSlice([4, 5], 5, 3), SeqSlice([6, 7, 8, 10], 12, 3),
            SeqSlice([13, 14, 15], 3, 6, tree), SeqSlice([16, 17, 18], 5, 6, tree),
            SeqSlice([22], 1, 2), SeqSlice([23], 2, 2), SeqSlice([25, 26, 27], 7, 4)]
    cache, _ = _attend(backend, seqs)
    if backend == "fast":
        groups = [(g.num_seqs, g.num_query, g.mode) for g in cache._meta.groups]
        assert groups == [(3, 3, "gather"), (2, 6, "gather"), (2, 2, "view")]
        assert [(c.q_start, c.q_end) for c in cache._meta.chunks] == [(25, 29)], "a lone verify keeps its own call"


@pytest.mark.skipif(load_kernel() is None, reason="the native kernels need a compiler and AVX2")
def test_the_kernel_refuses_to_hide_a_rows_own_key() -> None:
    q = torch.randn(1, 1, 1, 8)
    store = torch.randn(1, 2, 4, 8)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([5])
    out = torch.empty_like(q)
    for hidden in (torch.tensor([1]), torch.tensor([1 << 5])):
        with pytest.raises(RuntimeError, match="hides its own key or keys it does not have"):
            load_kernel().paged_decode(q, store, store, tables, lens, hidden, 1 / math.sqrt(8), out)


def test_a_tree_accepted_off_the_chain_moves_its_keys_where_a_chain_would_have_them(
        tiny_runner: ModelRunner) -> None:
    """A runner-up accepted (an untrained drafter's, a few times in 6 x 24 tokens): the output is still the target's,
    and the cache holds exactly the keys `ar`'s prefill of the same tokens computes."""
    prompts = [torch.randint(3, 128, (4 + (7 * i) % 23,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(6)]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    kv = PagedKVCacheConfig(block_size=4, num_blocks=512, kv_cache_memory_mb=None)
    engine = SpeculativeEngine(tiny_runner, EagleProposerConfig(checkpoint=None, tree_width=4, draft_vocab_size=0),
                               num_spec_tokens=2, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                               kv_cache=kv)
    moved = []
    real_move = engine.kv_cache.move_tokens

    def check_move(table: list[int], src: list[int], dst: list[int]) -> None:
        moved.append((src, dst))
        real_move(table, src, dst)

    engine.kv_cache.move_tokens = check_move
    assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
    stats = engine.stats()
    assert stats["spec/tree_off_chain_accepts"] == len(moved) > 0, stats
    assert all(s != d for src, dst in moved for s, d in zip(src, dst))


def test_trees_never_need_more_kv_than_the_request_itself(tiny_runner: ModelRunner) -> None:
    """Slots of exactly prompt + max_tokens - 1 tokens: near its end a request's tree is cut to the tokens it has room
    for (a depth-first prefix, the chain first), so the last steps still fit and the output is `ar`'s."""
    prompt, max_tokens = [5, 9, 17, 33, 2, 8, 40, 41], 20
    expected = AREngine(tiny_runner).run(make_requests([prompt], max_tokens, ignore_eos=True)).requests[0]
    kv = SlotKVCacheConfig(max_len=len(prompt) + max_tokens - 1, num_slots=1)
    engine = SpeculativeEngine(tiny_runner, EagleProposerConfig(checkpoint=None, tree_width=4, draft_vocab_size=0),
                               num_spec_tokens=3, scheduler=SchedulerConfig(max_num_seqs=1), kv_cache=kv)
    served = engine.run(make_requests([prompt], max_tokens, ignore_eos=True)).requests[0]
    assert served.output_token_ids == expected.output_token_ids and engine.stats()["sched/num_preemptions"] == 0


def test_a_sampling_request_drafts_a_chain_and_bad_widths_name_the_key(tiny_runner: ModelRunner) -> None:
    """Trees are for greedy requests: with sampling, tree_width changes nothing (the same seeded output)."""
    prompts = [[5, 9, 17, 33, 2, 8], [4, 4, 12, 90, 61]]
    outputs = []
    for width in (1, 3):
        engine = SpeculativeEngine(tiny_runner, DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4},
                                                                      tree_width=width, draft_vocab_size=0),
                                   num_spec_tokens=2, kv_cache=PagedKVCacheConfig(block_size=4, num_blocks=64,
                                                                                  kv_cache_memory_mb=None))
        requests = make_requests(prompts, 12, ignore_eos=True, temperature=0.8, seed=5)
        outputs.append([r.output_token_ids for r in engine.run(requests).requests])
        assert engine.stats()["spec/tree_off_chain_accepts"] == 0
    assert outputs[0] == outputs[1]
    for width in (0, 9):
        with pytest.raises(LabError, match="tree_width must be 1"):
            EagleProposerConfig(checkpoint=None, tree_width=width).build(tiny_runner, PagedKVCacheManager(64, 4))
    with pytest.raises(LabError, match="tree_min_prob must be in"):
        DFlashProposerConfig(checkpoint=None, tree_width=2, tree_min_prob=1.5).build(tiny_runner,
                                                                                    PagedKVCacheManager(64, 4))
    for bad, match in (({"tree_nodes": 63}, "tree_nodes must be 0"), ({"tree_nodes": 8, "tree_width": 2}, "two tree"),
                       ({"tree_nodes": 8, "tree_tails": True}, "two tree"),
                       ({"tree_nodes": 8, "denoise_steps": 2}, "one forward"),
                       ({"tree_nodes": 8, "tree_redraft": 9}, "to tree_nodes \\(8\\), got 9"),
                       ({"tree_redraft": 2}, "tree_nodes too"),
                       ({"tree_nodes": 8, "tree_redraft": 2}, "trained without given tokens"),
                       ({"tree_nodes": 8, "tree_redraft_levels": 0}, "tree_redraft_levels must be >= 1"),
                       ({"tree_nodes": 8, "tree_redraft_levels": 2}, "tree_redraft \\(the paths")):
        with pytest.raises(LabError, match=match):
            DFlashProposerConfig(checkpoint=None, **bad).build(tiny_runner, PagedKVCacheManager(64, 4))
    with pytest.raises(LabError, match="more than a verify step's tree holds"):   # a beam of 8 x 8 drafts
        SpeculativeEngine(tiny_runner, EagleProposerConfig(checkpoint=None, tree_width=8), num_spec_tokens=8,
                          kv_cache=PagedKVCacheConfig(block_size=4, num_blocks=64, kv_cache_memory_mb=None))


def test_tree_min_prob_keeps_only_the_runners_up_the_drafter_believes_in(tiny_runner: ModelRunner) -> None:
    """tree_min_prob 1: no runner-up is ever that likely, so the tree is the chain (the same drafts, token for
    token); 0: every runner-up; in between: some."""
    prompts = [[5, 9, 17, 33, 2, 8], [4, 4, 12, 90, 61], [7, 1, 3]]
    drafted = {}
    for width, min_prob in ((1, 0.0), (4, 1.0), (4, 0.0), (4, 0.02)):
        engine = SpeculativeEngine(tiny_runner, EagleProposerConfig(checkpoint=None, tree_width=width,
                                                                     tree_min_prob=min_prob, draft_vocab_size=0),
                                   num_spec_tokens=2, kv_cache=PagedKVCacheConfig(block_size=4, num_blocks=64,
                                                                                  kv_cache_memory_mb=None))
        engine.run(make_requests(prompts, 12, ignore_eos=True))
        stats = engine.stats()
        drafted[width, min_prob] = (stats["spec_decode_draft_tokens"], stats["spec_decode_accepted_tokens"])
    assert drafted[4, 1.0] == drafted[1, 0.0]
    assert drafted[1, 0.0][0] < drafted[4, 0.02][0] < drafted[4, 0.0][0], drafted
