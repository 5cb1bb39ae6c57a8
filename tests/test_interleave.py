"""Paired runs step by step (lab/engines/interleave.py): each engine on its own clock, turns by output tokens, and
run_measured's choice between turns by steps and by chunks."""

from __future__ import annotations

import time

import pytest

from lab.engines.base import Engine, RunResult
from lab.engines.interleave import OwnClock, run_interleaved
from lab.engines.speculative import SpeculativeEngine
from lab.engines.static import StaticBatchEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.request import Request, SamplingParams
from lab.models.sources import ModelSource
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from lab.spec.draft_model import DraftModelProposerConfig
from lab.spec.ngram_config import NgramProposerConfig
from tests.helpers import make_requests

KV = PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10, 11], [20, 21, 22, 20, 21, 22, 20], [30, 31, 30, 31, 30]]


def _engine(runner: ModelRunner, **kwargs: object) -> SpeculativeEngine:
    return SpeculativeEngine(runner, NgramProposerConfig(min_n=1, max_n=3), 2, SchedulerConfig(4, 64), KV, **kwargs)


def _drafting_the_target(runner: ModelRunner, source: ModelSource) -> SpeculativeEngine:
    """Drafts by the target itself: every draft is accepted, so each step emits 3 tokens."""
    return SpeculativeEngine(runner, DraftModelProposerConfig(source=source), 2, SchedulerConfig(4, 64), KV)


def test_own_clock_takes_out_the_time_between_an_engines_steps() -> None:
    clock = OwnClock()
    clock.add(10.0, 11.0)   # this engine stepped from 10 to 11 s of wall time, another from 11 to 12
    clock.add(12.0, 14.0)
    assert clock.total == 3.0
    assert [clock.own(t) for t in (9.0, 10.0, 10.5, 11.0, 11.5, 12.0, 13.0, 14.0, 20.0)] == \
        [0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 2.0, 3.0, 3.0]
    request = Request("r0", [1, 2], SamplingParams(max_tokens=2), arrival_time=10.25)
    request.first_scheduled_time, request.token_times, request.finished_time = 10.5, [10.75, 13.5], 13.5
    moved = clock.move(RunResult([request], start_time=10.0, duration=3.5))
    assert (moved.start_time, moved.duration) == (0.0, 2.5), "the run's 4 s of wall time held 2.5 s of its steps"
    assert (request.arrival_time, request.first_scheduled_time, request.token_times, request.finished_time) == \
        (0.25, 0.5, [0.75, 2.5], 2.5)


@pytest.mark.parametrize("max_concurrency", [1, 2])
def test_engines_take_turns_by_output_tokens_and_each_keeps_its_own_time(tiny_runner: ModelRunner,
                                                                           tiny_source: ModelSource,
                                                                           max_concurrency: int) -> None:
    """The engine with fewer output tokens steps next, so a speculative engine steps less often for the same tokens;
    outputs equal the baseline's; each engine's duration is its own steps' time, and the two never add up to more
    than the wall time they took together."""
    spec = _drafting_the_target(tiny_runner, tiny_source)
    base = spec.without_speculation()
    request_sets = [make_requests(PROMPTS, 12, ignore_eos=True), make_requests(PROMPTS, 12, ignore_eos=True)]
    engines: list[Engine] = [base, spec]
    steps: list[tuple[int, int, int]] = []   # (engine, its output tokens, the other's) at each step

    def recorded(i: int) -> None:
        step = engines[i].step

        def wrapper() -> list[Request]:
            tokens = [sum(r.num_output_tokens for r in requests) for requests in request_sets]
            steps.append((i, tokens[i], tokens[1 - i]))
            return step()
        engines[i].step = wrapper

    recorded(0)
    recorded(1)
    wall_start = time.perf_counter()
    baseline, outcome = run_interleaved(engines, request_sets, max_concurrency)
    wall = time.perf_counter() - wall_start
    assert [r.output_token_ids for r in baseline.requests] == [r.output_token_ids for r in outcome.requests]
    total = len(PROMPTS) * 12
    # NOTE: a step of the engine behind; an engine that finished its work leaves the other to step alone
    assert all(mine <= theirs or theirs == total for _, mine, theirs in steps)
    assert sum(i == 1 for i, _, _ in steps) < sum(i == 0 for i, _, _ in steps), "fewer steps for the same tokens"
    assert 0 < baseline.duration and 0 < outcome.duration and baseline.duration + outcome.duration <= wall
    for result in (baseline, outcome):
        for request in result.requests:
            times = [request.arrival_time, *request.token_times]
            assert times == sorted(times) and result.start_time <= times[0]
            assert times[-1] <= result.start_time + result.duration + 1e-9


def test_run_measured_takes_turns_by_steps_when_every_request_arrives_at_once(tiny_runner: ModelRunner,
                                                                                monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    from lab.run import run_measured, speedup_fields, speedup_turns

    runs: list[str] = []
    original = Engine.run
    monkeypatch.setattr(Engine, "run", lambda self, *a, **k: runs.append(self.name) or original(self, *a, **k))
    engine = _engine(tiny_runner, measure_speedup=True, speedup_rounds=2)
    at_once = make_requests(PROMPTS, 6, ignore_eos=True)
    turns = speedup_turns(engine, at_once)
    baseline, outcome = run_measured(engine, at_once, max_concurrency=2)
    assert runs == [], "auto: every request at t = 0, so turns by steps (Engine.serve), no whole runs"
    fields = speedup_fields(baseline, outcome, "engine", turns)
    assert fields["spec/same_output_as_baseline"] and fields["spec/speedup_tpot"] > 0
    assert fields["spec/speedup_turns"] == "steps", "results.json says how the ratio was measured"
    spread = make_requests(PROMPTS, 6, ignore_eos=True)
    for i, request in enumerate(spread):
        request.arrival_time = 0.001 * i
    assert speedup_turns(engine, spread) == "chunks"
    run_measured(engine, spread, max_concurrency=2)
    assert runs == ["speculative_k0", "speculative", "speculative", "speculative_k0"], \
        "auto: arrivals over time, so ABBA turns by chunks"
    stepped = _engine(tiny_runner, measure_speedup=True, speedup_turns="steps")
    with pytest.raises(LabError, match="(?s)arrive at once.*speedup_turns=chunks"):
        run_measured(stepped, spread, max_concurrency=2)
    with pytest.raises(LabError, match="speedup_turns must be one of"):
        _engine(tiny_runner, speedup_turns="rounds")


def test_an_engine_with_its_own_run_loop_cannot_take_turns_by_steps(tiny_runner: ModelRunner) -> None:
    static = StaticBatchEngine(tiny_runner, batch_size=2)
    with pytest.raises(LabError, match="(?s)run loop of its own.*speedup_turns=chunks"):
        run_interleaved([static, _engine(tiny_runner)], [make_requests(PROMPTS, 4), make_requests(PROMPTS, 4)], 2)
