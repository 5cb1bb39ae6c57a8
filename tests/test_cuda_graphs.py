"""Fixed-shape decode steps (the CUDA-graph path, lab/runner/cuda_graphs.py): on CPU in `eager` mode, the
padded, bucketed, static-attention step gives every request `ar`'s greedy tokens; on CUDA (the `gpu`
marker) the captured graphs replay to the same tokens as the eager engine."""

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
from tests.conftest import compose_cfg
from tests.helpers import make_requests
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
    requests = make_requests(prompts, MAX_TOKENS, ignore_eos=True)
    for i, request in enumerate(requests):
        request.arrival_time = 0.003 * i   # NOTE: staggered, so decode steps of many sizes occur
    engine = graph_engine(tiny_runner, kv, "eager")
    result = engine.run(requests)
    for request, reference in zip(result.requests, references):
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
    logits = graphs.run(torch.tensor([[7]]), cache.index)
    assert logits.shape == (1, tiny_runner.vocab_size)
    for layer, (old, new) in enumerate(zip(before, cache.k)):
        changed = (old != new).any(dim=(0, 2, 3)).nonzero().flatten().tolist()   # blocks written
        assert set(changed) <= {4, 6}, f"layer {layer} wrote blocks {changed}"


def test_bad_graph_settings_name_the_fix(tiny_runner: ModelRunner) -> None:
    with pytest.raises(LabError, match="mode=cuda needs a CUDA device"):
        graph_engine(tiny_runner, "paged", "cuda")
    with pytest.raises(LabError, match="unknown engine.cuda_graphs.mode"):
        graph_engine(tiny_runner, "paged", "always")
    with pytest.raises(LabError, match="no size >= 1"):
        graph_engine(tiny_runner, "paged", "eager", sizes=(0,))
    cache = tiny_runner.allocate_block_kv_cache(4, 4)
    with pytest.raises(LabError, match="scratch block"):
        StaticDecodeView(cache, 2, 2)


def test_hydra_engine_has_graphs_off_on_cpu_by_default(tiny_runner: ModelRunner, tmp_path) -> None:
    cfg = compose_cfg(["model=tiny", "engine=cb_paged", f"hydra.run.dir={tmp_path}"])
    assert cfg.engine.cuda_graphs.mode == "auto"
    assert instantiate(cfg.engine, runner=tiny_runner).decode_graphs is None
    cfg = compose_cfg(["model=tiny", "engine=cb_slots", "engine.cuda_graphs.mode=eager", f"hydra.run.dir={tmp_path}"])
    assert instantiate(cfg.engine, runner=tiny_runner).decode_graphs.mode == "eager"


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
