"""Fixed-shape decode and verify steps (the CUDA-graph path, lab/runner/cuda_graphs.py): on CPU in `eager`
mode, the padded, bucketed, static-attention step gives every request `ar`'s greedy tokens, plain and
speculative (1 + k tokens a request, padded where a request has fewer drafts, features for the drafters that
read them); on CUDA (the `gpu` marker) the captured graphs replay to the same tokens as the eager engine."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig, SeqSlice, SlotKVCacheConfig
from lab.kv_cache.static_decode import StaticDecodeView
from lab.models.sources import tiny
from lab.runner import ModelRunner
from lab.runner.cuda_graphs import CudaGraphConfig, DecodeGraphs
from lab.sched import SchedulerConfig
from lab.spec.dflash import DFlashProposerConfig
from lab.spec.draft_model import DraftModelProposerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.ngram_config import NgramProposerConfig
from lab.engines.speculative import SpeculativeEngine
from tests.conftest import compose_cfg
from tests.helpers import make_requests, run_one_arrival_per_step
from tests.test_continuous_batching import assert_matches_ar, assert_nothing_held, random_prompts

MAX_TOKENS = 12


def graph_engine(runner: ModelRunner, kv: str, mode: str, sizes: tuple[int, ...] = (1, 2, 4, 8)
                 ) -> ContinuousBatchingEngine:
    kv_cache = (PagedKVCacheConfig(block_size=4, num_blocks=200) if kv == "paged"
                else SlotKVCacheConfig(max_len=96))
    return ContinuousBatchingEngine(runner, SchedulerConfig(8, 64), kv_cache,
                                    cuda_graphs=CudaGraphConfig(mode=mode, capture_sizes=sizes))


@pytest.mark.parametrize("kv", ["paged", "slots"])
def test_eager_fixed_shape_decode_equals_ar(kv: str, tiny_runner: ModelRunner) -> None:
    prompts = random_prompts(11, tiny_runner.vocab_size, seed=11, max_len=40)
    references = [r.output_token_ids for r in AREngine(tiny_runner).run(
        make_requests(prompts, MAX_TOKENS, ignore_eos=True)).requests]
    engine = graph_engine(tiny_runner, kv, "eager")
    # NOTE: one arrival a step (not by clock, which a fast machine outruns), so decode steps of many sizes occur
    served = run_one_arrival_per_step(engine, make_requests(prompts, MAX_TOKENS, ignore_eos=True))
    for request, reference in zip(served, references):
        assert_matches_ar(tiny_runner, request, reference, f"{kv}/eager graphs")
    assert_nothing_held(engine)
    stats = engine.stats()
    assert stats["cuda_graph/replays"] > 0 and stats["cuda_graph/num_graphs"] >= 2
    assert 0.0 <= stats["cuda_graph/padded_row_share"] < 1.0


def test_buckets_pad_rows_to_capture_sizes_and_tables_to_powers_of_two(tiny_runner: ModelRunner) -> None:
    engine = graph_engine(tiny_runner, "paged", "eager", sizes=(1, 2, 4, 8, 64))
    graphs = engine.decode_graphs
    assert graphs.capture_sizes == [1, 2, 4, 8], "sizes above max_num_seqs=8 are capped"
    assert graphs.bucket(3, 5) == (4, 8) and graphs.bucket(1, 1) == (1, 1) and graphs.bucket(8, 9) == (8, 16)
    assert graphs.bucket(2, graphs.max_block_cols) == (2, graphs.max_block_cols)
    assert graphs.fits(8) and not graphs.fits(9)


def test_padding_rows_write_only_the_scratch_block(tiny_runner: ModelRunner) -> None:
    cache = tiny_runner.allocate_block_kv_cache(6, 4, scratch_block=True)
    cache.begin_step([SeqSlice([2, 4], 5, 1)], prepare_backend=False)   # one request, position 5: block 4, slot 1
    view = StaticDecodeView(cache, num_rows=4, num_block_cols=4)
    view.load(torch.tensor([7]), cache.index)
    assert view.slot_mapping.tolist() == [17, 24, 24, 24]   # block 4 * 4 + 1, then the scratch block 6 * 4
    assert view.seq_lens.tolist() == [6, 1, 1, 1]
    assert view.block_tables[0].tolist() == [2, 4, 6, 6] and view.block_tables[1:].eq(6).all()
    before = [k.clone() for k in cache.k]
    graphs = DecodeGraphs(tiny_runner.model, cache, CudaGraphConfig(mode="eager"), 4, 64)
    logits, features = graphs.run(torch.tensor([[7]]), cache.index)
    assert logits.shape == (1, tiny_runner.vocab_size) and features is None
    for layer, (old, new) in enumerate(zip(before, cache.k)):
        changed = (old != new).any(dim=(0, 2, 3)).nonzero().flatten().tolist()   # blocks written
        assert set(changed) <= {4, 6}, f"layer {layer} wrote blocks {changed}"


def test_a_verify_step_in_the_static_view_gives_the_eager_logits_and_features(tiny_runner: ModelRunner) -> None:
    """Two requests past their prompts verify 3 and 1 tokens in a 4-row view of 3-token queries: each token's
    logits and features are the eager varlen forward's; the padding (2 queries of the second row, rows 2-3)
    writes only the scratch block."""
    cache = tiny_runner.allocate_block_kv_cache(8, 4, scratch_block=True)
    tables, contexts = [[0, 1, 2], [3, 4]], [5, 6]
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 128, (1, sum(contexts)), generator=generator)
    cache.begin_step([SeqSlice(t, 0, n) for t, n in zip(tables, contexts)])
    tiny_runner.execute(prompt_ids, cache.index.positions[None], cache, None)                  # the prompts
    step = [SeqSlice(tables[0], contexts[0], 3), SeqSlice(tables[1], contexts[1], 1)]
    input_ids = torch.randint(3, 128, (1, 4), generator=generator)
    layers = (0, -1)
    graphs = DecodeGraphs(tiny_runner.model, cache, CudaGraphConfig(mode="eager", capture_sizes=(4,)), 4, 64)
    graphs.configure(3, layers)
    cache.begin_step(step, prepare_backend=False)
    before = [k.clone() for k in cache.k]
    logits, features = graphs.run(input_ids, cache.index)                                         # (4, V), (4, F)
    view = graphs._graphs[(4, 4, 3)].view
    assert view.token_rows(cache.index).tolist() == [0, 1, 2, 3]
    assert view.slot_mapping.tolist()[:6] == [5, 6, 7, 18, 32, 32] and set(view.slot_mapping.tolist()[6:]) == {32}
    assert view.positions.tolist()[0][:4] == [5, 6, 7, 6]
    for layer, (old, new) in enumerate(zip(before, cache.k)):
        changed = (old != new).any(dim=(0, 2, 3)).nonzero().flatten().tolist()
        assert set(changed) <= {1, 4, 8}, f"layer {layer} wrote blocks {changed}"   # row 0, row 1, the scratch block
    cache.begin_step(step)
    eager_logits, eager_features = tiny_runner.execute_with_features(input_ids, cache.index.positions[None], cache,
                                                                     torch.arange(4), layers)
    torch.testing.assert_close(logits, eager_logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(features, eager_features[0], rtol=1e-4, atol=1e-4)


def _spec_proposers(tiny_source) -> dict:
    return {"draft_equals_target": DraftModelProposerConfig(source=tiny_source),
            "ngram": NgramProposerConfig(min_n=1, max_n=3),
            "eagle": EagleProposerConfig(checkpoint=None),
            "dflash": DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4}),
            # NOTE: trees of drafts: verify steps whose mask hides each node's siblings
            "dflash_tree": DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4}, tree_width=3,
                                                draft_vocab_size=0),
            "eagle_tree": EagleProposerConfig(checkpoint=None, tree_width=2, draft_vocab_size=0),
            "dflash_tails": DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4}, tree_width=2,
                                                 tree_tails=True, draft_vocab_size=0),
            # NOTE: a tree of the block's likeliest paths: every position's candidates out of the block graph
            "dflash_paths": DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4}, tree_nodes=10,
                                                 draft_vocab_size=0),
            # NOTE: three denoising steps in one block graph (the drafts kept so far filled in)
            "dflash_denoise": DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4, "max_fill": 2},
                                                   denoise_steps=3)}


def spec_graph_engine(runner: ModelRunner, proposer, mode: str, max_num_seqs: int) -> SpeculativeEngine:
    return SpeculativeEngine(runner, proposer, num_spec_tokens=3,
                             scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                             kv_cache=PagedKVCacheConfig(block_size=4, num_blocks=200, kv_cache_memory_mb=None),
                             cuda_graphs=CudaGraphConfig(mode=mode, capture_sizes=(1, 2, 4)))


@pytest.mark.parametrize("proposer, max_num_seqs", [("draft_equals_target", 1), ("draft_equals_target", 4),
                                                   ("ngram", 4), ("eagle", 1), ("dflash", 4), ("dflash_tree", 4),
                                                   ("eagle_tree", 2), ("dflash_tails", 1), ("dflash_denoise", 4),
                                                   ("dflash_paths", 2)])
def test_eager_fixed_shape_verify_steps_equal_ar(proposer: str, max_num_seqs: int, tiny_source,
                                                 tiny_runner: ModelRunner) -> None:
    prompts = [p * 2 for p in random_prompts(6, tiny_runner.vocab_size, seed=5, max_len=12)]   # repeats: n-gram drafts
    references = [r.output_token_ids for r in AREngine(tiny_runner).run(
        make_requests(prompts, MAX_TOKENS, ignore_eos=True)).requests]
    engine = spec_graph_engine(tiny_runner, _spec_proposers(tiny_source)[proposer], "eager", max_num_seqs)
    requests = make_requests(prompts, MAX_TOKENS, ignore_eos=True)
    for i, request in enumerate(requests):
        request.arrival_time = 0.003 * i
    result = engine.run(requests)
    assert [r.output_token_ids for r in result.requests] == references, f"{proposer} in graphs changed the output"
    stats = engine.stats()
    query_lens = {key[2] for key in engine.decode_graphs._graphs}
    assert max(query_lens) > 1 and stats["spec_decode_num_drafts"] > 0, (query_lens, stats)
    assert stats["cuda_graph/replays"] > 0
    if proposer == "draft_equals_target":
        assert stats["spec_decode_acceptance_rate"] == pytest.approx(100.0)
    if proposer == "ngram":
        assert stats["cuda_graph/padded_row_share"] > 0   # requests with fewer drafts than the longest
    if proposer.startswith("dflash"):
        assert stats["spec/draft_graph_replays"] == stats["spec/draft_forwards"] > 0
    if proposer == "dflash_tree":   # NOTE: 1 + 3 drafts + 2 runners-up
        assert engine.decode_graphs.max_query_len == 6 and max(query_lens) > 4, query_lens
    if proposer in ("eagle_tree", "dflash_tails"):    # NOTE: 1 + 3 depths x 2 nodes
        assert engine.decode_graphs.max_query_len == 7 and max(query_lens) > 4, query_lens
    if proposer == "dflash_paths":    # NOTE: 1 + 10 nodes
        assert engine.decode_graphs.max_query_len == 11 and max(query_lens) > 4, query_lens
    assert engine.kv_manager.num_held_blocks == 0


def test_bad_graph_settings_name_the_fix(tiny_runner: ModelRunner) -> None:
    with pytest.raises(LabError, match="mode=cuda needs a CUDA device"):
        graph_engine(tiny_runner, "paged", "cuda")
    with pytest.raises(LabError, match="unknown engine.cuda_graphs.mode"):
        graph_engine(tiny_runner, "paged", "always")
    with pytest.raises(LabError, match="no size >= 1"):
        graph_engine(tiny_runner, "paged", "eager", sizes=(0,))
    engine = graph_engine(tiny_runner, "paged", "eager")
    engine.run(make_requests(random_prompts(1, tiny_runner.vocab_size, seed=1, max_len=8), 3, ignore_eos=True))
    with pytest.raises(LabError, match="configure after graphs were captured"):
        engine.decode_graphs.configure(4)
    cache = tiny_runner.allocate_block_kv_cache(4, 4)
    with pytest.raises(LabError, match="scratch block"):
        StaticDecodeView(cache, 2, 2)


def test_hydra_engine_has_graphs_off_on_cpu_by_default(tiny_runner: ModelRunner, tmp_path) -> None:
    cfg = compose_cfg(["model=tiny", "engine=cb_paged", f"hydra.run.dir={tmp_path}"])
    assert cfg.engine.cuda_graphs.mode == "auto"
    assert instantiate(cfg.engine, runner=tiny_runner).decode_graphs is None
    cfg = compose_cfg(["model=tiny", "engine=cb_slots", "engine.cuda_graphs.mode=eager", f"hydra.run.dir={tmp_path}"])
    assert instantiate(cfg.engine, runner=tiny_runner).decode_graphs.mode == "eager"
    cfg = compose_cfg(["model=tiny", "engine=speculative", "engine.cuda_graphs.mode=eager", f"hydra.run.dir={tmp_path}"])
    engine = instantiate(cfg.engine, runner=tiny_runner)
    assert engine.decode_graphs.max_query_len == 1 + cfg.engine.num_spec_tokens
    assert engine.without_speculation().decode_graphs.max_query_len == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["paged", "slots"])
def test_cuda_graph_replays_give_the_eager_engines_tokens(kv: str) -> None:
    runner = ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), dtype="float32", device="cuda")
    prompts = random_prompts(11, runner.vocab_size, seed=11, max_len=40)
    outputs = {}
    for mode in ("off", "cuda"):
        engine = graph_engine(runner, kv, mode)
        outputs[mode] = [r.output_token_ids for r in engine.run(
            make_requests(prompts, MAX_TOKENS, ignore_eos=True)).requests]
        assert_nothing_held(engine)
    stats = engine.stats()
    assert stats["cuda_graph/replays"] > 0 and stats["cuda_graph/capture_s"] > 0
    assert outputs["cuda"] == outputs["off"]


@pytest.mark.gpu
@pytest.mark.parametrize("proposer", ["ngram", "dflash", "dflash_tree", "eagle_tree", "dflash_denoise",
                                      "dflash_paths"])
def test_cuda_graph_verify_steps_give_the_eager_engines_tokens(proposer: str) -> None:
    source = tiny(seed=0, vocab_size=128, with_tokenizer=False)
    runner = ModelRunner(source, dtype="float32", device="cuda")
    prompts = [p * 2 for p in random_prompts(6, runner.vocab_size, seed=5, max_len=12)]
    outputs = {}
    for mode in ("off", "cuda"):
        engine = spec_graph_engine(runner, _spec_proposers(source)[proposer], mode, 4)
        outputs[mode] = [r.output_token_ids for r in engine.run(
            make_requests(prompts, MAX_TOKENS, ignore_eos=True)).requests]
        assert engine.kv_manager.num_held_blocks == 0
    stats = engine.stats()
    assert stats["cuda_graph/replays"] > 0 and max(key[2] for key in engine.decode_graphs._graphs) > 1
    if proposer.startswith("dflash"):   # NOTE: its block forward replays graphs of its own (lab/spec/dflash_graphs.py)
        assert stats["spec/draft_graph_replays"] == stats["spec/draft_forwards"] > 0
    assert outputs["cuda"] == outputs["off"]


def test_a_cpu_runner_leaves_the_cuda_attention_backends_alone() -> None:
    """Only a CUDA runner turns cuDNN's attention off (process-wide); set here first, as earlier CUDA tests clear it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        runner = ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), dtype="float32", device="cpu")
        assert runner.device.type == "cpu" and torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.gpu
def test_eager_verify_steps_never_build_cudnn_attention_plans() -> None:
    """cuDNN's fused attention builds a host-side plan per shape (2.8 ms a call on the H200): eager steps, whose
    shapes change every step, must take a planless kernel instead."""
    source = tiny(seed=0, vocab_size=128, with_tokenizer=False)
    runner = ModelRunner(source, dtype="bfloat16", device="cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    engine = spec_graph_engine(runner, _spec_proposers(source)["dflash"], "off", 4)
    prompts = [p * 2 for p in random_prompts(3, runner.vocab_size, seed=5, max_len=12)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.run(make_requests(prompts, 8, ignore_eos=True))
    names = {event.name for event in prof.events()}
    assert any("scaled_dot_product" in name for name in names)
    assert not any("cudnn_attention" in name for name in names)
