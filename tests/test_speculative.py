"""Speculative decoding is lossless: greedy output equals `ar`'s with draft = target (all accepted), an
unrelated random draft (mostly rejected), layerskip and n-gram, at batch 1 and batch > 1 with mixed
lengths; rolled-back KV equals a run that never drafted; num_spec_tokens=0 is the plain engine."""

from __future__ import annotations

import re

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.speculative import SpeculativeEngine
from lab.kv_cache import PagedKVCacheConfig
from lab.request import Request, SamplingParams
from lab.models.sources import tiny
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from lab.spec.cascade import CascadeProposerConfig
from lab.spec.dflash import DFlashProposerConfig
from lab.errors import LabError
from lab.spec.draft_model import DraftModelProposerConfig, LayerSkipProposerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.ngram_config import NgramProposerConfig
from lab.spec.schedule import SpecSchedule
from lab.spec.suffix import SuffixProposerConfig
from tests.helpers import chat_prompt, make_requests, record_drafts

KV = PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None)


def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeats, so n-gram lookup finds matches; mixed lengths."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        motif = torch.randint(3, 128, (int(torch.randint(2, 6, (1,), generator=generator)),), generator=generator)
        prompts.append(motif.repeat(2 + i % 4).tolist() + torch.randint(3, 128, (i + 1,), generator=generator).tolist())
    return prompts


def _proposers(tiny_source) -> dict:
    return {
        "draft_equals_target": DraftModelProposerConfig(source=tiny_source),
        "random_draft": DraftModelProposerConfig(source=tiny(seed=7, vocab_size=128, with_tokenizer=False)),
        "layerskip": LayerSkipProposerConfig(num_layers=1),
        "ngram": NgramProposerConfig(min_n=1, max_n=3),
        "ngram_short_matches": NgramProposerConfig(min_n=1, max_n=3, short_match_tokens=1, long_match_n=2),
        "suffix": SuffixProposerConfig(min_confidence=0.2),
    }


def _ar_outputs(runner: ModelRunner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [r.output_token_ids for r in AREngine(runner).run(make_requests(prompts, max_tokens, ignore_eos=True)).requests]


@pytest.mark.parametrize("proposer, max_num_seqs", [("draft_equals_target", 1), ("draft_equals_target", 4),
                                                   ("random_draft", 4), ("layerskip", 1), ("ngram", 4),
                                                   ("ngram_short_matches", 4), ("suffix", 1), ("suffix", 4)])
def test_greedy_speculation_is_lossless_on_tiny(proposer: str, max_num_seqs: int, tiny_source,
                                                tiny_runner: ModelRunner) -> None:
    prompts = _repetitive_prompts(5, seed=1)
    expected = _ar_outputs(tiny_runner, prompts, 20)
    engine = SpeculativeEngine(tiny_runner, _proposers(tiny_source)[proposer], num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                               kv_cache=KV)
    requests = make_requests(prompts, 20, ignore_eos=True)
    for i, request in enumerate(requests):
        request.arrival_time = 0.002 * i
    result = engine.run(requests)
    assert [r.output_token_ids for r in result.requests] == expected, f"{proposer} changed the output"
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert engine.kv_manager.num_held_blocks == 0 and engine.proposer.stats().get("spec/draft_skipped_requests", 0) == 0
    if proposer == "draft_equals_target":
        assert stats["spec_decode_acceptance_rate"] == pytest.approx(100.0), stats["spec_decode_acceptance_rate"]
        assert stats["spec/tokens_per_target_forward"] > 2.5
    if proposer == "random_draft":
        assert stats["spec_decode_acceptance_rate"] < 50.0


@pytest.mark.parametrize("proposer", ["draft_equals_target", "random_draft"])
def test_verify_steps_grouped_by_the_fast_backend_are_lossless(proposer: str, tiny_source, tiny_runner: ModelRunner,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The `fast` backend (a GPU's) attends side-by-side verify steps of equal length in one SDPA call: at batch 4
    the output is still `ar`'s, and most steps were grouped."""
    import lab.kv_cache.split_attention as split_attention

    grouped: list[int] = []
    prepare_group = split_attention.SplitAttention._prepare_group

    def recording(cache, index, start: int, end: int):
        meta = prepare_group(cache, index, start, end)
        grouped.append(meta.num_seqs if meta.num_query > 1 else 0)
        return meta

    monkeypatch.setattr(split_attention.SplitAttention, "_prepare_group", staticmethod(recording))
    prompts = _repetitive_prompts(6, seed=3)
    expected = _ar_outputs(tiny_runner, prompts, 20)
    kv = PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None, attention="fast")
    engine = SpeculativeEngine(tiny_runner, _proposers(tiny_source)[proposer], num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv_cache=kv)
    result = engine.run(make_requests(prompts, 20, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected, f"{proposer} changed the output"
    assert max(grouped) == 4, f"verify groups of {sorted(set(grouped))} requests"


@pytest.mark.parametrize("proposer", ["draft_model", "layerskip"])
def test_drafting_at_the_end_of_the_context_is_lossless(proposer: str) -> None:
    """prompt + max_tokens fills a 48-position model: near the end the drafter still runs k = 4 drafts, some past
    the last position (the engine trims them), and must not index past its RoPE table. A second, short request in
    the same steps must not be failed with it."""
    source = tiny(seed=0, vocab_size=128, with_tokenizer=False, max_position_embeddings=48)
    runner = ModelRunner(source, dtype="float32", device="cpu")
    config = (DraftModelProposerConfig(source=tiny(seed=7, vocab_size=128, with_tokenizer=False,
                                                   max_position_embeddings=48))
              if proposer == "draft_model" else LayerSkipProposerConfig(num_layers=1))
    prompts, max_tokens = [_repetitive_prompts(1, seed=2)[0] * 8, [5, 6, 7]], [18, 24]
    prompts[0] = prompts[0][:48 - 18]
    expected = [_ar_outputs(runner, [p], n)[0] for p, n in zip(prompts, max_tokens)]
    engine = SpeculativeEngine(runner, config, num_spec_tokens=4, scheduler=SchedulerConfig(max_num_seqs=2),
                               kv_cache=KV)
    requests = [make_requests([p], n, ignore_eos=True)[0] for p, n in zip(prompts, max_tokens)]
    requests[1].request_id = "short"
    result = engine.run(requests)
    assert [r.error for r in result.requests] == [None, None]
    assert [r.output_token_ids for r in result.requests] == expected


def test_zero_spec_tokens_reproduces_the_plain_engine(tiny_source, tiny_runner: ModelRunner) -> None:
    prompts = _repetitive_prompts(4, seed=2)
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)
    plain = ContinuousBatchingEngine(tiny_runner, scheduler, KV)
    spec = SpeculativeEngine(tiny_runner, NgramProposerConfig(), num_spec_tokens=0, scheduler=scheduler, kv_cache=KV)
    a = plain.run(make_requests(prompts, 12, ignore_eos=True))
    b = spec.run(make_requests(prompts, 12, ignore_eos=True))
    assert [r.output_token_ids for r in a.requests] == [r.output_token_ids for r in b.requests]
    assert plain.num_steps == spec.num_steps, f"{plain.num_steps} != {spec.num_steps} steps"
    assert spec.stats()["spec_decode_num_drafts"] == 0


def test_spec_schedule_picks_k_by_batch_size() -> None:
    every = SpecSchedule.build(3)
    assert [every.num_spec_tokens(n) for n in (1, 8, 10_000)] == [3, 3, 3]
    stepped = SpecSchedule.build(3, [[1, 3], [4, 1]])
    assert [stepped.num_spec_tokens(n) for n in (1, 2, 4, 5, 32)] == [3, 1, 1, 0, 0]
    assert SpecSchedule.build(3, [[1, 3], [4, 1]], disable_by_batch_size=2).steps == ((1, 3), (2, 1))
    assert SpecSchedule.build(3, [[2, 3], [8, 1]], disable_by_batch_size=2).steps == ((2, 3),)
    assert SpecSchedule.build(2, None, disable_by_batch_size=4).steps == ((4, 2),)   # vLLM's option
    for bad, match in (([[1, 4]], "k in 0..3"), ([[4, 2], [2, 1]], "does not follow 4"), ([[0, 1]], "batch size must be"),
                       ([[1]], "is not \\[batch size, k\\]"), ([[1, 1.5]], "is not"), ([1, 2], "entry 1 is not"),
                       ([], "is empty")):
        with pytest.raises(LabError, match=match):
            SpecSchedule.build(3, bad)
    with pytest.raises(LabError, match="disable_by_batch_size must be a positive integer"):
        SpecSchedule.build(3, None, disable_by_batch_size=0)


def test_the_schedule_drafts_by_batch_size_and_stays_lossless(tiny_source, tiny_runner: ModelRunner) -> None:
    """Nothing drafted while 3+ requests run, 1 token at 2, 3 at 1 (the draft is the target: all accepted)."""
    prompts = _repetitive_prompts(5, seed=6)
    expected = _ar_outputs(tiny_runner, prompts, 16)
    engine = SpeculativeEngine(tiny_runner, DraftModelProposerConfig(source=tiny_source), num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv_cache=KV,
                               num_spec_tokens_by_batch_size=[[1, 3], [2, 1]])
    # staggered lengths, so the batch shrinks from 4 to 1 as requests finish
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=8 + 2 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    result = engine.run(requests)
    expected = [e[:8 + 2 * i] for i, e in enumerate(expected)]
    assert [r.output_token_ids for r in result.requests] == expected
    stats = engine.stats()
    assert stats["spec/num_steps_not_drafted"] > 0
    assert stats["spec/acceptance_histogram/1"] > 0 and stats["spec/acceptance_histogram/3"] > 0, stats
    assert stats["spec_decode_acceptance_rate"] == pytest.approx(100.0)


def _kv_prefix(engine: ContinuousBatchingEngine, request_id: str, num_tokens: int) -> torch.Tensor:
    table = engine.kv_manager.block_table(request_id)
    bs = engine.kv_manager.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(num_tokens)])
    keys = [k.flatten(1, 2)[:, slots] for k in engine.kv_cache.k]                  # L x (Hkv, T, D)
    return torch.stack(keys)


def test_rolled_back_kv_equals_a_run_that_never_drafted(tiny_source, tiny_runner: ModelRunner) -> None:
    prompt = _repetitive_prompts(1, seed=3)[0]
    plain = ContinuousBatchingEngine(tiny_runner, SchedulerConfig(max_num_seqs=1), KV)
    spec = SpeculativeEngine(tiny_runner, DraftModelProposerConfig(source=tiny(seed=7, vocab_size=128,
                                                                                with_tokenizer=False)),
                             num_spec_tokens=4, scheduler=SchedulerConfig(max_num_seqs=1), kv_cache=KV)
    (a,), (b,) = make_requests([prompt], 200, ignore_eos=True), make_requests([prompt], 200, ignore_eos=True)
    plain.add_request(a)
    spec.add_request(b)
    while b.num_output_tokens < 15:
        spec.step()
    while a.num_output_tokens < b.num_output_tokens:
        plain.step()
    assert a.output_token_ids == b.output_token_ids
    assert spec.num_drafts > 0 and spec.num_accepted_tokens < spec.num_draft_tokens  # some rollbacks happened
    n = min(a.num_computed_tokens, b.num_computed_tokens)
    diff = (_kv_prefix(plain, a.request_id, n) - _kv_prefix(spec, b.request_id, n)).abs().max()
    assert diff <= 1e-5, f"KV of the first {n} tokens differs by {diff:.2e} after rollbacks"


def test_sampled_speculation_runs_seeded_and_reproducibly(tiny_runner: ModelRunner) -> None:
    prompts = _repetitive_prompts(3, seed=4)

    def sample() -> list[list[int]]:
        engine = SpeculativeEngine(tiny_runner, LayerSkipProposerConfig(num_layers=1), num_spec_tokens=3,
                                   scheduler=SchedulerConfig(max_num_seqs=3), kv_cache=KV)
        requests = make_requests(prompts, 16, temperature=0.8, seed=11, ignore_eos=True)
        return [r.output_token_ids for r in engine.run(requests).requests]

    first = sample()
    assert first == sample() and all(len(o) == 16 for o in first)


# NOTE: engine=dflash_tree's drafter (proposer/dflash_tree.yaml), trained with up to 6 offsets given (fewer more
#   often): it redrafts under paths of up to 6 tokens
LEVELS_CHECKPOINT = "checkpoints/smollm2/dflash_56k_weighted.pt"


@pytest.mark.parametrize("proposer", ["layerskip", "ngram", "eagle", "dflash", "eagle_sharegpt", "dflash_sharegpt",
                                      "eagle_gsm8k", "dflash_gsm8k", "dflash_mix", "eagle_tree", "dflash_tree",
                                      "dflash_denoise", "dflash_paths", "dflash_redraft", "dflash_levels",
                                      "dflash_onpolicy", "dflash_gpu_cpu", "dflash_grafted"])
def test_greedy_speculation_is_lossless_on_smollm2(proposer: str, smollm2_runner: ModelRunner) -> None:
    """The real model; eagle and dflash draft with every committed checkpoint (checkpoints/smollm2/: the defaults,
    trained on ShareGPT and GSM8K's questions, DFlash's then on the target's own answers, with offset 1 sometimes
    given; those on ShareGPT alone; those trained further on GSM8K alone; DFlash's before the target's own answers
    and before the given offsets, and the chain's default until session 58), and the defaults verifying a tree of
    drafts (3 candidates for the first position; DFlash's 24 likeliest paths, also redrafted under 4 first tokens,
    and under 16 paths at each of 6 levels over the whole block as engine=dflash_tree does, and that with suffix
    decoding's chain grafted on); the drafter trained with fills, drafting in 3 denoising steps."""
    tokenizer = smollm2_runner.tokenizer
    prompts = [chat_prompt(tokenizer, t) for t in ("Repeat after me: one two three, one two three.",
                                                    "What is 2+2?", "Name a colour.")]
    expected = [r.output_token_ids for r in AREngine(smollm2_runner).run(make_requests(prompts, 24)).requests]
    config = {"layerskip": LayerSkipProposerConfig(num_layers=10), "ngram": NgramProposerConfig(),
              "eagle": EagleProposerConfig(), "dflash": DFlashProposerConfig(),
              "eagle_sharegpt": EagleProposerConfig(checkpoint="checkpoints/smollm2/eagle.pt"),
              "dflash_sharegpt": DFlashProposerConfig(checkpoint="checkpoints/smollm2/dflash.pt"),
              "eagle_gsm8k": EagleProposerConfig(checkpoint="checkpoints/smollm2/eagle_gsm8k.pt"),
              "dflash_gsm8k": DFlashProposerConfig(checkpoint="checkpoints/smollm2/dflash_gsm8k.pt"),
              "dflash_mix": DFlashProposerConfig(checkpoint="checkpoints/smollm2/dflash_mix.pt"),
              "eagle_tree": EagleProposerConfig(tree_width=3), "dflash_tree": DFlashProposerConfig(tree_width=3),
              "dflash_paths": DFlashProposerConfig(tree_nodes=24),
              "dflash_redraft": DFlashProposerConfig(tree_nodes=24, tree_redraft=4),
              "dflash_levels": DFlashProposerConfig(checkpoint=LEVELS_CHECKPOINT, tree_nodes=24, tree_redraft=16,
                                                    tree_redraft_levels=6),
              "dflash_onpolicy": DFlashProposerConfig(checkpoint="checkpoints/smollm2/dflash_onpolicy.pt"),
              "dflash_gpu_cpu": DFlashProposerConfig(checkpoint="checkpoints/smollm2/dflash_gpu_cpu.pt"),
              "dflash_grafted": CascadeProposerConfig(
                  SuffixProposerConfig(min_confidence=0.1), DFlashProposerConfig(
                      checkpoint=LEVELS_CHECKPOINT, tree_nodes=24, tree_redraft=16, tree_redraft_levels=6), 7, graft=True),
              "dflash_denoise": DFlashProposerConfig(checkpoint="checkpoints/smollm2/dflash_denoise.pt",
                                                     denoise_steps=3)}[proposer]
    # NOTE: the whole block (7 drafts) where the tree is redrafted, so that all 6 levels run (each needs later offsets)
    num_spec_tokens = 7 if proposer in ("dflash_levels", "dflash_grafted") else 3
    engine = SpeculativeEngine(smollm2_runner, config, num_spec_tokens=num_spec_tokens,
                               scheduler=SchedulerConfig(max_num_seqs=3),
                               kv_cache=PagedKVCacheConfig(block_size=16, num_blocks=64, kv_cache_memory_mb=None))
    outputs = [r.output_token_ids for r in engine.run(make_requests(prompts, 24)).requests]
    assert outputs == expected
    if proposer not in ("layerskip", "ngram"):   # the trained drafters get some of their drafts accepted
        assert engine.stats()["spec_decode_accepted_tokens"] > 0, engine.stats()


@pytest.mark.parametrize("levels, redraft, num_spec_tokens, nodes", [((1, 2), 4, 3, 24), ((3, 6), 16, 7, 62)])
def test_dflash_redraft_levels_change_the_trees_on_smollm2(smollm2_runner: ModelRunner, levels: tuple[int, int],
                                                           redraft: int, num_spec_tokens: int, nodes: int) -> None:
    """tree_redraft_levels 2: after the redraft under the 4 likeliest first tokens, the block is drafted again under
    the tree's 4 likeliest 2-token paths, so some trees take their third offsets from those; and levels four to six
    (16 paths a level, more than a node's 8 candidates, over the whole block: engine=dflash_tree's shape) change the
    trees over three. The output stays `ar`'s. (A drafter trained with 6 offsets given. On this short answer the
    fifth and sixth levels alone change no tree; on MT-Bench they add +0.028 to tau, docs/speculative.md.)"""
    prompts = [chat_prompt(smollm2_runner.tokenizer, "Count from one to twenty in words.")]
    expected = [r.output_token_ids for r in AREngine(smollm2_runner).run(make_requests(prompts, 32)).requests]
    drafts = {}
    for level in levels:
        config = DFlashProposerConfig(checkpoint=LEVELS_CHECKPOINT, tree_nodes=nodes, tree_redraft=redraft,
                                      tree_redraft_levels=level)
        engine = SpeculativeEngine(smollm2_runner, config, num_spec_tokens=num_spec_tokens, kv_cache=PagedKVCacheConfig(
            block_size=16, num_blocks=64, kv_cache_memory_mb=None))
        drafts[level] = record_drafts(engine)
        assert [r.output_token_ids for r in engine.run(make_requests(prompts, 32)).requests] == expected
    assert any(a.token_ids != b.token_ids for a, b in zip(drafts[levels[0]], drafts[levels[1]]))


@pytest.fixture
def engine_turns(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """(engine name, request ids) of every Engine.run call, in order: which engine took which turn."""
    from lab.engines.base import Engine

    turns: list[tuple[str, list[str]]] = []
    original_run = Engine.run

    def recording_run(self: Engine, requests: list, max_concurrency: int | None = None):
        turns.append((self.name, [r.request_id for r in requests]))
        return original_run(self, requests, max_concurrency)

    monkeypatch.setattr(Engine, "run", recording_run)
    return turns


def test_speedup_rounds_take_abba_turns_and_merge_every_request(tiny_runner: ModelRunner,
                                                                 engine_turns: list[tuple[str, list[str]]]) -> None:
    from lab.run import run_measured, speedup_fields

    turns = engine_turns
    engine = SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, SchedulerConfig(4, 64), KV,
                               measure_speedup=True, speedup_rounds=3)
    requests = make_requests(_repetitive_prompts(6, seed=5), 5, ignore_eos=True)
    for i, request in enumerate(requests):
        request.arrival_time = 0.001 * i
    baseline, outcome = run_measured(engine, requests, max_concurrency=1)
    base, spec = "speculative_k0", "speculative"
    assert [name for name, _ in turns] == [base, spec, spec, base, base, spec], "ABBA over 3 chunks"
    assert [ids for _, ids in turns[::2]] == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"]]
    assert [r.request_id for r in outcome.requests] == [r.request_id for r in baseline.requests] == \
        [f"r{i}" for i in range(6)]
    # NOTE: the merged duration sums the speculative chunks only, so it is shorter than the wall span of the
    # whole interleaved run, which also holds the baseline's turns
    span = max(r.finished_time for r in outcome.requests + baseline.requests) - baseline.start_time
    assert 0 < outcome.duration < span and 0 < baseline.duration < span
    assert outcome.duration + baseline.duration <= span
    fields = speedup_fields(baseline, outcome)
    assert fields["spec/same_output_as_baseline"] and fields["spec/speedup_tpot"] > 0
    with pytest.raises(Exception, match="speedup_rounds must be >= 1"):
        SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, SchedulerConfig(4, 64), KV, speedup_rounds=0)


def test_abba_turns_never_hold_fewer_requests_than_the_concurrency(tiny_runner: ModelRunner,
                                                                   engine_turns: list[tuple[str, list[str]]]) -> None:
    from lab.run import run_measured

    engine = SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, SchedulerConfig(4, 64), KV,
                               measure_speedup=True, speedup_rounds=4, speedup_turns="chunks")
    run_measured(engine, make_requests(_repetitive_prompts(6, seed=7), 3, ignore_eos=True), max_concurrency=2)
    assert [len(ids) for _, ids in engine_turns] == [2] * 6, \
        "4 rounds asked, 3 taken: a chunk of 1 would measure batch 1, not 2"
    engine_turns.clear()
    run_measured(engine, make_requests(_repetitive_prompts(4, seed=7), 3, ignore_eos=True), max_concurrency=4)
    assert [len(ids) for _, ids in engine_turns] == [4, 4], "one turn each when the requests only fill the batch once"


def test_speedup_against_the_ar_engine_runs_ar_first_and_only_at_concurrency_1(
        tiny_runner: ModelRunner, engine_turns: list[tuple[str, list[str]]]) -> None:
    from lab.run import run_measured, speedup_fields

    engine = SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, SchedulerConfig(4, 64), KV,
                               measure_speedup=True, speedup_baseline="ar", speedup_turns="chunks")
    requests = make_requests(_repetitive_prompts(3, seed=6), 6, ignore_eos=True)
    baseline, outcome = run_measured(engine, requests, max_concurrency=1)
    assert [name for name, _ in engine_turns] == ["ar", "speculative"]
    fields = speedup_fields(baseline, outcome, engine.speedup_baseline)
    assert fields["spec/same_output_as_baseline"] and fields["spec/speedup_baseline"] == "ar"
    with pytest.raises(Exception, match="(?s)serves one request at a time.*workload.max_concurrency=1"):
        run_measured(engine, make_requests(_repetitive_prompts(2, seed=6), 4), max_concurrency=4)
    with pytest.raises(Exception, match="speedup_baseline must be one of"):
        SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, SchedulerConfig(4, 64), KV, speedup_baseline="hf")


def test_the_printed_table_has_a_speculative_section(tiny_runner: ModelRunner) -> None:
    """vLLM's SpecDecoding metrics, the draft / verify split and the paired speedup are printed; runs without
    speculation print no such section."""
    from lab.metrics.report import format_table
    from lab.metrics.summary import summarize
    from lab.run import run_measured, speedup_fields

    engine = SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, SchedulerConfig(4, 64), KV,
                               measure_speedup=True, speedup_baseline="ar")
    baseline, outcome = run_measured(engine, make_requests(_repetitive_prompts(3, seed=6), 6, ignore_eos=True),
                                     max_concurrency=1)
    plain = {"engine": engine.name, "model_id": "tiny", "peak_memory_mb": 1.0,
             **summarize(outcome.requests, outcome.duration)}
    stats = engine.stats()
    table = format_table({**plain, **stats, **speedup_fields(baseline, outcome, "ar", "steps")})
    section = table.split("Speculative Decoding")[1].splitlines()
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in section[1:-1])   # label  value
    assert rows["Drafts / draft tokens / accepted"] == (f"{stats['spec_decode_num_drafts']} / "
                                                        f"{stats['spec_decode_draft_tokens']} / "
                                                        f"{stats['spec_decode_accepted_tokens']}")
    assert rows["Acceptance length (tau)"] == f"{stats['spec_decode_acceptance_length']:.2f}"
    assert len(rows["Per-position acceptance (%)"].split(", ")) == 2, "one rate per drafted position (k = 2)"
    assert rows["TPOT speedup over ar"].endswith("x (same output, turns by steps)")
    assert "Speculative Decoding" not in format_table(plain)


def test_reset_caches_forgets_prefix_blocks_and_the_suffix_history(tiny_runner: ModelRunner) -> None:
    engine = SpeculativeEngine(tiny_runner, SuffixProposerConfig(), 4, SchedulerConfig(4, 64),
                               PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None))
    engine.run(make_requests(_repetitive_prompts(3, seed=9), 8, ignore_eos=True))
    assert engine.kv_manager.pool.num_cached_blocks > 0 and engine.proposer.stats()["spec/suffix_cached_requests"] == 3
    engine.reset_caches()   # NOTE: lab.run does this after the warm-ups, which copy measured requests
    assert engine.kv_manager.pool.num_cached_blocks == 0 and engine.proposer.stats()["spec/suffix_cached_requests"] == 0
