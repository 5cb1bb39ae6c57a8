"""EAGLE-style and DFlash drafters: target features are what the forward computes; a few training steps
reduce the validation loss; checkpoints round-trip and refuse another target; speculation with trained
drafters is lossless (greedy) at batch 1 and > 1 with mixed lengths, and runs with sampling; the
suffix-then-EAGLE cascade is lossless; ShareGPT's recorded answers extend the training corpus."""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lab.drafters import load_drafter, target_fingerprint
from lab.drafters.dflash import DFlashConfig, DFlashDrafter
from lab.engines.ar import AREngine
from lab.engines.speculative import SpeculativeEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig, PagedKVCacheManager
from lab.kv_cache.base import NoCache
from lab.models import native_head
from lab.models.packed_linear import PackedLinear
from lab.models.sources import default_cache_dir, tiny
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.runner.cuda_graphs import CudaGraphConfig
from lab.sched import SchedulerConfig
from lab.spec.cascade import CascadeProposer, CascadeProposerConfig
from lab.spec.dflash import DFlashProposer, DFlashProposerConfig
from lab.spec.draft_model import DraftModelProposerConfig, LayerSkipProposerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.feature_proposer import ConfidenceGate, resolve_draft_weights, resolve_head_weights
from lab.spec.suffix import SuffixProposerConfig
from lab.spec.tree import ROOT
from lab.training import data as training_data
from lab.training.data import (DataConfig, Sequence, generate_responses, load_corpus, load_training_data,
                               online_features, reference_sequences, target_features)
from lab.training.losses import (CONFIDENCE_EDGES, BlockPredictions, dflash_loss, dflash_predictions, draw_fills,
                                 make_batch, on_greedy_path)
from lab.training.precision import cpu_has_bf16_matmul
from lab.training.recipe import (TrainConfig, check_drafter_options, deepen_dflash, init_from_target,
                                 train_drafter)
from lab.workloads import DatasetWorkload
from tests.conftest import compose_cfg
from tests.helpers import load_experiment, make_requests, record_drafts, run_one_arrival_per_step

KV = PagedKVCacheConfig(block_size=4, num_blocks=512, kv_cache_memory_mb=None)
OPTIONS = {"eagle": {}, "dflash": {"block_size": 4, "anchors_per_seq": 8, "gamma": 4.0, "fuse_last_context": True,
                                   "mask_per_position": True, "input_fusion": True,
                                   "start_as_identity": True}}


def _prompts(n: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (4 + (7 * i) % 23,), generator=generator).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def trained(tiny_runner: ModelRunner, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """Both drafters trained briefly on the tiny target's own greedy continuations (cache pre-seeded)."""
    cache = tmp_path_factory.mktemp("train-cache")
    data = DataConfig(num_prompts=40)
    result = AREngine(tiny_runner).run(make_requests(_prompts(40, seed=3), 40, ignore_eos=True))
    sequences = [{"token_ids": r.all_token_ids, "prompt_len": r.num_prompt_tokens} for r in result.requests]
    (cache / f"responses-{data.key()}.json").write_text(json.dumps(sequences))
    out = {}
    for kind in ("eagle", "dflash"):
        path = cache / f"{kind}.pt"
        train = TrainConfig(steps=80, batch_size=8, lr=3e-3, warmup_steps=5, max_seq_len=96, val_sequences=8,
                            log_every=1000)
        metrics = train_drafter(kind, tiny_runner, DataConfig(num_prompts=40), train, dict(OPTIONS[kind]), path,
                                "test", cache, log=lambda _: None)
        out[kind] = (path, metrics)
    # NOTE: DFlash trained on from its checkpoint with its first 0..2 offsets given as tokens (denoising steps)
    path = cache / "dflash_fill.pt"
    train = TrainConfig(steps=60, batch_size=8, lr=3e-3, warmup_steps=5, max_seq_len=96, val_sequences=8,
                        log_every=1000, init_from=str(out["dflash"][0]))
    metrics = train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), train, dict(OPTIONS["dflash"], max_fill=2),
                            path, "test", cache, log=lambda _: None)
    out["dflash_fill"] = (path, metrics)
    return out


def test_features_are_the_forward_hidden_states(tiny_runner: ModelRunner) -> None:
    ids = torch.tensor([_prompts(1, seed=0)[0]])
    positions = torch.arange(ids.shape[1])[None]
    logits, features = tiny_runner.execute_with_features(ids, positions, NoCache(), torch.tensor([ids.shape[1] - 1]),
                                                         (0, -1))
    hidden = tiny_runner.config.hidden_size
    assert features.shape == (1, ids.shape[1], 2 * hidden)
    model = tiny_runner.model
    torch.testing.assert_close(model.compute_logits(model.norm(features[0, -1:, hidden:])), logits[0])
    torch.testing.assert_close(logits[0], tiny_runner.execute(ids, positions, NoCache(), logits_index=-1))


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_a_few_training_steps_reduce_the_loss(trained: dict, kind: str) -> None:
    _, metrics = trained[kind]
    assert metrics["train/last_loss"] < 0.9 * metrics["train/first_loss"], metrics
    # NOTE: the labels are the target's own distributions: the KL to them (0 = a perfect copy) is what falls.
    assert metrics["val/kl"] < 0.8 * metrics["val_before/kl"], metrics
    assert {"val_before/ce", "val/ce", "val/top1_acc"} <= metrics.keys()


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_checkpoint_round_trip_and_wrong_target(trained: dict, kind: str, tiny_runner: ModelRunner) -> None:
    path, _ = trained[kind]
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["target"] == target_fingerprint(tiny_runner.model) and ckpt["command"] == "test"
    drafter = load_drafter(path, kind, tiny_runner.model)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(tensor, ckpt["state_dict"][name].float())
    other = ModelRunner(tiny(seed=5, vocab_size=128, with_tokenizer=False))
    with pytest.raises(LabError, match="trained for target"):
        load_drafter(path, kind, other.model)
    with pytest.raises(LabError, match="holds a"):
        load_drafter(path, {"eagle": "dflash", "dflash": "eagle"}[kind], tiny_runner.model)
    with pytest.raises(LabError, match="does not exist"):
        load_drafter(path.with_name("missing.pt"), kind, tiny_runner.model)


def test_training_goes_on_from_a_checkpoint(trained: dict, tiny_runner: ModelRunner, tmp_path: Path) -> None:
    """train.init_from starts from the checkpoint's weights (validation before = the checkpoint's own) and
    records the command chain that re-creates them."""
    path, first = trained["eagle"]
    train = TrainConfig(steps=2, batch_size=8, lr=1e-4, warmup_steps=1, max_seq_len=96, val_sequences=8,
                        log_every=1000, val_every=0, init_from=str(path))
    metrics = train_drafter("eagle", tiny_runner, DataConfig(num_prompts=40), train, {}, tmp_path / "more.pt", "again",
                            path.parent, log=lambda _: None)
    assert metrics["val_before/kl"] == pytest.approx(first["val/kl"], rel=0.02)
    assert torch.load(tmp_path / "more.pt", weights_only=True)["command"] == "test && again"
    with pytest.raises(LabError, match="holds a"):
        train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), train, dict(OPTIONS["dflash"]),
                      tmp_path / "x.pt", "x", path.parent, log=lambda _: None)


def test_a_fine_tune_that_only_hurts_keeps_the_starting_weights(trained: dict, tiny_runner: ModelRunner,
                                                                tmp_path: Path) -> None:
    """The best validated weights include the starting ones: a fine-tune whose every validated step is worse (a
    learning rate far too high) saves its checkpoint's weights, best_step 0, and says so."""
    path, _ = trained["eagle"]
    train = TrainConfig(steps=2, batch_size=4, lr=5.0, warmup_steps=1, max_seq_len=96, val_sequences=8,
                        log_every=1000, val_every=1, init_from=str(path))
    lines: list[str] = []
    metrics = train_drafter("eagle", tiny_runner, DataConfig(num_prompts=40), train, {}, tmp_path / "worse.pt",
                            "again", path.parent, log=lines.append)
    assert metrics["best_step"] == 0 and metrics["val/ce"] == metrics["val_before/ce"], metrics
    assert any(line.startswith("kept the starting weights") for line in lines), lines
    start, kept = (torch.load(p, weights_only=True)["state_dict"] for p in (path, tmp_path / "worse.pt"))
    assert all(torch.equal(start[k], kept[k]) for k in start)


def test_a_signal_ends_training_with_the_best_weights_so_far(trained: dict, tiny_runner: ModelRunner,
                                                             tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) mid-run: the step in flight finishes, the best validated weights are saved, and the
    recorded command ends with train.stop_after=<steps done>, which re-creates them."""
    path, _ = trained["eagle"]
    handler = signal.getsignal(signal.SIGTERM)
    train = TrainConfig(steps=40, batch_size=4, lr=1e-4, warmup_steps=1, max_seq_len=96, val_sequences=8, log_every=1,
                        val_every=0, init_from=str(path))

    def log(line: str) -> None:
        if line.startswith("step 3/40"):
            os.kill(os.getpid(), signal.SIGTERM)

    metrics = train_drafter("eagle", tiny_runner, DataConfig(num_prompts=40), train, {}, tmp_path / "stopped.pt",
                            "lab-train train.steps=40 train.stop_after=30", path.parent, log=log)
    assert metrics["steps"] == 3 and signal.getsignal(signal.SIGTERM) is handler
    command = torch.load(tmp_path / "stopped.pt", weights_only=True)["command"]
    assert command == "test && lab-train train.steps=40 train.stop_after=3"
    replay = train_drafter("eagle", tiny_runner, DataConfig(num_prompts=40), replace(train, stop_after=3), {},
                           tmp_path / "replay.pt", "again", path.parent, log=lambda _: None)
    assert replay["val/kl"] == metrics["val/kl"]
    with pytest.raises(LabError, match="stop_after must be >= 1"):
        train_drafter("eagle", tiny_runner, DataConfig(num_prompts=40), replace(train, stop_after=0), {},
                      tmp_path / "x.pt", "x", path.parent, log=lambda _: None)


def test_a_time_budget_ends_training_like_a_signal(trained: dict, tiny_runner: ModelRunner, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """train.max_seconds (a leased GPU's budget): training stops after the step that ran past it, saves the best
    weights, and the recorded command counts the steps instead of the seconds, so a slower machine re-creates them."""
    import lab.training.recipe as recipe

    path, _ = trained["eagle"]
    clock = iter(float(t) for t in range(1000))   # NOTE: every reading of the time limit's clock is a second later
    monkeypatch.setattr(recipe._StopEarly, "clock", staticmethod(lambda: next(clock)))
    train = TrainConfig(steps=40, batch_size=4, lr=1e-4, warmup_steps=1, max_seq_len=96, val_sequences=8,
                        log_every=1000, val_every=0, init_from=str(path), max_seconds=4.5)
    lines: list[str] = []
    metrics = train_drafter("eagle", tiny_runner, DataConfig(num_prompts=40), train, {}, tmp_path / "timed.pt",
                            "lab-train train.steps=40 train.max_seconds=4.5", path.parent, log=lines.append)
    assert 1 <= metrics["steps"] < 40 and any(line.startswith("train.max_seconds=4.5: stopped after step")
                                              for line in lines), lines
    command = torch.load(tmp_path / "timed.pt", weights_only=True)["command"]
    assert command == f"test && lab-train train.steps=40 train.stop_after={metrics['steps']}"
    with pytest.raises(LabError, match="max_seconds must be > 0"):
        TrainConfig(max_seconds=0)
    with pytest.raises(LabError, match="matmul_precision must be one of highest, high, medium, got 'tf32'"):
        TrainConfig(matmul_precision="tf32")


def test_deepened_dflash_first_drafts_what_the_checkpoint_did(trained: dict, tiny_runner: ModelRunner,
                                                              tmp_path: Path) -> None:
    """train.add_layers stacks identity layers on a trained DFlash drafter: validation before training equals the
    checkpoint's, the new checkpoint records the deeper shape, and the option is refused without init_from."""
    path, first = trained["dflash"]
    train = TrainConfig(steps=2, batch_size=8, lr=1e-4, warmup_steps=1, max_seq_len=96, val_sequences=8,
                        log_every=1000, val_every=0, init_from=str(path), add_layers=1)
    options = dict(OPTIONS["dflash"])
    metrics = train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), train, options, tmp_path / "deep.pt",
                            "deeper", path.parent, log=lambda _: None)
    assert metrics["val_before/ce"] == pytest.approx(first["val/ce"], rel=0.02)
    deep = load_drafter(tmp_path / "deep.pt", "dflash", tiny_runner.model)
    shallow = load_drafter(path, "dflash", tiny_runner.model)
    assert len(deep.layers) == len(shallow.layers) + 1
    fresh = deepen_dflash(shallow, 1, tiny_runner.model)                # before any training: the same hidden states
    hidden = tiny_runner.config.hidden_size * len(shallow.feature_layers)
    features, embeds = torch.randn(1, 6, hidden), tiny_runner.model.embed_tokens(torch.tensor([[5]]))
    with torch.no_grad():
        outputs = [d(d.block_inputs(embeds, d.context_stream(features[:, -1:])), torch.arange(6, 6 + d.block_size)[None],
                     d.context_kv(features, torch.arange(6)[None]), None) for d in (shallow, fresh)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    with pytest.raises(LabError, match="add_layers"):
        train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), TrainConfig(add_layers=1), options,
                      tmp_path / "x.pt", "x", path.parent, log=lambda _: None)
    with pytest.raises(LabError, match="not EagleDrafter"):
        train_drafter("eagle", tiny_runner, DataConfig(num_prompts=40),
                      TrainConfig(init_from=str(trained["eagle"][0]), add_layers=1), {}, tmp_path / "y.pt", "y",
                      path.parent, log=lambda _: None)


def _proposer(kind: str, path: Path):
    if kind == "dflash_fill":   # NOTE: the drafter trained with fills, drafting in 3 denoising steps
        return DFlashProposerConfig(checkpoint=str(path), denoise_steps=3)
    return EagleProposerConfig(checkpoint=str(path)) if kind == "eagle" else DFlashProposerConfig(checkpoint=str(path))


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_greedy_speculation_with_trained_drafters_is_lossless(trained: dict, kind: str, max_num_seqs: int,
                                                              tiny_runner: ModelRunner) -> None:
    prompts = _prompts(16, seed=3)[8:14]   # training prompts (not the held-out 8): drafts get accepted
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    engine = SpeculativeEngine(tiny_runner, _proposer(kind, trained[kind][0]), num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
                               kv_cache=KV)
    requests = make_requests(prompts, 24, ignore_eos=True)
    for i, request in enumerate(requests):
        request.arrival_time = 0.002 * i
    result = engine.run(requests)
    assert [r.output_token_ids for r in result.requests] == expected
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_accepted_tokens"] > 0, stats
    assert stats["spec/draft_unready_requests"] == 0
    assert engine.kv_manager.num_held_blocks == 0


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_drafting_at_the_end_of_the_context_is_lossless(trained: dict, kind: str, tiny_runner: ModelRunner) -> None:
    """prompt + max_tokens fills the target's 2048 positions: EAGLE's chain of 4 and DFlash's block run past the
    last position near the end (those drafts are trimmed) and must not index past their RoPE tables."""
    max_len = tiny_runner.max_model_len
    prompt = (_prompts(16, seed=3)[9] * 200)[:max_len - 12]
    expected = AREngine(tiny_runner).run(make_requests([prompt], 12, ignore_eos=True)).requests[0].output_token_ids
    engine = SpeculativeEngine(tiny_runner, _proposer(kind, trained[kind][0]),
                               num_spec_tokens=4 if kind == "eagle" else 3,
                               scheduler=SchedulerConfig(max_num_seqs=1),
                               kv_cache=PagedKVCacheConfig(block_size=16, num_blocks=160, kv_cache_memory_mb=None))
    served = engine.run(make_requests([prompt], 12, ignore_eos=True)).requests[0]
    assert served.error is None and served.output_token_ids == expected


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_prefix_cache_hits_bring_their_features_along(trained: dict, kind: str, max_num_seqs: int,
                                                      tiny_runner: ModelRunner) -> None:
    """Feature drafters keep prefix caching on: the features live in the KV blocks (lab/spec/features.py), so a
    request served a cached prompt prefix drafts from the features the forward that computed those blocks wrote.
    They equal what a run without prefix caching computes for that request, and the output is `ar`'s."""
    common = _prompts(16, seed=3)[12]                        # 19 tokens: 4 full blocks of 4 to share
    prompts = [common, common + [7, 8, 9], common[:13] + [5, 6], common + common[:5], common]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 16, ignore_eos=True)).requests]
    first_features = {}
    for caching in (True, False):
        engine = SpeculativeEngine(tiny_runner, _proposer(kind, trained[kind][0]), num_spec_tokens=3,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
                                   kv_cache=replace(KV, enable_prefix_caching=caching))
        seen, propose, store = {}, engine.proposer.propose, engine.proposer.store

        def recording_propose(requests, *args, seen=seen, propose=propose, store=store):
            for r in requests:   # NOTE: every known position's features, at each request's first draft
                seen.setdefault(r.request_id, store.read(r.request_id, 0, r.num_computed_tokens).clone())
            return propose(requests, *args)

        engine.proposer.propose = recording_propose
        requests = make_requests(prompts, 16, ignore_eos=True)
        for i, request in enumerate(requests):
            request.arrival_time = 0.05 * i
        assert [r.output_token_ids for r in engine.run(requests).requests] == expected
        assert (engine.kv_manager.num_hit_tokens > 0) == caching
        assert engine.stats()["spec_decode_accepted_tokens"] > 0
        first_features[caching] = seen
    assert first_features[True].keys() == first_features[False].keys() == {r.request_id for r in requests}
    for request_id, features in first_features[True].items():
        torch.testing.assert_close(features, first_features[False][request_id], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_preemption_with_prefix_caching_stays_lossless(trained: dict, kind: str, tiny_runner: ModelRunner) -> None:
    """Too few blocks for four requests: some are preempted (their blocks, features included, go back to the pool)
    and recomputed, partly from prefix hits on blocks they published before; the drafter's own state (EAGLE's draft
    KV, DFlash's projected context) survives, and the output is still `ar`'s."""
    common = _prompts(16, seed=3)[12]
    prompts = [common, common + [7, 8], _prompts(16, seed=3)[9], common[:10] + [5]]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    engine = SpeculativeEngine(tiny_runner, _proposer(kind, trained[kind][0]), num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                               kv_cache=PagedKVCacheConfig(block_size=4, num_blocks=24, kv_cache_memory_mb=None))
    result = engine.run(make_requests(prompts, 24, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected
    assert engine.scheduler.num_preemptions > 0 and engine.kv_manager.num_hit_tokens > 0
    assert engine.stats()["spec_decode_accepted_tokens"] > 0


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
@pytest.mark.parametrize("max_num_seqs,token_budget", [(1, 32), (4, 32), (4, 7)])
def test_a_tree_of_drafts_is_lossless_and_accepts_more_than_the_chain(trained: dict, kind: str, max_num_seqs: int,
                                                                      token_budget: int,
                                                                      tiny_runner: ModelRunner) -> None:
    """tree_width 3: DFlash's two runners-up for the first position are verified beside its chain; EAGLE drafts a
    beam (its chain and the likeliest others, depth after depth). The output is `ar`'s; a runner-up is accepted on
    some steps (its keys and features moved where the chain's would be), so each draft gets more tokens accepted
    than the chain alone. A token budget of 7 for 4 requests cuts trees short."""
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    stats, drafts = {}, {}
    for width in (1, 3):
        config = _proposer(kind, trained[kind][0])
        config.tree_width = width
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=2, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                             max_num_batched_tokens=token_budget))
        drafts[width] = record_drafts(engine)
        assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
        stats[width] = engine.stats()
        assert engine.kv_manager.num_held_blocks == 0
    assert stats[3]["spec/tree_off_chain_accepts"] > 0 and stats[1]["spec/tree_off_chain_accepts"] == 0
    assert all(d.parents is None for d in drafts[1]) and any(d.parents is not None for d in drafts[3])
    # NOTE: a node under a runner-up of the first position: EAGLE's beam goes on there, DFlash's tree does not
    under_runner_up = any(p > 0 and d.parents[p] == ROOT for d in drafts[3] if d.parents for p in d.parents)
    assert under_runner_up == (kind == "eagle")
    if token_budget > 7:   # NOTE: with 7 tokens for 4 requests a tree's extra rows leave other requests undrafted
        tau = {width: s["spec_decode_acceptance_length"] for width, s in stats.items()}
        assert tau[3] > tau[1], tau


def _under_a_runner_up(parents: list[int]) -> bool:
    """Whether some node at depth >= 2 hangs under a runner-up for the first position (not the chain's first
    node, which leads the depth-first order)."""
    first: list[int] = []   # each node's ancestor at depth 1
    for node, parent in enumerate(parents):
        first.append(node if parent == ROOT else first[parent])
    return any(parent != ROOT and first[node] != 0 for node, parent in enumerate(parents))


@pytest.mark.parametrize("max_num_seqs,token_budget", [(1, 64), (4, 64), (4, 9)])
def test_dflash_trees_of_the_likeliest_paths_are_lossless_and_walk_as_offline(trained: dict, max_num_seqs: int,
                                                                             token_budget: int,
                                                                             tiny_runner: ModelRunner) -> None:
    """tree_nodes 12: the block's 12 likeliest paths (each offset's best tokens, a path's probability the product
    of theirs) are verified together, nodes hang under runners-up at any depth, and the output is `ar`'s. A budget
    of 9 tokens for 4 requests cuts the trees. At batch 1 the engine accepts what the offline walk of the same trees
    does (dflash_offsets.py --tree-nodes), fitted to each request's room as the engine fits them."""
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    stats, drafts = {}, {}
    path = trained["dflash"][0]
    for nodes in (0, 12):
        config = DFlashProposerConfig(checkpoint=str(path), weights="fp32", lookahead_masks=None, tree_nodes=nodes)
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                             max_num_batched_tokens=token_budget))
        drafts[nodes] = record_drafts(engine)
        result = engine.run(make_requests(prompts, 24, ignore_eos=True))
        assert [r.output_token_ids for r in result.requests] == expected
        stats[nodes] = engine.stats()
        assert engine.kv_manager.num_held_blocks == 0
    assert stats[12]["spec/tree_off_chain_accepts"] > 0 and max(len(d.token_ids) for d in drafts[12]) == 12
    assert any(_under_a_runner_up(d.parents) for d in drafts[12] if d.parents)
    if token_budget > 9:
        tau = {nodes: s["spec_decode_acceptance_length"] for nodes, s in stats.items()}
        assert tau[12] > tau[0], tau
    if max_num_seqs == 1:
        answers = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]
        drafter = load_drafter(path, "dflash", tiny_runner.model)
        features = target_features(tiny_runner, answers, drafter.feature_layers)
        walked = load_experiment("dflash_offsets").walk_table(tiny_runner, drafter, (answers, features), [3],
                                                              tree_nodes=(12,))
        assert walked["3, tree of 12"][0] == pytest.approx(stats[12]["spec_decode_acceptance_length"])
        assert walked["3"][0] == pytest.approx(stats[0]["spec_decode_acceptance_length"])


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_dflash_small_trees_read_only_the_offsets_they_can_hold(max_num_seqs: int, tiny_runner: ModelRunner,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree of 3 nodes is at most 3 deep: at k = 7 only offsets 1-3 of the block go through the draft head, and
    every tree (tokens and parents) is the one that reading all 7 gives; the output is `ar`'s."""
    prompts = _prompts(8, seed=5)[:4]
    requests = make_requests(prompts, 20, ignore_eos=True)
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(requests).requests]
    config = DFlashProposerConfig(checkpoint=None, drafter={"block_size": 8}, weights="fp32", tree_nodes=3)
    drafts, head_rows = {}, {}
    for offsets in ("tree depth", "all"):
        if offsets == "all":
            monkeypatch.setattr(DFlashProposer, "offsets_to_draft", lambda self, requests, k: k)
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=7, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
        rows: list[int] = []
        pick = engine.proposer.pick
        monkeypatch.setattr(engine.proposer, "pick",
                            lambda hidden, *args: rows.append(len(hidden)) or pick(hidden, *args))
        recorded = record_drafts(engine)
        result = engine.run(make_requests(prompts, 20, ignore_eos=True))
        assert [r.output_token_ids for r in result.requests] == expected
        drafts[offsets] = [(d.token_ids, d.parents) for d in recorded]
        head_rows[offsets] = rows
    assert drafts["tree depth"] == drafts["all"] and len(drafts["all"]) > 10
    assert max(len(tokens) for tokens, _ in drafts["all"]) == 3
    assert all(r % 3 == 0 for r in head_rows["tree depth"]) and all(r % 7 == 0 for r in head_rows["all"])


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_dflash_trees_redrafted_under_their_likeliest_paths_are_lossless_and_walk_as_offline(
        trained: dict, max_num_seqs: int, tiny_runner: ModelRunner) -> None:
    """tree_redraft 3: a drafter trained with offsets given drafts the block again under each of offset 1's 3 best
    tokens, so the paths through a runner-up take their later tokens from that redraft; with 2 levels, again under
    the tree's 3 likeliest 2-token paths. The trees change, the output is `ar`'s, and at batch 1 the engine accepts
    what the offline walk of the same trees does. (The tiny drafter's flat distributions seldom put a third offset
    in a tree of 12, so that a second level changes the trees is shown on SmolLM2, test_speculative.py.)"""
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    path = trained["dflash_fill"][0]
    stats, drafts, answers = {}, {}, {}
    for redraft, levels in ((0, 1), (3, 1), (3, 2)):
        config = DFlashProposerConfig(checkpoint=str(path), weights="fp32", lookahead_masks=None, tree_nodes=12,
                                      tree_redraft=redraft, tree_redraft_levels=levels)
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64))
        drafts[redraft, levels] = record_drafts(engine)
        result = engine.run(make_requests(prompts, 24, ignore_eos=True))
        assert [r.output_token_ids for r in result.requests] == expected
        stats[redraft, levels] = engine.stats()
        answers[redraft, levels] = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]
    assert stats[3, 1]["spec/tree_off_chain_accepts"] > 0
    assert any(a.token_ids != b.token_ids for a, b in zip(drafts[0, 1], drafts[3, 1]))
    if max_num_seqs == 1:
        drafter = load_drafter(path, "dflash", tiny_runner.model)
        features = target_features(tiny_runner, answers[3, 1], drafter.feature_layers)
        for levels, name in ((1, "3, tree of 12, redrafted under 3"), (2, "3, tree of 12, redrafted under 3 x 2 levels")):
            walked = load_experiment("dflash_offsets").walk_table(tiny_runner, drafter, (answers[3, 1], features), [3],
                                                                  tree_nodes=(12,), tree_redraft=3,
                                                                  tree_redraft_levels=levels)
            assert walked[name][0] == pytest.approx(stats[3, levels]["spec_decode_acceptance_length"])
    with pytest.raises(LabError, match="at most 2 given"):   # NOTE: trained with max_fill 2
        DFlashProposerConfig(checkpoint=str(path), tree_nodes=12, tree_redraft=3, tree_redraft_levels=3).build(
            tiny_runner, PagedKVCacheManager(64, 4))


def test_dflash_tree_tails_follow_every_runner_up_and_stay_lossless(trained: dict, tiny_runner: ModelRunner) -> None:
    """tree_tails: DFlash's later drafts hang under each runner-up too (tree_width x k drafts)."""
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    config = DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), tree_width=2, tree_tails=True)
    engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, kv_cache=KV,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    drafts = record_drafts(engine)
    assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
    assert any(p > 0 and d.parents[p] == ROOT for d in drafts if d.parents for p in d.parents)
    assert max(len(d.token_ids) for d in drafts) == 6 and engine.stats()["spec/tree_off_chain_accepts"] > 0


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_drafters_catch_up_after_steps_the_batch_size_left_undrafted(trained: dict, kind: str,
                                                                    tiny_runner: ModelRunner) -> None:
    """disable_by_batch_size=2: no drafts while 3-4 requests run; as they finish, the drafter drafts again from
    features of every position (observed meanwhile) and the output stays the target's."""
    prompts = _prompts(16, seed=3)[8:13]
    lengths = [10, 14, 18, 22, 26]
    expected = [r.output_token_ids[:n] for r, n in zip(AREngine(tiny_runner).run(
        make_requests(prompts, max(lengths), ignore_eos=True)).requests, lengths)]
    engine = SpeculativeEngine(tiny_runner, _proposer(kind, trained[kind][0]), num_spec_tokens=2,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), kv_cache=KV,
                               disable_by_batch_size=2)
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, lengths))]
    assert [r.output_token_ids for r in engine.run(requests).requests] == expected
    stats = engine.stats()
    assert stats["spec/num_steps_not_drafted"] > 0 and stats["spec_decode_accepted_tokens"] > 0, stats
    assert stats["spec/draft_unready_requests"] == 0


@pytest.mark.parametrize("max_num_seqs", [1, 4])
@pytest.mark.parametrize("min_confidence", [0.0, 0.3])
def test_dflash_blocks_drafted_in_fixed_shape_graphs_are_the_eager_drafts(trained: dict, max_num_seqs: int,
                                                                           min_confidence: float,
                                                                           tiny_runner: ModelRunner) -> None:
    """engine.cuda_graphs.mode=eager (CUDA graphs' fixed shapes, without capture): the target's verify steps and
    DFlash's block forward run on padded static buffers. The drafts are the eager engine's (the same acceptance,
    position by position, with and without the confidence gate) and the output is `ar`'s."""
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    stats = {}
    for mode in ("off", "eager"):
        proposer = DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), min_confidence=min_confidence,
                                        always_draft=int(min_confidence > 0))
        engine = SpeculativeEngine(tiny_runner, proposer, num_spec_tokens=3,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
                                   kv_cache=KV, cuda_graphs=CudaGraphConfig(mode=mode, capture_sizes=(1, 2, 4)))
        # NOTE: admitted by step, not by clock: the drafts compared below depend on which requests share a step.
        served = run_one_arrival_per_step(engine, make_requests(prompts, 24, ignore_eos=True))
        assert [r.output_token_ids for r in served] == expected, mode
        stats[mode] = engine.stats()
    assert stats["eager"]["spec/draft_graph_replays"] == stats["eager"]["spec/draft_forwards"] > 0
    assert "spec/draft_graph_replays" not in stats["off"]
    for key in ("spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates"):
        assert stats["eager"][key] == stats["off"][key], key
    assert stats["eager"]["spec_decode_accepted_tokens"] > 0


@pytest.mark.parametrize("kind,tree_width,tree_nodes", [("eagle", 3, 0), ("dflash", 3, 0), ("dflash", 1, 12)])
def test_trees_of_drafts_in_fixed_shape_graphs_verify_as_the_eager_engine(trained: dict, kind: str, tree_width: int,
                                                                         tree_nodes: int,
                                                                         tiny_runner: ModelRunner) -> None:
    """engine.cuda_graphs.mode=eager with tree_width 3 (or DFlash's tree of 12 paths): verify steps carrying trees
    run in the fixed-shape view (its mask hides a node's siblings as the native kernel does), DFlash's block forward
    returns the first position's candidates (every position's) from its static buffers; the same acceptance as the
    eager engine, `ar`'s output."""
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    stats = {}
    for mode in ("off", "eager"):
        config = _proposer(kind, trained[kind][0])
        config.tree_width = tree_width
        if tree_nodes:
            config.tree_nodes = tree_nodes
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=2, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                                   cuda_graphs=CudaGraphConfig(mode=mode, capture_sizes=(1, 2, 4)))
        served = run_one_arrival_per_step(engine, make_requests(prompts, 24, ignore_eos=True))
        assert [r.output_token_ids for r in served] == expected, mode
        stats[mode] = engine.stats()
    assert stats["eager"]["cuda_graph/replays"] > 0 and stats["eager"]["spec/tree_off_chain_accepts"] > 0
    for key in ("spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec/tree_off_chain_accepts"):
        assert stats["eager"][key] == stats["off"][key], key


def test_untrained_drafters_are_lossless_with_prefix_caching_on(tiny_runner: ModelRunner) -> None:
    prompts = [p * 2 for p in _prompts(3, seed=4)]
    prompts.append(prompts[0] + [3])                 # the first prompt's blocks, served by the prefix cache
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 10, ignore_eos=True)).requests]
    kv = PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None, enable_prefix_caching=True)
    for config in (EagleProposerConfig(checkpoint=None), DFlashProposerConfig(checkpoint=None, drafter={"block_size": 3})):
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=2, scheduler=SchedulerConfig(max_num_seqs=3),
                                   kv_cache=kv)
        assert [r.output_token_ids for r in engine.run(make_requests(prompts, 10, ignore_eos=True)).requests] == expected
        assert engine.kv_manager.num_hit_tokens > 0


def test_the_kv_budget_pays_for_what_a_proposer_keeps_beside_the_kv(tiny_runner: ModelRunner, trained: dict) -> None:
    """kv_cache_memory_mb buys fewer blocks with a proposer that keeps state per KV slot: the target features a
    drafter reads (EAGLE: the last layer's; DFlash: each layer it reads) and a drafter's own paged KV (EAGLE's head:
    one layer; layerskip: its layers; draft_model: the draft's); a cascade pays for both its proposers."""
    budget = PagedKVCacheConfig(block_size=4, num_blocks=None, kv_cache_memory_mb=0.5)
    plain = SpeculativeEngine(tiny_runner, SuffixProposerConfig(), kv_cache=budget)
    c, kv_bytes = tiny_runner.config, plain.kv_bytes_per_token
    hidden, layer_kv = c.hidden_size * 4, 2 * c.num_kv_heads * c.head_dim * 4   # fp32 bytes
    assert plain.proposer_bytes_per_token == 0 and kv_bytes == c.num_layers * layer_kv
    trained_layers = len(load_drafter(trained["dflash"][0], "dflash", tiny_runner.model).feature_layers)
    cascade = CascadeProposerConfig(SuffixProposerConfig(), EagleProposerConfig(checkpoint=None))
    configs = [(EagleProposerConfig(checkpoint=None), hidden + layer_kv, 1),
               (DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4, "feature_layers": [0, 1, -1]}),
                3 * hidden, 3),
               (_proposer("dflash", trained["dflash"][0]), trained_layers * hidden, trained_layers),
               (cascade, hidden + layer_kv, 1),
               (LayerSkipProposerConfig(num_layers=1), layer_kv, 0),
               (DraftModelProposerConfig(source=tiny_runner.source), kv_bytes, 0)]
    for config, extra, num_feature_layers in configs:
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=2, kv_cache=budget)
        assert engine.kv_bytes_per_token == kv_bytes + extra, config
        num_blocks = engine.kv_manager.num_blocks
        assert num_blocks == int(0.5 * 2**20 // ((kv_bytes + extra) * 4)) < plain.kv_manager.num_blocks
        if num_feature_layers:
            store = getattr(engine.proposer, "fallback", engine.proposer).store
            assert store.dim * 4 == num_feature_layers * hidden and store.rows.shape[0] == num_blocks * 4
    with pytest.raises(LabError, match="holds a eagle drafter"):
        SpeculativeEngine(tiny_runner, _proposer("dflash", trained["eagle"][0]), kv_cache=budget)


def test_dflash_block_inputs_tell_the_offsets_apart(tiny_runner: ModelRunner) -> None:
    """A shared mask gives every drafted offset the same input vector; one mask per offset does not; input fusion
    starts every position from a projection of [first token, features before the block]. Shared-mask drafters
    (older checkpoints) still build."""
    hidden = tiny_runner.config.hidden_size
    embeds, last = torch.randn(2, 3, hidden), torch.randn(2, 3, 2 * hidden)
    for per_position, fusion in ((False, False), (True, False), (True, True)):
        config = DFlashConfig(block_size=4, feature_layers=[0, 1], fuse_last_context=True,
                              mask_per_position=per_position, input_fusion=fusion)
        drafter = DFlashDrafter(tiny_runner.config, config)
        blocks = drafter.block_inputs(embeds, drafter.context_stream(last)).view(2, 3, 4, hidden)   # (S, M, B, H)
        start = (drafter.input_fc(torch.cat((embeds, drafter.context_stream(last)), -1)) if fusion
                 else embeds + drafter.context_stream(last))
        torch.testing.assert_close(blocks[:, :, 0], start)
        offsets = drafter.mask_embedding.expand(2, 3, 3, hidden)
        torch.testing.assert_close(blocks[:, :, 1:], offsets + (start[:, :, None] if fusion else
                                                                 drafter.context_stream(last)[:, :, None]))
        assert torch.equal(blocks[0, 0, 1], blocks[0, 0, 2]) != per_position


def test_dflash_block_inputs_of_a_shorter_block_are_the_first_positions_of_the_trained_one(
        tiny_runner: ModelRunner) -> None:
    """`block_inputs(block_size=B')` (the proposer's lookahead_masks): the first B' positions of the trained block's
    inputs, per-position masks included; a block of 1 or past the trained one is refused."""
    hidden = tiny_runner.config.hidden_size
    drafter = DFlashDrafter(tiny_runner.config, DFlashConfig(block_size=6, feature_layers=[0, 1],
                                                             mask_per_position=True, input_fusion=True))
    embeds, last = torch.randn(2, 1, hidden), drafter.context_stream(torch.randn(2, 1, 2 * hidden))
    whole = drafter.block_inputs(embeds, last)                                           # (S, 6, H)
    for block in (2, 3, 6):
        torch.testing.assert_close(drafter.block_inputs(embeds, last, block), whole[:, :block])
    for block in (1, 7):
        with pytest.raises(ValueError, match="holds 2..6 positions"):
            drafter.block_inputs(embeds, last, block)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_dflash_drafting_a_block_cut_to_the_verified_drafts_is_lossless(trained: dict, max_num_seqs: int,
                                                                       tiny_runner: ModelRunner) -> None:
    """lookahead_masks=0: every drafter forward runs a block of the last token + k masks (k = 2 of a trained
    block of 4), drafts still get accepted and the output is the target's."""
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    config = DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), lookahead_masks=0)
    engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=2, kv_cache=KV,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32))
    blocks = []
    engine.proposer.drafter.register_forward_pre_hook(lambda _, args: blocks.append(args[0].shape[1]))
    assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
    assert set(blocks) == {3} and engine.stats()["spec_decode_accepted_tokens"] > 0
    with pytest.raises(LabError, match="lookahead_masks must be >= 0"):
        DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), lookahead_masks=-1).build(
            tiny_runner, PagedKVCacheManager(64, 4))


@pytest.mark.parametrize("num_layers", [1, 2])
def test_dflash_forward_of_some_rows_equals_those_rows_of_the_whole_block(tiny_runner: ModelRunner,
                                                                         num_layers: int) -> None:
    """`rows`: the proposer pushes only the drafts it verifies through the last layer's o_proj and MLP; those rows
    come out as in the whole block's forward (every block position is still attended to), with or without a mask."""
    torch.manual_seed(0)
    hidden = tiny_runner.config.hidden_size
    drafter = DFlashDrafter(tiny_runner.config, DFlashConfig(block_size=5, num_layers=num_layers, feature_layers=[0, 1],
                                                             mask_per_position=True, input_fusion=True)).eval()
    features = torch.randn(2, 7, 2 * hidden)
    inputs = drafter.block_inputs(torch.randn(2, 1, hidden), drafter.context_stream(features[:, -1:]))
    positions, kv = torch.arange(7, 12)[None].expand(2, -1), drafter.context_kv(features, torch.arange(7)[None])
    mask = torch.ones(2, 1, 5, 12, dtype=torch.bool)
    mask[1, :, :, :3] = False
    with torch.no_grad():
        for sees in (None, mask):
            whole = drafter(inputs, positions, kv, sees)                                    # (S, B, H)
            torch.testing.assert_close(drafter(inputs, positions, kv, sees, rows=slice(1, 3)), whole[:, 1:3])
            torch.testing.assert_close(drafter(inputs, positions, kv, sees, rows=slice(1, 2)), whole[:, 1:2])


def test_dflash_identity_start_repeats_the_target_one_position_early(tiny_runner: ModelRunner) -> None:
    """`start_as_identity`: before training, every block position outputs the target's own state at the position
    before the block, up to the offset's small mask embedding."""
    target = tiny_runner.model
    last_layer = tiny_runner.config.num_layers - 1
    drafter = DFlashDrafter(tiny_runner.config, DFlashConfig(block_size=4, feature_layers=[0, last_layer],
                                                             mask_per_position=True, input_fusion=True))
    init_from_target(drafter, target, identity=True)
    hidden = tiny_runner.config.hidden_size
    features = torch.randn(1, 5, 2 * hidden) * 3                                       # (S, C, L*H)
    kv = drafter.context_kv(features, torch.arange(5)[None])
    embeds = target.embed_tokens(torch.tensor([[7]]))
    inputs = drafter.block_inputs(embeds, drafter.context_stream(features[:, -1:]))
    with torch.no_grad():
        out = drafter(inputs, torch.arange(5, 9)[None], kv, torch.ones(1, 1, 4, 9, dtype=torch.bool))
        torch.testing.assert_close(out[0, 0], target.norm(features[0, -1, hidden:]))
        torch.testing.assert_close(out[0, 1:] - drafter.mask_embedding, target.norm(features[0, -1:, hidden:]).expand(3, -1))


def test_dflash_per_offset_metrics_add_up_to_the_acceptance_length(trained: dict, tiny_runner: ModelRunner) -> None:
    """`dflash_loss(per_offset=True)` (experiments/dflash_offsets.py): tau = 1 + the sum over j of the share of
    blocks whose first j drafts are all right; that share at j = 1 is offset 1's top-1 (`top1_first`)."""
    drafter = load_drafter(trained["dflash"][0], "dflash", tiny_runner.model)
    result = AREngine(tiny_runner).run(make_requests(_prompts(4, seed=9), 20, ignore_eos=True))
    sequences = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]   # the target's own text
    features = target_features(tiny_runner, sequences, drafter.feature_layers)
    with torch.no_grad():
        _, metrics = dflash_loss(drafter, tiny_runner.model, make_batch(sequences, features, 96), num_anchors=8,
                                 generator=torch.Generator().manual_seed(0), per_offset=True)
    runs = [metrics[f"run_at_least_{j}"] for j in range(1, drafter.block_size)]
    assert metrics["acceptance_length"] == pytest.approx(1 + sum(runs))
    assert runs == sorted(runs, reverse=True) and runs[0] == pytest.approx(metrics["top1_first"])
    assert 0.0 <= metrics["top1_at_2"] <= 1.0 and "top1_at_4" not in metrics   # block 4: offsets 1..3
    for j in range(1, drafter.block_size):   # a tree's k candidates catch at least what its top-1 does
        assert metrics[f"top1_at_{j}"] <= metrics[f"top2_at_{j}"] <= metrics[f"top4_at_{j}"] <= 1.0
    # offset 1 split by the target's confidence: the bins cover every position, and their hits are top1_first
    shares = [metrics[f"share_conf_{lo}"] for lo in CONFIDENCE_EDGES[:-1]]
    rights = [metrics[f"right_conf_{lo}"] for lo in CONFIDENCE_EDGES[:-1]]
    assert sum(shares) == pytest.approx(1.0) and all(0 <= r <= s for r, s in zip(rights, shares))
    assert sum(rights) == pytest.approx(metrics["top1_first"])


def test_walking_the_answers_offline_gives_the_engines_acceptance(trained: dict, tiny_runner: ModelRunner) -> None:
    """experiments/dflash_offsets.py --walk: greedy speculation replayed along the target's own answers drafts and
    accepts what the engine does at batch 1 with the same drafter and k."""
    offsets = load_experiment("dflash_offsets")
    # blocks at answer tokens 0 (2 accepted), 3 (1), 5 (0), 6 (room for 1 more token: 1 of its 5 right drafts)
    runs = [2, 0, 0, 1, 0, 0, 5, 0]
    assert offsets.walk(lambda i, room: runs[i], len(runs), 2) == (4, 4)
    # NOTE: at token 2 only the last token is left: a step without drafts
    assert offsets.walk(lambda i, room: 0, 3, 2) == (2, 0)
    prompts = _prompts(16, seed=3)[8:12]
    path = trained["dflash"][0]
    proposer = DFlashProposerConfig(checkpoint=str(path), weights="fp32", lookahead_masks=None)
    engine = SpeculativeEngine(tiny_runner, proposer, num_spec_tokens=2, scheduler=SchedulerConfig(max_num_seqs=1),
                               kv_cache=KV)
    result = engine.run(make_requests(prompts, 24, ignore_eos=True))
    answers = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]
    drafter = load_drafter(path, "dflash", tiny_runner.model)
    features = target_features(tiny_runner, answers, drafter.feature_layers)
    walked, every = offsets.walk_table(tiny_runner, drafter, (answers, features), [2])["2"]
    stats = engine.stats()
    assert stats["spec_decode_accepted_tokens"] > 0
    assert walked == pytest.approx(stats["spec_decode_acceptance_length"])
    assert 1.0 <= every <= 3.0


def test_runs_of_the_text_stop_where_the_targets_token_is_outside_the_draft_vocabulary() -> None:
    """Scored against the teacher's argmax over a draft vocabulary of 10 ids, a block whose second label (id 9000)
    lies outside it still looks right; scored against the text (what verification keeps) it stops there."""
    logits = torch.full((3, 10), -1.0)
    logits[torch.arange(3), torch.tensor([5, 3, 7])] = 1.0                       # the drafter's top-1: 5, 3, 7
    labels = torch.tensor([[[5, 9000, 7]]])                                       # (S=1, M=1, B-1=3): the text
    blocks = BlockPredictions(labels, labels >= 0, logits, torch.tensor([5, 3, 7]), None)
    assert blocks.runs().tolist() == [[3.0]] and blocks.runs(of_text=True).tolist() == [[1.0]]


def test_block_labels_count_only_along_the_targets_greedy_path() -> None:
    labels = torch.tensor([[[5, 6, 7, -100], [5, 9, 7, 8]]])                       # (S=1, M=2, B-1=4)
    keep = labels >= 0
    greedy = torch.tensor([5, 6, 1, 5, 6, 7, 8])                                   # the target's, at keep's positions
    on_path = on_greedy_path(labels, keep, greedy)
    # block 0: offsets 1, 2 greedy, so 3 is reached (its text token 7 is not greedy: offset 4 would not be);
    # block 1: offset 2's token 9 leaves the path, so offsets 3 and 4 are not reached
    assert on_path.tolist() == [[[True, True, True, False], [True, True, False, False]]]


def test_greedy_path_changes_nothing_on_the_targets_own_text(trained: dict, tiny_runner: ModelRunner) -> None:
    """On the target's own greedy continuations every label is on the path; on other text some are not."""
    drafter = load_drafter(trained["dflash"][0], "dflash", tiny_runner.model)
    result = AREngine(tiny_runner).run(make_requests(_prompts(4, seed=11), 24, ignore_eos=True))
    own = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]
    other = [Sequence(p + list(range(5, 29)), len(p)) for p in _prompts(4, seed=11)]

    def losses(sequences: list[Sequence]) -> tuple[dict, dict]:
        batch = make_batch(sequences, target_features(tiny_runner, sequences, drafter.feature_layers), 96)
        with torch.no_grad():
            return tuple(dflash_loss(drafter, tiny_runner.model, batch, num_anchors=8, per_offset=True,
                                     generator=torch.Generator().manual_seed(0), greedy_path=flag)[1]
                         for flag in (True, False))

    on, off = losses(own)
    assert on == off
    on, off = losses(other)
    assert on["ce"] != off["ce"]


@pytest.mark.parametrize("kind", ["eagle", "dflash", "dflash_fill"])
def test_sampling_with_drafters_runs_and_is_reproducible(trained: dict, kind: str, tiny_runner: ModelRunner) -> None:
    prompts = _prompts(12, seed=3)[8:12]

    def sample() -> list[list[int]]:
        engine = SpeculativeEngine(tiny_runner, _proposer(kind, trained[kind][0]), num_spec_tokens=3,
                                   scheduler=SchedulerConfig(max_num_seqs=4), kv_cache=KV)
        requests = make_requests(prompts, 16, ignore_eos=True, temperature=0.8, seed=7)
        return [r.output_token_ids for r in engine.run(requests).requests]

    first = sample()
    assert all(len(tokens) == 16 for tokens in first) and first == sample()


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_min_confidence_drafts_fewer_tokens_and_stays_lossless(trained: dict, kind: str,
                                                               tiny_runner: ModelRunner) -> None:
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    drafted = {}
    for threshold in (0.0, 0.3, 1.0):
        config = _proposer(kind, trained[kind][0])
        config.min_confidence, config.always_draft = threshold, int(threshold == 1.0)
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3,
                                   scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), kv_cache=KV)
        assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
        stats = engine.stats()
        drafted[threshold] = stats["spec_decode_draft_tokens"]
        if threshold == 1.0:
            # NOTE: min_confidence 1 with always_draft 1: every draft is its first position only
            assert 0 < stats["spec_decode_num_drafts"] == drafted[1.0], stats
        if threshold == 0.3:
            sampled = [[r.output_token_ids for r in engine.run(make_requests(prompts[:3], 12, ignore_eos=True,
                                                                             temperature=0.8, seed=5)).requests]
                       for _ in range(2)]
            assert sampled[0] == sampled[1] and all(len(tokens) == 12 for tokens in sampled[0])
    assert drafted[1.0] < drafted[0.0] and drafted[0.3] < drafted[0.0], drafted


def test_the_confidence_gate_keeps_the_prefix_above_the_threshold(trained: dict, tiny_runner: ModelRunner) -> None:
    gate = ConfidenceGate(min_confidence=0.3)
    assert gate.length([0.9, 0.5, 0.5]) == 2          # products 0.9, 0.45, then 0.225 < 0.3
    assert gate.length([0.9, 0.5, 0.9]) == 3 and gate.may_extend([0.9, 0.5])
    assert gate.length([0.2, 1.0]) == 0 and not gate.may_extend([0.2])
    assert gate.length([]) == 0 and ConfidenceGate().length([0.01, 0.01]) == 2
    first_free = ConfidenceGate(min_confidence=0.5, always_draft=1)
    assert first_free.length([0.2, 0.9]) == 1 and first_free.may_extend([]) and not first_free.may_extend([0.2])
    assert first_free.length([0.8, 0.7]) == 2 and first_free.may_extend([0.8])
    config = _proposer("eagle", trained["eagle"][0])
    config.min_confidence = 1.5
    with pytest.raises(LabError, match="min_confidence <= 1"):
        config.build(tiny_runner, PagedKVCacheManager(64, 4))


def test_bad_training_settings_name_the_key() -> None:
    with pytest.raises(LabError, match="data.max_new_tokens must be >= 1"):
        DataConfig(max_new_tokens=0)
    with pytest.raises(LabError, match="unknown data.features 'disk'"):
        DataConfig(features="disk")
    assert DataConfig(features="online").key() == DataConfig().key()   # the same cached answers


@pytest.mark.parametrize("per_row", [None, False])
def test_online_features_are_the_cached_ones(tiny_runner: ModelRunner, per_row: bool | None) -> None:
    """data.features=online: a forward per row (a CPU's default) or one batched forward over the padded batch
    (a GPU's) gives each sequence's cached features (which are fp16), zeros past its end."""
    result = AREngine(tiny_runner).run(make_requests(_prompts(3, seed=2), 12, ignore_eos=True))
    sequences = [Sequence(r.all_token_ids[:20 + 7 * i], r.num_prompt_tokens) for i, r in enumerate(result.requests)]
    layers = (0, -1)
    cached = make_batch(sequences, target_features(tiny_runner, sequences, layers), 96)
    online = make_batch(sequences, None, 96, compute_features=online_features(tiny_runner, layers, per_row))
    assert torch.equal(online.token_ids, cached.token_ids) and online.features.shape == cached.features.shape
    torch.testing.assert_close(online.features, cached.features, rtol=2e-3, atol=2e-3)
    assert online.features[0, len(sequences[0].token_ids):].eq(0).all()
    with pytest.raises(LabError, match="no features and no way to compute them"):
        make_batch(sequences, None, 96)


def _proposer_with_vocab(kind: str, path: Path, draft_vocab_size: int):
    config = _proposer(kind, path)
    config.draft_vocab_size = draft_vocab_size
    return config


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_a_draft_vocabulary_keeps_speculation_lossless(trained: dict, kind: str, tiny_runner: ModelRunner) -> None:
    """Drafts come from the first N token ids only; greedy output is unchanged and sampling still runs."""
    vocab = 48
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    assert any(t >= vocab for tokens in expected for t in tokens), "some target tokens lie outside the draft vocab"
    engine = SpeculativeEngine(tiny_runner, _proposer_with_vocab(kind, trained[kind][0], vocab), num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), kv_cache=KV)
    drafted: list[int] = []
    propose = engine.proposer.propose

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        drafts = propose(*args, **kwargs)
        drafted.extend(t for d in drafts.values() for t in d.token_ids)
        return drafts

    engine.proposer.propose = recording
    assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
    assert drafted and max(drafted) < vocab
    sampled = engine.run(make_requests(prompts[:2], 8, ignore_eos=True, temperature=0.8, seed=1)).requests
    assert all(len(r.output_token_ids) == 8 for r in sampled)


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
@pytest.mark.parametrize("weights,head_weights", [("q8_0", "auto"), ("q8_0", "q4_1"), ("q4_1", "q4_1"),
                                                  ("int8", "auto"), ("fp16", "int8")])
def test_drafters_on_quantized_blocks_stay_lossless(trained: dict, kind: str, weights: str, head_weights: str,
                                                    tiny_runner: ModelRunner) -> None:
    """engine.proposer.weights=q8_0 / q4_1: the drafter's linears stream its weights rounded to those blocks, and
    head_weights the draft head's (the target's head, here not made of blocks, rounded too; auto: as the drafter's);
    int8: Q8_0 blocks in 8-bit integer products. Drafts may change, the output may not."""
    if "int8" in (weights, head_weights) and not native_head.supported():
        pytest.skip("int8 products need the native kernels and AVX-512 VNNI")
    prompts = _prompts(16, seed=3)[8:14]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    config = _proposer_with_vocab(kind, trained[kind][0], 96)
    config.weights, config.head_weights = weights, head_weights
    engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), kv_cache=KV)
    linears = [m for m in engine.proposer.drafter.modules() if isinstance(m, PackedLinear)]
    head, head_kind = engine.proposer.draft_head, weights if head_weights == "auto" else head_weights
    block_dtype = {"q8_0": torch.int8, "q4_1": torch.uint8}
    if weights in block_dtype:
        assert linears and all(m.fresh_blocks() is not None and m.half_weight is None for m in linears)
        assert {m.fresh_blocks().dtype for m in linears} == {block_dtype[weights]}
    elif weights == "int8":   # NOTE: where the output rows are a multiple of 16 (the tiny drafter's fc is not)
        assert any(m.fresh_int8() is not None for m in linears)
    if head_kind in block_dtype:
        assert head.fresh_blocks() is not None and head.fresh_blocks().dtype == block_dtype[head_kind]
    else:
        assert head.fresh_int8() is not None
    assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
    assert engine.stats()["spec_decode_accepted_tokens"] > 0


def test_draft_weights_resolve_from_the_target_and_refuse_unknown_kinds(trained: dict, tiny_runner: ModelRunner,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the tiny target is not on AMX tiles: int8 products where the CPU has AVX-512 VNNI, else fp16 copies
    assert resolve_draft_weights("auto", tiny_runner) == ("int8" if native_head.supported() else "fp16")
    kinds = ("fp32", "fp16", "q8_0", "q4_1", "int8")
    assert [resolve_draft_weights(w, tiny_runner) for w in kinds] == list(kinds)
    assert resolve_head_weights("auto", "q8_0") == "q8_0", "auto: the head streams as the drafter"
    assert [resolve_head_weights(w, "fp16") for w in kinds] == list(kinds)
    config = _proposer("dflash", trained["dflash"][0])
    config.weights = "int4"
    with pytest.raises(LabError, match="engine.proposer.weights='int4'"):
        config.build(tiny_runner, PagedKVCacheManager(64, 4))
    config.weights, config.head_weights = "auto", "int4"
    with pytest.raises(LabError, match="engine.proposer.head_weights='int4'"):
        config.build(tiny_runner, PagedKVCacheManager(64, 4))
    monkeypatch.setattr(native_head, "supported", lambda: False)     # NOTE: a CPU without AVX-512 VNNI
    assert resolve_draft_weights("auto", tiny_runner) == "fp16"
    config.weights, config.head_weights = "int8", "auto"
    with pytest.raises(LabError, match="needs a CPU with AVX-512 VNNI"):
        config.build(tiny_runner, PagedKVCacheManager(64, 4))
    config = _proposer_with_vocab("dflash", trained["dflash"][0], 96)
    config.head_weights = "int8"
    with pytest.raises(LabError, match="needs a CPU with AVX-512 VNNI"):
        config.build(tiny_runner, PagedKVCacheManager(64, 4))


def test_draft_head_logits_cover_the_draft_vocabulary_only(trained: dict, tiny_runner: ModelRunner) -> None:
    full = _proposer("eagle", trained["eagle"][0]).build(tiny_runner, PagedKVCacheManager(64, 4))
    cut = _proposer_with_vocab("eagle", trained["eagle"][0], 40).build(tiny_runner, PagedKVCacheManager(64, 4))
    assert cut.draft_head.weight.data_ptr() == tiny_runner.model.lm_head.weight.data_ptr(), "a view, not a copy"
    hidden = torch.randn(3, 15, tiny_runner.config.hidden_size)   # 45 rows: the batched (GEMM) path too
    with torch.inference_mode():
        reference, logits = full.logits(hidden), cut.logits(hidden)
    assert logits.shape == reference.shape
    torch.testing.assert_close(logits[..., :40], reference[..., :40], atol=1e-5, rtol=1e-5)
    assert torch.isinf(logits[..., 40:]).all()
    with pytest.raises(LabError, match="draft_vocab_size must be >= 0"):
        _proposer_with_vocab("eagle", trained["eagle"][0], -1).build(tiny_runner, PagedKVCacheManager(64, 4))
    assert _proposer_with_vocab("eagle", trained["eagle"][0], tiny_runner.config.vocab_size).build(
        tiny_runner, PagedKVCacheManager(64, 4)).draft_head is None


@pytest.mark.parametrize("fallback", ["eagle", "dflash"])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_suffix_then_drafter_cascade_is_lossless_and_uses_both(trained: dict, max_num_seqs: int, fallback: str,
                                                              tiny_runner: ModelRunner) -> None:
    """Suffix decoding drafts where the context repeats itself, the trained drafter everywhere else (suffix_eagle,
    suffix_dflash); the drafter catches up over the tokens the suffix drafts got accepted."""
    prompts = [p + p[:6] for p in _prompts(16, seed=3)[8:12]]   # a repeat: suffix decoding has matches
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    config = CascadeProposerConfig(SuffixProposerConfig(), _proposer(fallback, trained[fallback][0]),
                                   fallback_num_spec_tokens=2)
    engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=4, kv_cache=KV,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32))
    result = engine.run(make_requests(prompts, 24, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected
    stats = engine.stats()
    assert stats["spec/primary_drafts"] > 0 and stats["spec/fallback_drafts"] > 0, stats
    assert stats["spec/draft_unready_requests"] == 0
    assert engine.kv_manager.num_held_blocks == 0


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_suffix_chains_grafted_onto_dflash_trees_are_lossless_and_walk_as_offline(trained: dict, max_num_seqs: int,
                                                                                 tiny_runner: ModelRunner) -> None:
    """graft (engine/proposer=suffix_dflash_tree): DFlash drafts its tree of 12 paths for every request, and suffix
    decoding's chain joins it as a branch where it drafts; the tree stays 12 nodes, the output is `ar`'s, tau does
    not fall below the tree's alone on text that repeats itself, and at batch 1 the engine accepts what the offline
    walk of the same grafted trees does (dflash_offsets.py --graft-suffix)."""
    prompts = [p + p[:6] for p in _prompts(16, seed=3)[8:14]]   # a repeat: suffix decoding has matches
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    path = trained["dflash"][0]
    tree = DFlashProposerConfig(checkpoint=str(path), weights="fp32", lookahead_masks=None, tree_nodes=12)
    stats, drafts = {}, {}
    for graft in (False, True):
        config = (CascadeProposerConfig(SuffixProposerConfig(min_confidence=0.1), tree, fallback_num_spec_tokens=3,
                                        graft=True) if graft else tree)
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64))
        drafts[graft] = record_drafts(engine)
        result = engine.run(make_requests(prompts, 24, ignore_eos=True))
        assert [r.output_token_ids for r in result.requests] == expected
        stats[graft] = engine.stats()
        assert engine.kv_manager.num_held_blocks == 0
    assert stats[True]["spec/grafted_drafts"] > 0 and stats[True]["spec/grafted_tokens"] > 0, stats[True]
    assert max(len(d.token_ids) for d in drafts[True]) <= 12
    tau = {graft: s["spec_decode_acceptance_length"] for graft, s in stats.items()}
    assert tau[True] >= tau[False], tau
    if max_num_seqs == 1:
        answers = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]
        drafter = load_drafter(path, "dflash", tiny_runner.model)
        features = target_features(tiny_runner, answers, drafter.feature_layers)
        walked = load_experiment("dflash_offsets").walk_table(tiny_runner, drafter, (answers, features), [3],
                                                              tree_nodes=(12,), graft_suffix=0.1)
        assert walked["3, tree of 12, suffix grafted"][0] == pytest.approx(tau[True])
        assert walked["3, tree of 12"][0] == pytest.approx(tau[False])
        # NOTE: the same answers served before (--suffix-history): suffix decoding knows every continuation
        seeded = load_experiment("dflash_offsets").walk_table(tiny_runner, drafter, (answers, features), [3],
                                                              tree_nodes=(12,), graft_suffix=0.1, history=answers)
        assert list(seeded) == ["3, tree of 12, suffix grafted"]
        assert seeded["3, tree of 12, suffix grafted"][0] > tau[True]


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_a_chain_that_fills_the_grafted_tree_skips_the_fallback(trained: dict, max_num_seqs: int,
                                                                 tiny_runner: ModelRunner,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A suffix chain as long as the grafted tree's max_nodes (3 here: a 2-node tree, 3 drafts) outranks every node
    off it, so the graft would keep none of DFlash's tree: DFlash drafts only the other requests, and every step
    verifies the same tokens as grafting everything does (the chain, not a one-branch tree), with `ar`'s output."""
    prompts = [p + p[:6] for p in _prompts(16, seed=3)[8:14]]   # a repeat: suffix decoding has matches
    ar = AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True))
    expected = [r.output_token_ids for r in ar.requests]
    tree = DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), weights="fp32", lookahead_masks=None,
                                tree_nodes=2)
    config = CascadeProposerConfig(SuffixProposerConfig(min_confidence=0.1), tree, fallback_num_spec_tokens=3,
                                   graft=True)
    drafted, verified, tau = {}, {}, {}
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(CascadeProposer, "filling_chains", staticmethod(lambda *args: set()))
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64))
        counts: list[int] = []
        fallback = engine.proposer.fallback.propose
        monkeypatch.setattr(engine.proposer.fallback, "propose",
                            lambda requests, *args: counts.append(len(requests)) or fallback(requests, *args))
        drafts = record_drafts(engine)
        result = engine.run(make_requests(prompts, 24, ignore_eos=True))
        assert [r.output_token_ids for r in result.requests] == expected
        drafted[skip], verified[skip] = sum(counts), [d.token_ids for d in drafts]
        tau[skip] = engine.stats()["spec_decode_acceptance_length"]
    assert verified[True] == verified[False] and tau[True] == tau[False]
    assert drafted[True] < drafted[False]
    if max_num_seqs == 1:   # NOTE: the offline walk grafts as the engine does: up to 3 nodes onto a 2-node tree
        answers = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]
        drafter = load_drafter(trained["dflash"][0], "dflash", tiny_runner.model)
        features = target_features(tiny_runner, answers, drafter.feature_layers)
        walked = load_experiment("dflash_offsets").walk_table(tiny_runner, drafter, (answers, features), [3],
                                                              tree_nodes=(2,), graft_suffix=0.1)
        assert walked["3, tree of 2, suffix grafted"][0] == pytest.approx(tau[True])


def test_a_chain_past_the_grafted_tree_is_verified_while_suffix_decoding_stays_sure(trained: dict,
                                                                                    tiny_runner: ModelRunner) -> None:
    """num_spec_tokens above the grafted tree's max_nodes (8 against 3): a chain that fills the tree is verified alone
    up to 8, its drafts past the 3rd kept while the product of suffix decoding's confidences stays >=
    long_chain_min_confidence (0: all; 1: none, the chain cut to the tree's size), and the output stays `ar`'s."""
    prompts = [p + p[:6] for p in _prompts(16, seed=3)[8:12]]   # a repeat: suffix decoding has matches
    requests = partial(make_requests, prompts, 24, ignore_eos=True)
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(requests()).requests]
    tree = DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), weights="fp32", lookahead_masks=None,
                                tree_nodes=2)
    longest, extra = {}, {}
    for threshold in (0.0, 0.5, 1.0):
        config = CascadeProposerConfig(SuffixProposerConfig(min_confidence=0.1), tree, fallback_num_spec_tokens=3,
                                       graft=True, long_chain_min_confidence=threshold)
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=8, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
        drafts = record_drafts(engine)
        assert [r.output_token_ids for r in engine.run(requests()).requests] == expected
        longest[threshold] = max(len(d.token_ids) for d in drafts if d.parents is None)
        extra[threshold] = engine.stats()["spec/long_chain_tokens"]
    assert longest[1.0] == 3 and extra[1.0] == 0
    assert longest[0.0] > 3 and extra[0.0] > extra[0.5], (longest, extra)
    with pytest.raises(LabError, match=r"long_chain_min_confidence must be in \[0, 1\]"):
        SpeculativeEngine(tiny_runner, replace(config, long_chain_min_confidence=1.5), num_spec_tokens=8, kv_cache=KV)


def test_a_chain_grafted_onto_runners_up_without_path_probabilities_stays_lossless(trained: dict,
                                                                                  tiny_runner: ModelRunner) -> None:
    """tree_width 3 drafts the chain and 2 runners-up with no path probabilities: the grafted tree ranks its nodes
    depth first, as Draft.fit does, keeps the suffix chain whole within the tree's 5 nodes, and the output is `ar`'s."""
    prompts = [p + p[:6] for p in _prompts(16, seed=3)[8:12]]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    config = CascadeProposerConfig(SuffixProposerConfig(min_confidence=0.1), DFlashProposerConfig(
        checkpoint=str(trained["dflash"][0]), tree_width=3), fallback_num_spec_tokens=3, graft=True)
    engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, kv_cache=KV,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    drafts = record_drafts(engine)
    assert [r.output_token_ids for r in engine.run(make_requests(prompts, 24, ignore_eos=True)).requests] == expected
    assert engine.stats()["spec/grafted_drafts"] > 0
    assert all(len(d.token_ids) <= 5 and d.path_probs is None for d in drafts if d.parents is not None)


def test_a_chain_grafted_by_confidence_competes_with_the_tree_and_stays_lossless(trained: dict,
                                                                                 tiny_runner: ModelRunner) -> None:
    """graft_by_confidence: suffix decoding's chain joins DFlash's 4-node tree ranked by its own confidences rather
    than above every node, so the trees differ; they stay within the tree's 4 nodes, and the output is `ar`'s either
    way."""
    prompts = [p + p[:6] for p in _prompts(16, seed=3)[8:12]]
    requests = partial(make_requests, prompts, 24, ignore_eos=True)
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(requests()).requests]
    tree = DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), weights="fp32", lookahead_masks=None,
                                tree_nodes=4)
    trees = {}
    for by_confidence in (False, True):
        config = CascadeProposerConfig(SuffixProposerConfig(min_confidence=0.1), tree, fallback_num_spec_tokens=3,
                                       graft=True, graft_by_confidence=by_confidence)
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, kv_cache=KV,
                                   scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
        drafts = record_drafts(engine)
        assert [r.output_token_ids for r in engine.run(requests()).requests] == expected, by_confidence
        assert engine.stats()["spec/grafted_drafts"] > 0
        assert all(len(d.token_ids) <= 4 for d in drafts if d.parents is not None)
        trees[by_confidence] = [(d.token_ids, d.parents) for d in drafts if d.parents is not None]
    assert trees[True] != trees[False], "an unsure chain tail gave way to a tree node somewhere"


def test_graft_needs_a_fallback_that_drafts_trees_and_routes_sampled_requests(trained: dict,
                                                                              tiny_runner: ModelRunner) -> None:
    """A chain-drafting fallback has no tree to graft onto: refused with the fix. A sampled request's DFlash draft is a
    chain, so it is routed as a cascade routes it (suffix decoding's chain where it has one), and runs reproducibly."""
    path = str(trained["dflash"][0])
    chain = CascadeProposerConfig(SuffixProposerConfig(), DFlashProposerConfig(checkpoint=path), 3, graft=True)
    with pytest.raises(LabError, match=r"(?s)this fallback drafts chains.*tree_nodes"):
        SpeculativeEngine(tiny_runner, chain, num_spec_tokens=3, kv_cache=KV)
    stats = _sampled_twice(tiny_runner, replace(chain, fallback=DFlashProposerConfig(checkpoint=path, tree_nodes=12)))
    assert stats["spec/grafted_drafts"] == 0


def test_the_cpu_sized_graft_config_is_the_tree_suffix_graft_with_a_small_tree() -> None:
    """engine=dflash_graft: engine=dflash_tree_suffix with a 4-node tree and no redrafts (its rows stay few), room for
    a chain past the tree's 7 nodes while suffix decoding stays sure, and the chain ranked by its confidences."""
    graft = compose_cfg(["+experiment=crossover", "engine=dflash_graft"]).engine
    tree = compose_cfg(["+experiment=crossover", "engine=dflash_tree_suffix"]).engine
    assert graft.name == "dflash_graft" and graft.proposer.graft and graft.proposer.primary == tree.proposer.primary
    assert (graft.proposer.fallback.tree_nodes, graft.proposer.fallback.tree_redraft) == (4, 0)
    dflash, own_tree = (compose_cfg(["+experiment=crossover", f"engine={e}"]).engine for e in ("dflash", "dflash_tree"))
    assert graft.proposer.fallback.checkpoint == dflash.proposer.checkpoint   # the graft: the chain's drafter
    assert tree.proposer.fallback.checkpoint == own_tree.proposer.checkpoint   # the 62-node tree: the tree's
    assert (graft.num_spec_tokens, tree.num_spec_tokens) == (12, 7)
    assert (graft.proposer.long_chain_min_confidence, tree.proposer.long_chain_min_confidence) == (0.3, 0.0)
    assert graft.proposer.graft_by_confidence and not tree.proposer.graft_by_confidence


def test_cascade_sampling_runs_and_is_reproducible(trained: dict, tiny_runner: ModelRunner) -> None:
    """Suffix drafts (one-hot q) and EAGLE drafts (the head's q) share a sampled batch."""
    _sampled_twice(tiny_runner, CascadeProposerConfig(
        SuffixProposerConfig(), EagleProposerConfig(checkpoint=str(trained["eagle"][0])), fallback_num_spec_tokens=2))


def _sampled_twice(tiny_runner: ModelRunner, config: CascadeProposerConfig) -> dict[str, float]:
    """A cascade samples a batch of prompts that repeat themselves twice with one seed: the same tokens each time,
    both proposers drafting -> the stats."""
    prompts = [p + p[:6] for p in _prompts(12, seed=3)[8:12]]

    def sample() -> tuple[list[list[int]], dict[str, float]]:
        engine = SpeculativeEngine(tiny_runner, config, num_spec_tokens=3, scheduler=SchedulerConfig(max_num_seqs=4),
                                   kv_cache=KV)
        requests = make_requests(prompts, 16, ignore_eos=True, temperature=0.8, seed=7)
        return [r.output_token_ids for r in engine.run(requests).requests], engine.stats()

    (first, stats), (again, _) = sample(), sample()
    assert all(len(tokens) == 16 for tokens in first) and first == again
    assert stats["spec/primary_drafts"] > 0 and stats["spec/fallback_drafts"] > 0, stats
    return stats


def test_cascade_refuses_a_feature_reading_primary(tiny_runner: ModelRunner) -> None:
    config = CascadeProposerConfig(EagleProposerConfig(checkpoint=None), SuffixProposerConfig())
    with pytest.raises(LabError, match="primary proposer must not read target features"):
        SpeculativeEngine(tiny_runner, config, num_spec_tokens=2, kv_cache=KV)
    with pytest.raises(LabError, match="needs engine.proposer.primary"):
        SpeculativeEngine(tiny_runner, CascadeProposerConfig(), num_spec_tokens=2, kv_cache=KV)


def test_dflash_refuses_more_drafts_than_its_block_holds(tiny_runner: ModelRunner) -> None:
    """A block of 4 drafts 3 tokens: asking for more is an error (directly and as a cascade's fallback), not a step
    that silently verifies fewer than num_spec_tokens."""
    dflash = DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4})
    assert SpeculativeEngine(tiny_runner, dflash, num_spec_tokens=3, kv_cache=KV).proposer.max_num_spec_tokens == 3
    with pytest.raises(LabError, match=r"(?s)num_spec_tokens=4, but this proposer drafts at most 3 .*num_spec_tokens to 1..3"):
        SpeculativeEngine(tiny_runner, dflash, num_spec_tokens=4, kv_cache=KV)
    cascade = CascadeProposerConfig(SuffixProposerConfig(), dflash, fallback_num_spec_tokens=5)
    with pytest.raises(LabError, match=r"fallback_num_spec_tokens=5, but the fallback drafts at most 3"):
        SpeculativeEngine(tiny_runner, cascade, num_spec_tokens=8, kv_cache=KV)
    assert SpeculativeEngine(tiny_runner, replace(cascade, fallback_num_spec_tokens=3), num_spec_tokens=8,
                             kv_cache=KV).proposer.fallback_num_spec_tokens == 3


def test_reference_answers_extend_the_corpus(tiny_text_runner: ModelRunner, tmp_path: Path) -> None:
    """ShareGPT's recorded answers join the target's own (prefill only, cached); EAGLE trains on both with
    the target's soft labels over a draft vocabulary."""
    runner = tiny_text_runner
    data = DataConfig(num_prompts=4, max_prompt_len=64, max_new_tokens=12, reference_answers=6)
    own = [Sequence([1, 2, 3, 4, 5], 3)]
    references = reference_sequences(runner.tokenizer, data, tmp_path, own, log=lambda _: None)
    assert len(references) == 6 and len({tuple(s.token_ids) for s in references}) == 6
    eos = runner.tokenizer.eos_token_id
    for seq in references:
        answer = seq.token_ids[seq.prompt_len:]
        assert seq.prompt_len <= 64 and 1 <= len(answer) <= 13
        assert len(answer) == 12 or answer[-1] == eos   # cut at max_new_tokens, or the whole answer + EOS
    assert (tmp_path / f"references-{data.reference_key()}-n6.json").is_file()
    fewer = reference_sequences(runner.tokenizer, replace(data, reference_answers=4), tmp_path, own, log=lambda _: None)
    assert fewer == references[:4]   # a count's conversations are the first of any larger count's
    others = reference_sequences(runner.tokenizer, data, tmp_path / "skip", references[:1], log=lambda _: None)
    assert len(others) == 6 and others[:5] == references[1:]   # a skipped prompt is made up for
    assert reference_sequences(runner.tokenizer, data, tmp_path, own, log=lambda _: None) == references
    assert data.key() == DataConfig(num_prompts=4, max_prompt_len=64, max_new_tokens=12).key()   # own answers' cache kept
    with pytest.raises(LabError, match="reference_answers must be >= 0"):
        DataConfig(reference_answers=-1)

    (tmp_path / f"responses-{data.key()}.json").write_text(json.dumps(
        [{"token_ids": s.token_ids, "prompt_len": s.prompt_len} for s in references[:3]]))
    train = TrainConfig(steps=3, batch_size=2, max_seq_len=80, val_sequences=2, log_every=1000, val_every=0)
    lines: list[str] = []
    metrics = train_drafter("eagle", runner, data, train, {"draft_vocab_size": 512}, tmp_path / "eagle.pt", "test",
                            tmp_path, log=lines.append)
    assert any("7 sequences" in line for line in lines), lines   # 3 own + 6 references - 2 held out
    assert list(tmp_path.glob(f"features-{data.reference_key()}-0-6-L*.pt"))
    assert 0 <= metrics["val/top1_acc"] <= 1 and metrics["val/ce"] > 0


def test_holdout_keeps_the_benchmarks_prompts_out_of_training(tiny_text_runner: ModelRunner, tmp_path: Path) -> None:
    """data.holdout: neither the target's answers nor the recorded ones come from the prompts a seed-0 workload
    takes first (the benchmark's), whatever the data seed; holdout 0 keeps the caches' keys."""
    tokenizer = tiny_text_runner.tokenizer
    benchmark = {tuple(s.prompt_token_ids) for s in DatasetWorkload("gsm8k", num_prompts=6, max_prompt_len=256,
                                                                      seed=0).select(tokenizer)}
    data = DataConfig(dataset="gsm8k", num_prompts=3, max_prompt_len=256, max_new_tokens=3, reference_answers=4)
    held_out = replace(data, holdout=8)
    quiet = lambda _: None   # noqa: E731
    plain = generate_responses(tiny_text_runner, data, tmp_path, quiet)
    assert {tuple(s.token_ids[:s.prompt_len]) for s in plain} <= benchmark   # no holdout at seed 0: the same prompts
    for config in (held_out, replace(held_out, seed=3)):
        answers = generate_responses(tiny_text_runner, config, tmp_path, quiet)
        references = reference_sequences(tokenizer, config, tmp_path, answers, quiet)
        assert len(answers) == 3 and len(references) == 4
        assert not {tuple(s.token_ids[:s.prompt_len]) for s in answers + references} & benchmark
    assert held_out.key() != data.key() and held_out.reference_key() != data.reference_key()
    assert data.key() == replace(data, holdout=0).key()
    with pytest.raises(LabError, match="data.holdout must be >= 0"):
        DataConfig(holdout=-1)


def test_mix_trains_one_drafter_on_several_datasets(tiny_text_runner: ModelRunner, tmp_path: Path) -> None:
    """data.mix: another dataset's target answers join the corpus, cached exactly as a run on that dataset alone
    caches them; each part validates on its own first answers, and early stopping reads their mean by share."""
    data = DataConfig(num_prompts=6, max_prompt_len=64, max_new_tokens=6,
                      mix=[{"dataset": "gsm8k", "num_prompts": 6, "holdout": 4, "share": 0.25}])
    (main, main_share), (extra, extra_share) = data.parts()
    alone = DataConfig(dataset="gsm8k", num_prompts=6, max_prompt_len=64, max_new_tokens=6, holdout=4)
    assert extra.key() == alone.key() and main.key() == data.key() == replace(data, mix=()).key()
    assert (main_share, extra_share) == (0.75, 0.25) and extra.reference_answers == 0
    batched_part = {"dataset": "gsm8k", "num_prompts": 6, "holdout": 4, "max_num_seqs": 64}
    batched = replace(data, mix=[batched_part]).parts()[1][0]
    assert batched.key() == replace(alone, max_num_seqs=64).key() != alone.key()   # a part's own batch, its own key
    train = TrainConfig(steps=2, batch_size=2, max_seq_len=80, val_sequences=2, log_every=1000, val_every=0)
    lines: list[str] = []
    metrics = train_drafter("eagle", tiny_text_runner, data, train, {"draft_vocab_size": 512}, tmp_path / "eagle.pt",
                            "test", tmp_path, log=lines.append)
    sizes = [len(json.loads((tmp_path / f"responses-{c.key()}.json").read_text())) for c in (main, alone)]
    assert any(f"{sum(sizes) - 4} sequences" in line for line in lines), lines   # each part's first 2 validate
    mean = 0.75 * metrics["val/sharegpt/ce"] + 0.25 * metrics["val/gsm8k/ce"]
    assert metrics["val/ce"] == pytest.approx(mean, abs=1e-3)


def test_parts_that_share_prompts_warn_or_drop_them(tiny_text_runner: ModelRunner, tmp_path: Path) -> None:
    """holdout offsets a part in the one shuffle, so parts can overlap: a prompt seen before (an earlier part's,
    or a repeat in its own) is reported, or with data.distinct_prompts dropped, so no part validates on answers
    another trains on."""
    data = DataConfig(num_prompts=3, features="online", mix=[{"dataset": "sharegpt", "num_prompts": 4, "holdout": 2}])
    (first, _), (second, _) = data.parts()
    answers = [(first, [([1, 2], [9]), ([3], [8]), ([4, 5], [7])]),
               (second, [([4, 5], [7]), ([6], [5]), ([6], [5]), ([2, 1], [4])])]   # one of the first's, one repeat
    for part, pairs in answers:
        records = [{"token_ids": prompt + answer, "prompt_len": len(prompt)} for prompt, answer in pairs]
        (tmp_path / f"responses-{part.key()}.json").write_text(json.dumps(records))
    lines: list[str] = []
    kept = load_corpus(tiny_text_runner, data, tmp_path, lines.append)
    assert [len(p.sequences) for p in kept] == [3, 4] and kept[1].name == "sharegpt#1"
    assert [line for line in lines if "WARNING 2 of sharegpt#1's 4 prompts were seen before" in line], lines
    lines.clear()
    distinct = load_corpus(tiny_text_runner, replace(data, distinct_prompts=True), tmp_path, lines.append)
    assert [s.token_ids for s in distinct[1].sequences] == [[6, 5], [2, 1, 4]]
    assert lines == ["data: dropped 2 of sharegpt#1's 4 answers, to prompts seen before"]
    assert replace(data, distinct_prompts=True).key() == data.key()   # the answers' cache stays theirs


def test_mix_draws_by_share_and_refuses_bad_parts() -> None:
    from hydra import compose, initialize_config_dir

    from lab.run import CONF_DIR
    from lab.training.recipe import _sampler

    draws = _sampler([10, 30], [0.75, 0.25], torch.Generator().manual_seed(0))(4000)
    assert 0.72 < sum(i < 10 for i in draws) / 4000 < 0.78 and max(draws) < 40
    uniform = _sampler([10, 30], [None, None], torch.Generator().manual_seed(0))(50)
    assert uniform == torch.randint(40, (50,), generator=torch.Generator().manual_seed(0)).tolist()   # as unmixed
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["data.mix=[{dataset:gsm8k,num_prompts:1000,holdout:256,share:0.5}]"])
    parts = DataConfig(**OmegaConf.to_container(cfg.data, resolve=True)).parts()
    assert [(c.dataset, c.num_prompts, c.holdout, share) for c, share in parts] == [
        ("sharegpt", 320, 0, 0.5), ("gsm8k", 1000, 256, 0.5)]
    for mix, match in [([{"dataset": "gsm8k"}], "needs a dataset and num_prompts"),
                       ([{"dataset": "gsm8k", "num_prompts": 9, "seed": 3}], r"unknown keys \['seed'\]"),
                       ([{"dataset": "gsm8k", "num_prompts": 9, "share": 0.3}, {"dataset": "mtbench", "num_prompts": 9}],
                        "for some parts only"),
                       ([{"dataset": "gsm8k", "num_prompts": 9, "share": 1.0}], "sum below 1")]:
        with pytest.raises(LabError, match=match):
            DataConfig(mix=mix)


def test_reference_features_extend_shard_by_shard(tiny_text_runner: ModelRunner, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Raising reference_answers computes only the new shards of features; the finished ones are read back
    (memory-mapped) unchanged."""
    monkeypatch.setattr(training_data, "REFERENCE_SHARD", 4)
    data = DataConfig(num_prompts=4, max_prompt_len=64, max_new_tokens=12, reference_answers=6, feature_layers=(-1,))
    (tmp_path / f"responses-{data.key()}.json").write_text(json.dumps([{"token_ids": [1, 2, 3, 4, 5], "prompt_len": 3}]))
    lines: list[str] = []
    sequences, features = load_training_data(tiny_text_runner, data, tmp_path, lines.append)
    key = data.reference_key()
    first = next(tmp_path.glob(f"features-{key}-0-4-L*.pt"))
    assert len(sequences) == len(features) == 7 and list(tmp_path.glob(f"features-{key}-4-6-L*.pt"))
    stamp = first.stat().st_mtime_ns
    lines.clear()
    more, more_features = load_training_data(tiny_text_runner, replace(data, reference_answers=8), tmp_path, lines.append)
    assert more[:5] == sequences[:5] and len(more) == 9 and list(tmp_path.glob(f"features-{key}-4-8-L*.pt"))
    assert first.stat().st_mtime_ns == stamp and sum("target features" in line for line in lines) == 1   # only 4-8
    for mine, theirs in zip(more_features[:5], features[:5]):
        assert torch.equal(mine, theirs)


def test_a_cache_write_that_fails_leaves_no_file_and_the_run_goes_on(tiny_runner: ModelRunner, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk mid-write (session 53: torch.save's RuntimeError after 1.7 of 5.5 GB) leaves neither a truncated
    features file for the next run to load nor a partial one; the features computed are returned all the same, the
    warning names the fix, and the next run computes and stores them."""
    sequences = [Sequence([1, 2, 3, 4, 5, 6], 3), Sequence([7, 8, 9, 10], 2)]

    def disk_full(obj: object, path: Path) -> None:
        Path(path).write_bytes(b"half a zip")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1729457152 vs 1729457040")

    lines: list[str] = []
    with monkeypatch.context() as patch:
        patch.setattr(training_data.torch, "save", disk_full)
        features = training_data.cached_features(tiny_runner, sequences, "k", (-1,), tmp_path, lines.append)
    assert [f.shape[0] for f in features] == [6, 4] and not list(tmp_path.iterdir())
    assert any("could not cache features-k-L" in line and "free disk space" in line for line in lines), lines
    lines.clear()
    again = training_data.cached_features(tiny_runner, sequences, "k", (-1,), tmp_path, lines.append)
    assert [p.name for p in tmp_path.iterdir()] == [f"features-k-L{tiny_runner.config.num_layers - 1}.pt"]
    assert all(torch.equal(a, b) for a, b in zip(again, features)) and not any("WARNING" in line for line in lines)


def test_lab_train_is_one_wandb_run_with_its_curves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`lab-train` (logger=wandb, offline): one W&B run in group train-<drafter> holding the training and
    validation curves, the final metrics and the checkpoint; the data cache goes under $LAB_CACHE."""
    from hydra import compose, initialize_config_dir

    from lab.run import CONF_DIR
    from lab.train import train

    tokenizer_cache = default_cache_dir()   # the tiny model's (SmolLM2) tokenizer stays where it is
    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    overrides = ["model=tiny", f"model.source.cache_dir={tokenizer_cache}", "drafter=eagle", "data.num_prompts=6",
                 "data.max_new_tokens=8", "train.steps=4", "train.batch_size=2", "train.val_sequences=2",
                 "train.log_every=1", "train.val_every=2", "logger.mode=offline", f"logger.dir={tmp_path}",
                 f"output={tmp_path / 'eagle.pt'}"]
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        metrics = train(compose("train", overrides=overrides))
    assert metrics["steps"] == 4 and (tmp_path / "eagle.pt").is_file()
    assert list((tmp_path / "cache" / "train").glob("*/responses-*.json"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    record = next(runs[0].glob("*.wandb")).read_bytes()
    for key in (b"train-eagle", b"train/loss", b"train/lr", b"val/top1_acc", b"val/step", b"best_step"):
        assert key in record, key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["eagle", "dflash"])
@pytest.mark.parametrize("features", ["cached", "online"])
def test_training_runs_where_the_target_is(kind: str, device: str, features: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The target on `device`: batches move there from the cached CPU features (or the target computes them
    there per batch, data.features=online, and nothing is cached), the loss falls, and the checkpoint loads on
    the CPU. train.matmul_precision=high trains in TF32 on CUDA, medium in bf16 on a CPU with a bf16 unit (its
    features cached apart from fp32 ones), and the setting is restored after."""
    runner = ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), dtype="float32", device=device)
    result = AREngine(runner).run(make_requests(_prompts(24, seed=3), 24, ignore_eos=True))
    data = DataConfig(num_prompts=24, features=features)
    (tmp_path / f"responses-{data.key()}.json").write_text(json.dumps(
        [{"token_ids": r.all_token_ids, "prompt_len": r.num_prompt_tokens} for r in result.requests]))
    train = TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=3, max_seq_len=96, val_sequences=8,
                        log_every=1000, val_every=0, matmul_precision="high" if device == "cuda" else "medium")
    expected = "high" if device == "cuda" else ("medium" if cpu_has_bf16_matmul() else "highest")
    seen: list[str] = []
    set_precision = torch.set_float32_matmul_precision
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: (seen.append(p), set_precision(p))[1])
    before = torch.get_float32_matmul_precision()
    metrics = train_drafter(kind, runner, data, train, dict(OPTIONS[kind]), tmp_path / "d.pt", "test", tmp_path,
                            log=lambda _: None)
    assert metrics["train/last_loss"] < metrics["train/first_loss"], metrics
    assert seen[0] == expected and torch.get_float32_matmul_precision() == before
    cached = [path.name for path in tmp_path.glob("features-*")]
    assert bool(cached) == (features == "cached")
    assert all((f"-{expected}-" in name) == (expected != "highest") for name in cached), cached
    cpu_target = ModelRunner(tiny(seed=0, vocab_size=128, with_tokenizer=False), dtype="float32", device="cpu")
    load_drafter(tmp_path / "d.pt", kind, cpu_target.model)


def test_dflash_block_inputs_with_fills_anchor_the_masked_rest_at_the_last_known_token(
        tiny_runner: ModelRunner) -> None:
    """A filled offset's input is built as the block's first token's (input fusion of its embedding and the stream
    before the block); with f offsets filled, offset j > f gets mask j - f on top of the last known token's input,
    as offset j - f of a block starting there would."""
    config = DFlashConfig(block_size=4, mask_per_position=True, input_fusion=True, fuse_last_context=True, max_fill=2)
    drafter = DFlashDrafter(tiny_runner.config, config)
    hidden = tiny_runner.config.hidden_size
    first, last = torch.randn(2, 3, hidden), torch.randn(2, 3, hidden)
    fills = torch.randn(2, 3, 2, hidden)
    fuse = lambda embeds: drafter.input_fc(torch.cat((embeds, last[:, :, None].expand_as(embeds)), -1))   # noqa: E731
    start, given = fuse(first[:, :, None])[:, :, 0], fuse(fills)                       # (2, 3, H), (2, 3, 2, H)
    mask = drafter.mask_embedding
    plain = drafter.block_inputs(first, last).view(2, 3, 4, hidden)
    torch.testing.assert_close(plain, torch.cat((start[:, :, None], mask + start[:, :, None]), dim=2))
    every = drafter.block_inputs(first, last, fill_embeds=fills).view(2, 3, 4, hidden)
    torch.testing.assert_close(every, torch.cat((start[:, :, None], given, (mask[0] + given[:, :, 1])[:, :, None]), 2))
    filled = torch.tensor([[True, False], [True, True], [False, False]]).expand(2, 3, 2)   # f = 1, 2, 0 per block
    mixed = drafter.block_inputs(first, last, fill_embeds=fills, filled=filled).view(2, 3, 4, hidden)
    torch.testing.assert_close(mixed[:, 0], torch.stack((start[:, 0], given[:, 0, 0], mask[0] + given[:, 0, 0],
                                                         mask[1] + given[:, 0, 0]), dim=1))
    torch.testing.assert_close(mixed[:, 1], every[:, 1])
    torch.testing.assert_close(mixed[:, 2], plain[:, 2])


def test_dflash_trained_with_fills_records_them_and_scores_only_drafted_offsets(trained: dict,
                                                                                tiny_runner: ModelRunner) -> None:
    """drafter.max_fill: the checkpoint records how many offsets its drafter may be given; with fills, the filled
    offsets are not scored and the first drafted one is measured apart (`top1_after_fill`)."""
    path, metrics = trained["dflash_fill"]
    drafter = load_drafter(path, "dflash", tiny_runner.model)
    assert drafter.config.max_fill == 2
    assert load_drafter(trained["dflash"][0], "dflash", tiny_runner.model).config.max_fill == 0
    assert 0.0 <= metrics["val/top1_after_fill"] <= 1.0 and metrics["train/last_loss"] < metrics["train/first_loss"]
    sequences, features = load_training_data(tiny_runner, DataConfig(num_prompts=40, feature_layers=drafter.feature_layers),
                                             path.parent)
    batch = make_batch(sequences[:4], features[:4], 96)
    anchors = torch.randint(2, 20, (4, 6), generator=torch.Generator().manual_seed(0)) + batch.prompt_lens[:, None]
    fills = torch.tensor([0, 1, 2, 0, 1, 2]).expand(4, 6)
    blocks = dflash_predictions(drafter, tiny_runner.model, batch, anchors, fills=fills)
    drafted = torch.arange(3) >= fills[..., None]
    assert not (blocks.keep & ~drafted).any() and blocks.keep[..., 2].all()
    with pytest.raises(ValueError, match="max_fill=0"):
        dflash_loss(drafter, tiny_runner.model, batch, num_anchors=4, per_offset=True, max_fill=1)
    with pytest.raises(LabError, match="drafter.max_fill"):
        train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), TrainConfig(steps=1, init_from=str(path)),
                      dict(OPTIONS["dflash"], max_fill=3), path.parent / "x.pt", "test", path.parent, log=lambda _: None)


def test_fill_weights_set_the_share_of_each_fill_count(trained: dict, tiny_runner: ModelRunner) -> None:
    """drafter.fill_weights: fill f drawn with probability weights[f] / sum (None: uniform, as before); a list of
    the wrong length, a negative, infinite or all-zero one, a string, or one without max_fill is refused before any
    training (by lab-train before the target loads)."""
    generator = torch.Generator().manual_seed(0)
    fills = draw_fills(torch.Size((200, 50)), 3, (4.0, 2.0, 1.0, 0.0), generator)
    shares = torch.bincount(fills.flatten(), minlength=4).double() / fills.numel()
    expected = torch.tensor([4 / 7, 2 / 7, 1 / 7, 0.0], dtype=torch.float64)
    torch.testing.assert_close(shares, expected, atol=0.015, rtol=0)
    same = torch.randint(0, 3, (5, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(draw_fills(torch.Size((5, 6)), 2, None, torch.Generator().manual_seed(1)), same)
    with pytest.raises(ValueError, match="needs max_fill \\+ 1 = 3 weights"):
        draw_fills(torch.Size((5, 6)), 2, (1.0, 1.0), generator)
    path = trained["dflash_fill"][0]
    for weights, error in (([2, 1], "has 2 weights, drafter.max_fill=2 needs 3"),
                           ([1, -1, 1], "numbers >= 0"), ([0, 0, 0], "not all 0"), ([1, float("inf"), 1], "finite"),
                           ("3,1,1", "must be a list")):
        with pytest.raises(LabError, match=error):
            train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), TrainConfig(steps=1, init_from=str(path)),
                          dict(OPTIONS["dflash"], max_fill=2, fill_weights=weights), path.parent / "x.pt", "test",
                          path.parent, log=lambda _: None)
    with pytest.raises(LabError, match="needs 3"):   # NOTE: lab-train's check, before the target loads
        check_drafter_options("dflash", {"max_fill": 2, "fill_weights": [1, 1]})
    with pytest.raises(LabError, match="drafter.max_fill is 0"):
        train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), TrainConfig(steps=1, init_from=str(path)),
                      dict(OPTIONS["dflash"], fill_weights=[1]), path.parent / "x.pt", "test", path.parent,
                      log=lambda _: None)
    weighted = path.parent / "dflash_fill_weighted.pt"
    train = TrainConfig(steps=3, batch_size=4, max_seq_len=96, val_sequences=4, log_every=1000, init_from=str(path))
    metrics = train_drafter("dflash", tiny_runner, DataConfig(num_prompts=40), train,
                            dict(OPTIONS["dflash"], max_fill=2, fill_weights=[3, 1, 0]), weighted, "test",
                            path.parent, log=lambda _: None)
    assert load_drafter(weighted, "dflash", tiny_runner.model).config.max_fill == 2
    assert math.isfinite(metrics["train/last_loss"])


@pytest.mark.parametrize("max_num_seqs", [1, 4])
@pytest.mark.parametrize("denoise_steps", [2, 3])
def test_dflash_denoising_steps_are_lossless_and_draft_as_the_offline_walk(trained: dict, max_num_seqs: int,
                                                                           denoise_steps: int,
                                                                           tiny_runner: ModelRunner) -> None:
    """engine.proposer.denoise_steps: the block is drafted again with its kept drafts filled in. Lossless at batch 1
    and 4; at batch 1 its acceptance is the offline walk's with the same steps (dflash_offsets.py). (The tiny
    drafter's fills seldom change its argmax; the next test checks each step's fills directly.)"""
    prompts = _prompts(16, seed=3)[8:12]
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 24, ignore_eos=True)).requests]
    path = trained["dflash_fill"][0]
    proposer = DFlashProposerConfig(checkpoint=str(path), weights="fp32", lookahead_masks=None,
                                    denoise_steps=denoise_steps)
    engine = SpeculativeEngine(tiny_runner, proposer, num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
                               kv_cache=KV)
    result = engine.run(make_requests(prompts, 24, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected
    stats = engine.stats()
    assert stats["spec_decode_accepted_tokens"] > 0
    if max_num_seqs == 1:
        answers = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests]
        drafter = load_drafter(path, "dflash", tiny_runner.model)
        features = target_features(tiny_runner, answers, drafter.feature_layers)
        walked, _ = load_experiment("dflash_offsets").walk_table(tiny_runner, drafter, (answers, features), [3],
                                                                 denoise_steps)["3"]
        assert walked == pytest.approx(stats["spec_decode_acceptance_length"])


def test_dflash_denoising_steps_fill_in_the_drafts_kept_so_far(trained: dict, tiny_runner: ModelRunner) -> None:
    """Step p of a block gets the drafts of offsets 1..p-1 kept so far as its fills and drafts offsets p..k; the
    request's draft is each step's first draft, then the last step's rest."""
    proposer = DFlashProposerConfig(checkpoint=str(trained["dflash_fill"][0]), denoise_steps=3)
    engine = SpeculativeEngine(tiny_runner, proposer, num_spec_tokens=3, scheduler=SchedulerConfig(max_num_seqs=1),
                               kv_cache=KV)
    proposer = engine.proposer
    calls: list[tuple[list[int], list[int]]] = []   # per drafter forward: (fills, the greedy drafts it gives)
    block_hidden = proposer.block_hidden

    def recording_block_hidden(*args, fill_ids=None):
        hidden = block_hidden(*args, fill_ids=fill_ids)
        drafted = proposer.greedy_from_scores(proposer.head_scores(hidden))[0]
        calls.append(([] if fill_ids is None else fill_ids[0].tolist(), drafted[0].tolist()))
        return hidden

    proposer.block_hidden = recording_block_hidden
    drafts = record_drafts(engine)
    engine.run(make_requests(_prompts(16, seed=3)[8:10], 16, ignore_eos=True))
    starts = [i for i, (fills, _) in enumerate(calls) if not fills] + [len(calls)]
    assert drafts and len(starts) - 1 == len(drafts)
    for draft, start, end in zip(drafts, starts, starts[1:]):
        k = len(calls[start][1])
        assert end - start == k == 3
        kept: list[int] = []
        for step, (fills, drafted) in enumerate(calls[start:end]):
            assert fills == kept and len(drafted) == k - step
            kept += drafted[:1] if step < end - start - 1 else drafted
        assert draft.token_ids == kept[:len(draft.token_ids)]   # NOTE: cut in place to the request's room later


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_dflash_denoising_steps_in_fixed_shape_graphs_are_the_eager_drafts(trained: dict, max_num_seqs: int,
                                                                           tiny_runner: ModelRunner) -> None:
    prompts = _prompts(16, seed=3)[8:14]
    stats = {}
    for mode in ("off", "eager"):
        proposer = DFlashProposerConfig(checkpoint=str(trained["dflash_fill"][0]), denoise_steps=3,
                                        min_confidence=0.2, always_draft=1)
        engine = SpeculativeEngine(tiny_runner, proposer, num_spec_tokens=3,
                                   scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32),
                                   kv_cache=KV, cuda_graphs=CudaGraphConfig(mode=mode, capture_sizes=(1, 2, 4)))
        run_one_arrival_per_step(engine, make_requests(prompts, 24, ignore_eos=True))
        stats[mode] = engine.stats()
    assert stats["eager"]["spec/draft_graph_replays"] > 0
    for key in ("spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates"):
        assert stats["eager"][key] == stats["off"][key], key


def test_dflash_denoising_steps_need_a_drafter_trained_with_fills(trained: dict, tiny_runner: ModelRunner) -> None:
    with pytest.raises(LabError, match="max_fill"):
        SpeculativeEngine(tiny_runner, DFlashProposerConfig(checkpoint=str(trained["dflash"][0]), denoise_steps=2),
                          num_spec_tokens=2, kv_cache=KV)
    with pytest.raises(LabError, match="denoise_steps to 1..3"):
        SpeculativeEngine(tiny_runner, DFlashProposerConfig(checkpoint=str(trained["dflash_fill"][0]), denoise_steps=4),
                          num_spec_tokens=3, kv_cache=KV)
