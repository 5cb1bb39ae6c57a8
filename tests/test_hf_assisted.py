"""hf_assisted (HF assisted generation, batch 1): greedy tokens equal `ar`'s with every kind of drafter
(prompt lookup, early exit, draft = target, an unrelated draft), every token carries a timestamp even when
one target forward accepts several, stop tokens end requests as `ar` does, bad settings are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.hf_assisted import HFAssistedEngine
from lab.errors import LabError
from lab.models.sources import tiny
from lab.request import RequestStatus
from lab.run import run
from lab.runner import ModelRunner
from tests.conftest import compose_cfg
from tests.helpers import chat_prompt, make_requests


def _prompts(seed: int) -> list[list[int]]:
    """Repeated random motifs of mixed lengths, so prompt lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=generator).tolist() * 2 for n in (3, 7, 16)]


def _ar_outputs(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, **params: object) -> list[list[int]]:
    requests = make_requests(prompts, max_tokens, **params)
    return [r.output_token_ids for r in AREngine(runner).run(requests).requests]


DRAFTERS = {
    "prompt_lookup": lambda source: dict(drafter="prompt_lookup", num_assistant_tokens=3),
    "early_exit": lambda source: dict(drafter="early_exit", assistant_early_exit=1),
    "draft_equals_target": lambda source: dict(drafter="draft_model", assistant_model=None),
    "random_draft": lambda source: dict(drafter="draft_model",
                                        assistant_model=tiny(seed=7, vocab_size=128, with_tokenizer=False)),
}


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_tokens_equal_ar_with_per_token_timestamps(drafter: str, tiny_source,
                                                          tiny_runner: ModelRunner) -> None:
    prompts = _prompts(seed=1)
    expected = _ar_outputs(tiny_runner, prompts, 20, ignore_eos=True)
    engine = HFAssistedEngine(tiny_runner, **DRAFTERS[drafter](tiny_source))
    result = engine.run(make_requests(prompts, 20, ignore_eos=True))
    assert [r.output_token_ids for r in result.requests] == expected, f"{drafter} changed the output"
    for request in result.requests:
        assert request.status is RequestStatus.FINISHED_LENGTH
        assert len(request.token_times) == request.num_output_tokens == 20
        assert request.token_times == sorted(request.token_times)
    stats = engine.stats()
    assert sum(engine.chunk_sizes) == 3 * 20 and stats["spec/num_target_forwards"] == len(engine.chunk_sizes)
    assert stats["phase/decode_steps"] == stats["spec/num_target_forwards"] - 3
    if drafter == "draft_equals_target":
        assert stats["spec/tokens_per_target_forward"] > 3.0, stats["spec/tokens_per_target_forward"]


def test_stop_tokens_end_requests_as_ar_does(tiny_runner: ModelRunner) -> None:
    prompts = _prompts(seed=2)
    stop = _ar_outputs(tiny_runner, prompts, 12, ignore_eos=True)[0][3]
    expected = _ar_outputs(tiny_runner, prompts, 12, stop_token_ids=[stop])
    engine = HFAssistedEngine(tiny_runner, drafter="draft_model")  # NOTE: all accepted: the stop sits inside a chunk
    result = engine.run(make_requests(prompts, 12, stop_token_ids=[stop]))
    assert [r.output_token_ids for r in result.requests] == expected
    assert result.requests[0].status is RequestStatus.FINISHED_STOPPED
    assert len(result.requests[0].token_times) == result.requests[0].num_output_tokens == 4


@pytest.mark.parametrize("settings, message", [(dict(drafter="medusa"), "unknown drafter"),
                                               (dict(drafter="early_exit", assistant_early_exit=2), "early_exit"),
                                               (dict(num_assistant_tokens=0), "num_assistant_tokens")])
def test_bad_settings_are_clear_errors(settings: dict, message: str, tiny_runner: ModelRunner) -> None:
    with pytest.raises(LabError, match=message):
        HFAssistedEngine(tiny_runner, **settings)


def test_lab_run_composes_hf_assisted(tmp_path: Path) -> None:
    cfg = compose_cfg(["model=tiny", "engine=hf_assisted", "engine.drafter=early_exit", "engine.assistant_early_exit=1",
                       "logger=none", "workload.num_prompts=2", "workload.input_len=8", "workload.output_len=6",
                       "print_table=false", f"hydra.run.dir={tmp_path}"])
    results = run(cfg, tmp_path)
    assert results["completed"] == 2 and results["engine"] == "hf_assisted"
    assert json.loads((tmp_path / "results.json").read_text())["spec/num_target_forwards"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["prompt_lookup", "early_exit"])
def test_greedy_tokens_equal_ar_on_smollm2(drafter: str, smollm2_runner: ModelRunner) -> None:
    prompt = chat_prompt(smollm2_runner.tokenizer, "Repeat after me: one two three, one two three.")
    expected = _ar_outputs(smollm2_runner, [prompt], 24)
    engine = HFAssistedEngine(smollm2_runner, drafter=drafter, num_assistant_tokens=3, assistant_early_exit=15)
    result = engine.run(make_requests([prompt], 24))
    assert [r.output_token_ids for r in result.requests] == expected
    assert engine.stats()["spec/tokens_per_target_forward"] > 1.0
