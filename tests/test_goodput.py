"""engine.draft_policy=goodput (lab/spec/goodput.py): the cost and acceptance models, the choice, and the engine
staying lossless while it cuts drafts."""

from __future__ import annotations

import re

import pytest
from hydra.utils import instantiate

from lab.engines.ar import AREngine
from lab.engines.speculative import SpeculativeEngine
from lab.errors import LabError
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from lab.spec.dflash import DFlashProposerConfig
from lab.spec.draft_model import DraftModelProposerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.goodput import (AcceptanceModel, GoodputPolicy, StepCostModel, Verdict, calibrated_prior,
                               calibration_rows, choose)
from lab.spec.ngram_config import NgramProposerConfig
from tests.conftest import compose_cfg
from tests.helpers import make_requests
from tests.test_speculative import KV, _repetitive_prompts


def test_step_costs_start_at_a_median_and_unmeasured_row_counts_look_free() -> None:
    costs = StepCostModel(first_samples=3, stale_after=10)
    assert costs.cost(1) is None
    costs.observe(1, 0.5)                 # NOTE: a first step pays one-off costs
    assert costs.cost(1) == pytest.approx(0.5)          # until the third sample, the lower median of what it has
    costs.observe(1, 0.010)
    assert costs.cost(1) == pytest.approx(0.010)
    costs.observe(1, 0.012)                             # the median of the first three: the one-off cost is gone
    assert costs.cost(1) == pytest.approx(0.012)
    assert costs.cost(3) == pytest.approx(0.012)        # not measured: the nearest smaller count's, so it gets tried
    for _ in range(3):
        costs.observe(3, 0.020)
    assert costs.cost(3) == pytest.approx(0.020) and costs.cost(2) == pytest.approx(0.016)   # interpolated
    costs.observe(3, 0.030)
    assert costs.cost(3) == pytest.approx(0.020 + 0.2 * 0.010)   # a moving average from then on
    for _ in range(3):
        costs.observe(5, 0.040)
    assert costs.cost(4) == pytest.approx((0.022 + 0.040) / 2) and costs.cost(9) == pytest.approx(0.040)
    for _ in range(11):
        costs.observe(1, 0.012)
    assert costs.cost(3) == pytest.approx(0.012)        # stale: tried again
    assert StepCostModel(first_samples=1).cost(4) is None


def test_calibrated_prices_stand_for_unmeasured_counts_scaled_as_the_measured_compare() -> None:
    costs = StepCostModel(first_samples=1, stale_after=5, prior={1: 0.010, 2: 0.015, 4: 0.030})
    assert costs.measured_up_to(1) and costs.cost(3) == pytest.approx(0.0225) and costs.cost(9) == pytest.approx(0.030)
    costs.observe(1, 0.020)   # NOTE: the machine (or the context) is twice as slow as when calibrated
    assert costs.cost(1) == pytest.approx(0.020) and costs.cost(4) == pytest.approx(0.060)
    costs.observe(4, 0.040)   # NOTE: one factor from both: (0.020 + 0.040) / (0.010 + 0.030)
    assert costs.cost(2) == pytest.approx(0.0225) and costs.cost(3) == pytest.approx((0.0225 + 0.040) / 2)
    for _ in range(10):
        costs.observe(1, 0.020)
    assert costs.cost(4) == pytest.approx(0.060)   # NOTE: 4's measurement went stale; its prior never does


def test_a_calibration_never_prices_more_rows_below_fewer() -> None:
    timings = {1: [0.5, 0.010, 0.011], 2: [0.016], 3: [0.012, 0.014, 0.013], 4: [0.020]}   # NOTE: 3 timed low
    assert calibrated_prior(timings) == pytest.approx({1: 0.011, 2: 0.0145, 3: 0.0145, 4: 0.020})


def test_calibration_rows_are_dense_where_steps_are_small_and_end_at_the_most() -> None:
    assert calibration_rows(1) == [1] and calibration_rows(3) == [1, 2, 3]
    assert calibration_rows(40) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40]
    assert calibration_rows(50)[-3:] == [40, 48, 50]


def test_acceptance_starts_at_the_confidence_and_learns_per_position_and_bin() -> None:
    acceptance = AcceptanceModel(prior_strength=4.0)
    assert acceptance.estimate(0, 0.9) == pytest.approx(0.9)
    assert acceptance.estimate(1, None) == pytest.approx(1.0)   # no confidence: optimistic until observed
    for _ in range(36):   # NOTE: an overconfident drafter: its 0.9s are right a quarter of the time
        acceptance.observe([0.95, 0.92], 0)
    assert acceptance.estimate(0, 0.91) == pytest.approx((0 + 4 * 0.91) / 40)
    assert acceptance.estimate(1, 0.92) == pytest.approx(0.92)   # never judged: the first was rejected
    acceptance.observe([None, None, None], 2)
    assert acceptance.counts[(0, -1)] == [1, 1] and acceptance.counts[(2, -1)] == [0, 1]


def test_choose_keeps_drafts_worth_their_rows() -> None:
    free = lambda rows: 1.0                                          # noqa: E731 - a GPU: rows cost nothing
    assert choose(1, [[0.3, 0.1, 0.02]], free, 0.05) == [3]
    linear = lambda rows: 1.0 + 0.25 * (rows - 1)                    # noqa: E731 - this CPU with the GGUF blocks
    assert choose(1, [[0.9, 0.8, 0.3]], linear, 0.05) == [2]
    assert choose(1, [[0.2, 0.1]], linear, 0.05) == [0]
    assert choose(1, [[]], linear, 0.0) == [0]
    # NOTE: a batch: the surest drafts first, whoever drafted them; each request keeps a prefix of its drafts
    assert choose(3, [[0.95, 0.9], [0.1, 0.05], [0.6, 0.2]], lambda rows: 1 + 0.1 * (rows - 3), 0.0) == [2, 0, 1]
    assert choose(2, [[1.0, 1.0], [1.0, 1.0]], lambda rows: 1.0, 0.0) == [2, 2]


def test_the_policy_measures_before_it_cuts_and_reports() -> None:
    policy = GoodputPolicy(StepCostModel(first_samples=1))
    assert policy.lengths(1, [[0.5, None]]) is None                  # nothing measured: verify all (a measurement)
    policy.costs.observe(1, 0.010)
    policy.costs.observe(2, 0.015)
    policy.costs.observe(3, 0.030)
    assert policy.lengths(1, [[0.9, 0.2]]) == [1]
    stats = policy.stats()
    assert stats["spec/goodput_kept_draft_share"] == pytest.approx(0.5)
    assert stats["spec/goodput_step_cost/3_rows"] == pytest.approx(3.0)


def _proposers(source) -> dict:
    return {"draft_equals_target": DraftModelProposerConfig(source=source),
            "ngram": NgramProposerConfig(min_n=1, max_n=3),
            "eagle": EagleProposerConfig(checkpoint=None),
            "dflash": DFlashProposerConfig(checkpoint=None, drafter={"block_size": 4})}


@pytest.mark.parametrize("proposer, max_num_seqs", [("draft_equals_target", 1), ("ngram", 4), ("eagle", 1),
                                                   ("dflash", 1), ("dflash", 4)])
def test_goodput_policy_is_lossless_and_cuts_drafts(proposer: str, max_num_seqs: int, tiny_source,
                                                    tiny_runner: ModelRunner) -> None:
    prompts = _repetitive_prompts(5, seed=1)
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(
        make_requests(prompts, 20, ignore_eos=True)).requests]
    engine = SpeculativeEngine(tiny_runner, _proposers(tiny_source)[proposer], num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                               kv_cache=KV, draft_policy="goodput")
    if proposer in ("eagle", "dflash"):   # NOTE: the drafter reports its confidences though nothing gates on them
        assert engine.proposer.gate.active and engine.proposer.gate.min_confidence == 0
    # NOTE: rows priced as on a compute-bound CPU (every row as dear as the step) after a first measured step:
    # only a sure draft is worth one, so the random drafters' are cut
    engine.goodput.costs = StepCostModel(smoothing=0.0, first_samples=1, stale_after=10**9)
    for rows in range(1, 64):
        engine.goodput.costs.observe(rows, 0.01 * rows)
    result = engine.run(make_requests(prompts, 20, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected, f"{proposer} with goodput changed the output"
    stats = engine.stats()
    assert engine.kv_manager.num_held_blocks == 0
    if proposer == "draft_equals_target":   # NOTE: its drafts are always accepted: all worth their rows once learnt
        assert stats["spec/goodput_kept_draft_share"] > 0.6 and stats["spec/tokens_per_target_forward"] > 2
    elif proposer != "ngram":
        assert stats["spec/goodput_kept_draft_share"] < 0.5, stats


def test_draft_policy_from_the_config_and_a_bad_one_names_the_fix(tiny_source, tiny_runner: ModelRunner,
                                                                  tmp_path) -> None:
    cfg = compose_cfg(["model=tiny", "engine=dflash", "engine.draft_policy=goodput", "engine.proposer.checkpoint=null",
                       f"hydra.run.dir={tmp_path}"])
    engine = instantiate(cfg.engine, runner=tiny_runner)
    assert engine.goodput is not None and engine.without_speculation().goodput is None
    assert compose_cfg(["model=tiny", "engine=speculative"]).engine.draft_policy == "static"
    goodput = compose_cfg(["+experiment=crossover", "engine=dflash_goodput"]).engine
    dflash = compose_cfg(["+experiment=crossover", "engine=dflash"]).engine
    assert goodput.draft_policy == "goodput" and goodput.proposer.min_confidence == 0   # the policy decides alone
    assert goodput.name == "dflash_goodput" and goodput.proposer.checkpoint == dflash.proposer.checkpoint
    with pytest.raises(LabError, match="engine.draft_policy must be one of"):
        SpeculativeEngine(tiny_runner, NgramProposerConfig(), num_spec_tokens=2, kv_cache=KV, draft_policy="auto")
    assert SpeculativeEngine(tiny_runner, NgramProposerConfig(), num_spec_tokens=0, kv_cache=KV,
                             draft_policy="goodput").goodput is None


def test_the_printed_table_shows_what_the_policy_verified(tiny_runner: ModelRunner) -> None:
    from lab.metrics.report import format_table
    from lab.metrics.summary import summarize

    engine = SpeculativeEngine(tiny_runner, NgramProposerConfig(min_n=1, max_n=3), 3, SchedulerConfig(2, 64), KV,
                               draft_policy="goodput")
    result = engine.run(make_requests(_repetitive_prompts(3, seed=6), 12, ignore_eos=True))
    stats = engine.stats()
    table = format_table({"engine": engine.name, "model_id": "tiny", "peak_memory_mb": 1.0,
                          **summarize(result.requests, result.duration), **stats})
    section = table.split("Speculative Decoding")[1].splitlines()
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in section[1:-1])   # label  value
    assert rows["Goodput: drafts verified (%)"] == f"{100 * stats['spec/goodput_kept_draft_share']:.1f}"
    assert rows["Goodput: step cost by rows"].startswith(f"{next(iter(engine.goodput.costs.estimates()))}: 1.00")


def test_drafting_pauses_after_a_window_that_lost_and_resumes_after_one_that_paid() -> None:
    policy = GoodputPolicy(StepCostModel(first_samples=1), drafting=Verdict(window=4, pause=3))
    assert not policy.should_draft(1)   # NOTE: nothing measured: a plain step first, the price drafts are weighed on
    policy.costs.observe(1, 0.010)
    policy.costs.observe(2, 0.020)
    policy.observe_draft(0.002)
    for _ in range(4):   # NOTE: every draft rejected: 1 token for a 2-row step and a draft, against 1 a plain step
        assert policy.should_draft(1)
        policy.observe_verify(1, 2, 1)
    assert [policy.should_draft(1) for _ in range(3)] == [False, False, True]
    for _ in range(4):   # NOTE: 2.5 tokens a step for 2.2 plain steps' time: paid
        policy.observe_verify(1, 2, 2.5)
        assert policy.should_draft(1)
    assert policy.stats()["spec/goodput_paused_share"] == pytest.approx(3 / 12)
    batch = GoodputPolicy(StepCostModel(first_samples=1))
    batch.costs.observe(4, 0.010)
    assert batch.should_draft(4) and not batch.should_draft(2)   # a smaller batch: its plain step measured first
    batch.observe_verify(32, 64, 40)   # NOTE: 8 tokens more than a plain step's 32
    assert batch.drafting.requests == 32 and batch.drafting.saved_s == pytest.approx(8 * 0.010 / 32)


def test_a_verdict_stops_a_clear_loss_early_and_judges_one_near_the_line_on_its_window() -> None:
    clear = Verdict(window=8, pause=5, early=2)
    clear.observe(1, 2, 0.003, 0.001)      # NOTE: 3x what it saved after 2 request-steps
    assert clear.paused_until == 1 + 5 and clear.requests == 0
    near = Verdict(window=8, pause=5, early=2)
    near.observe(1, 2, 0.0012, 0.001)      # NOTE: 1.2x: the whole window decides
    assert near.paused_until == 0 and near.requests == 2
    near.observe(2, 6, 0.0, 0.001)         # NOTE: 1.2 ms spent against 2 ms saved over the window: paid
    assert near.paused_until == 0 and near.requests == 0


def test_a_cascades_fallback_pauses_where_its_drafts_do_not_pay_for_their_draft_and_rows() -> None:
    policy = GoodputPolicy(StepCostModel(prior={4: 0.020, 5: 0.023, 6: 0.026}), fallback=Verdict(window=4, pause=3))
    for _ in range(2):   # NOTE: 2 of 4 requests drafted by the fallback, 1 row kept, never accepted: 3 ms + 1 ms each
        assert policy.should_draft(4) and policy.should_draft_fallback()
        policy.observe_fallback(4, 5, 2, 1, 0, 0.001)
    assert policy.fallback.paused_until == 2 + 3
    assert [policy.should_draft(4) and policy.should_draft_fallback() for _ in range(3)] == [False, False, True]
    assert policy.stats()["spec/goodput_fallback_paused_share"] == pytest.approx(2 / 5)
    assert policy.fallback_resumes   # NOTE: its first step back reads the context it skipped: left out of the verdict
    policy.observe_fallback(4, 5, 2, 1, 0, 0.030)
    assert policy.fallback.requests == 0
    for _ in range(2):   # NOTE: 2 rows kept, both accepted: 2 x 5 ms of plain steps for 6 ms of rows and 1 ms
        assert policy.should_draft(4) and policy.should_draft_fallback() and not policy.fallback_resumes
        policy.observe_fallback(4, 6, 2, 2, 2, 0.001)
    assert policy.fallback.paused_until == 5 and policy.should_draft(4) and policy.should_draft_fallback()
    policy.observe_fallback(4, 6, 0, 0, 0, 0.0)   # NOTE: a step it drafted nothing for: no verdict on it
    assert policy.fallback.requests == 0
    policy.drafting.paused_until = policy.num_steps + 2   # NOTE: a pause of all drafting is one of the fallback's too
    assert not policy.should_draft(4) and policy.should_draft(4) and policy.should_draft_fallback()
    assert policy.fallback_resumes


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_calibration_times_every_rung_then_leaves_the_engine_as_it_was(max_num_seqs: int, tiny_runner: ModelRunner,
                                                                       tiny_source) -> None:
    prompts = _repetitive_prompts(4, seed=2)
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(
        make_requests(prompts, 12, ignore_eos=True)).requests]
    engine = SpeculativeEngine(tiny_runner, _proposers(tiny_source)["dflash"], num_spec_tokens=3,
                               scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
                               kv_cache=KV, draft_policy="goodput")
    calibrated = engine.calibrate(8)   # NOTE: more than the scheduler runs at once: its max_num_seqs caps the batch
    assert list(calibrated) == calibration_rows(max_num_seqs * 4) and all(s > 0 for s in calibrated.values())
    assert engine.goodput.costs.prior == calibrated and not engine.goodput.costs.seconds
    assert engine.kv_manager.num_held_blocks == 0 and not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] == 0 and not engine.phases.steps   # NOTE: its steps are not counted
    result = engine.run(make_requests(prompts, 12, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected
    assert engine.goodput.stats()["spec/goodput_paused_share"] == 0   # NOTE: priced at once: no plain step first
    for off in (SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, kv_cache=KV),
                SpeculativeEngine(tiny_runner, NgramProposerConfig(), 2, kv_cache=KV, draft_policy="goodput",
                                  goodput_calibration=False)):
        assert off.calibrate(4) == {} and not off.phases.steps


def test_a_run_calibrates_the_policy_for_its_concurrency_before_it_is_measured(tmp_path) -> None:
    from lab.run import run

    cfg = compose_cfg(["model=tiny", "logger=none", "engine=dflash_goodput", "engine.proposer.checkpoint=null",
                       "engine.measure_speedup=true", "workload.num_prompts=3", "workload.max_concurrency=2",
                       "workload.input_len=16", "workload.output_len=6", "workload.num_warmups=0",
                       f"hydra.run.dir={tmp_path}"])
    results = run(cfg, tmp_path)
    assert results["spec/goodput_calibrated_max_rows"] == 2 * (1 + 2)   # NOTE: 2 requests with 2 drafts each
    assert results["spec/same_output_as_baseline"] and results["spec/goodput_paused_share"] == 0
    off = compose_cfg(["model=tiny", "engine=dflash_goodput", "engine.goodput_calibration=false"])
    assert not off.engine.goodput_calibration


def test_the_crossover_sweeps_suffix_decoding_then_dflash_under_the_calibrated_policy(tmp_path) -> None:
    cfg = compose_cfg(["+experiment=crossover", "engine=suffix_dflash_goodput"], run_dir=tmp_path)
    assert cfg.engine.name == "suffix_dflash_goodput" and cfg.engine.draft_policy == "goodput"
    assert cfg.engine.goodput_calibration and cfg.engine.proposer._target_.endswith("CascadeProposerConfig")
    assert "suffix_dflash_goodput" in cfg.hydra.sweeper.params.engine.split(",")


def test_a_server_engine_is_calibrated_as_it_is_built() -> None:
    from hydra import compose, initialize_config_dir

    from lab.serve.cli import EngineFactory
    from tests.conftest import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="serve", overrides=["model=tiny", "engine=dflash_goodput",
                                                      "engine.proposer.checkpoint=null",
                                                      "engine.scheduler.max_num_seqs=2"])
    engine = EngineFactory.from_cfg(cfg)()
    assert max(engine.goodput.costs.prior) == 2 * (1 + 2) and not engine.has_unfinished_requests()


def test_a_cascade_under_the_policy_stops_calling_a_fallback_that_does_not_pay(tiny_runner: ModelRunner) -> None:
    from lab.spec.cascade import CascadeProposerConfig
    from lab.spec.suffix import SuffixProposerConfig

    prompts = _repetitive_prompts(3, seed=4)
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(
        make_requests(prompts, 24, ignore_eos=True)).requests]
    cascade = CascadeProposerConfig(SuffixProposerConfig(), DFlashProposerConfig(checkpoint=None,
                                                                                 drafter={"block_size": 4}))
    engine = SpeculativeEngine(tiny_runner, cascade, num_spec_tokens=3, scheduler=SchedulerConfig(3, 64), kv_cache=KV,
                               draft_policy="goodput")
    assert engine.proposer.can_pause_fallback
    # NOTE: every row as dear as a step, and a verdict every 2 fallback drafts: the random drafter's are never worth it
    engine.goodput.costs = StepCostModel(prior={rows: 0.01 * rows for rows in range(1, 16)})
    engine.goodput.fallback = Verdict(window=2, pause=10**6)
    result = engine.run(make_requests(prompts, 24, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected
    stats = engine.stats()
    assert stats["spec/fallback_drafts"] > 0 and engine.goodput.fallback.paused_until > 0
    assert stats["spec/goodput_fallback_paused_share"] > 0.5 and engine.proposer.fallback_paused
    assert 0 < engine.goodput.step_overhead_s < 1.0   # NOTE: each step's seconds outside its timed phases
    from lab.metrics.report import format_table
    from lab.metrics.summary import summarize

    table = format_table({"engine": engine.name, "model_id": "tiny", "peak_memory_mb": 1.0,
                          **summarize(result.requests, result.duration), **stats})
    shown = f"{100 * stats['spec/goodput_fallback_paused_share']:.1f}"
    assert re.search(r"Goodput: steps without the fallback \(%\)\s+" + re.escape(shown), table)
