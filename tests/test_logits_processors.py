"""vLLM's logits processors: greedy decoding with a repetition penalty equals HF transformers'
generate(repetition_penalty=...) token for token on `ar` and `cb_paged`; frequency and presence penalties and
logit_bias on hand-made logits; logit_bias and min_tokens steer the engines' outputs; engines that do not apply
them refuse them by name; ranges are checked. (Speculative decoding under them: tests/test_structured_outputs.py.)"""

from __future__ import annotations

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.static import StaticBatchEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.sample.logits_processors import apply_logits_processors, apply_logits_processors_to_drafts
from lab.sched import SchedulerConfig
from tests.helpers import make_requests

KV = PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None)
PROMPTS = [[5, 17, 99, 5, 17, 99, 5, 17], [3, 44, 12, 3, 44], [70, 71, 72, 73, 70, 71, 72]]


def hf_greedy_with_repetition_penalty(runner: ModelRunner, prompt: list[int], max_new_tokens: int,
                                      penalty: float) -> list[int]:
    mask = torch.ones(1, len(prompt), dtype=torch.long)
    with torch.inference_mode():
        out = runner.hf_model().generate(torch.tensor([prompt]), attention_mask=mask, do_sample=False,
                                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                         repetition_penalty=penalty, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("engine_name", ["ar", "cb_paged"])
def test_greedy_with_a_repetition_penalty_equals_hf(engine_name: str, tiny_runner: ModelRunner) -> None:
    engine = (AREngine(tiny_runner) if engine_name == "ar" else
              ContinuousBatchingEngine(tiny_runner, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), KV))
    requests = make_requests(PROMPTS, 16, ignore_eos=True, repetition_penalty=1.5)
    requests.append(Request("plain", PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True)))
    done = {r.request_id: r.output_token_ids for r in engine.run(requests).requests}
    for i, prompt in enumerate(PROMPTS):
        assert done[f"r{i}"] == hf_greedy_with_repetition_penalty(tiny_runner, prompt, 16, 1.5), (engine_name, i)
    plain = AREngine(tiny_runner).run(make_requests([PROMPTS[0]], 16, ignore_eos=True)).requests[0].output_token_ids
    assert done["plain"] == plain and done["r0"] != plain   # the penalty changed r0's output, not its batch-mate's


def test_frequency_and_presence_penalties_subtract_by_count_and_by_presence() -> None:
    request = Request("r", [1, 2], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25,
                                                  repetition_penalty=2.0))
    request.output_token_ids = [3, 3, 4]
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 0.5, 1.0]])
    penalized = apply_logits_processors(logits, [request], set())
    # repetition: tokens 1-4 (prompt and output) halved if positive, doubled if negative; then 3 twice and 4 once
    assert penalized[0].tolist() == pytest.approx([1.0, 1.0, -4.0, 2.0 - 1.0 - 0.25, 0.25 - 0.5 - 0.25, 1.0])
    plain = Request("p", [1], SamplingParams())
    assert apply_logits_processors(logits, [plain], set()) is logits and logits[0, 1] == 2.0   # not copied, unchanged


def test_engines_that_do_not_apply_penalties_refuse_them_and_ranges_are_checked(tiny_runner: ModelRunner) -> None:
    static = StaticBatchEngine(tiny_runner, batch_size=2)
    for params in ({"presence_penalty": 0.5}, {"logit_bias": {5: 1.0}}, {"min_tokens": 2}):
        with pytest.raises(LabError, match="engine static does not apply penalties, logit_bias, min_tokens, allowed"):
            static.run(make_requests([[1, 2, 3]], 4, **params))
    with pytest.raises(LabError, match="logit_bias names token 128, outside the vocabulary"):
        AREngine(tiny_runner).run(make_requests([[1, 2, 3]], 4, logit_bias={128: 1.0}))
    for bad, message in [({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
                         ({"frequency_penalty": 2.5}, "frequency_penalty must be between -2 and 2"),
                         ({"presence_penalty": float("nan")}, "presence_penalty must be between -2 and 2"),
                         ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be between 0 and max_tokens"),
                         ({"logit_bias": {3: 101.0}}, "logit_bias must map token ids >= 0 to biases between")]:
        with pytest.raises(LabError, match=message):
            SamplingParams(**bad)


def test_logit_bias_adds_to_the_logits_and_min_tokens_bans_stop_tokens_until_then() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    biased = Request("b", [0], SamplingParams(logit_bias={0: 5.0, 3: -4.0}))
    assert apply_logits_processors(logits, [biased], set())[0].tolist() == [6.0, 2.0, 3.0, 0.0]
    early = Request("m", [0], SamplingParams(min_tokens=2, stop_token_ids=[1]))
    early.output_token_ids = [2]
    assert apply_logits_processors(logits, [early], {3})[0].tolist() == [1.0, float("-inf"), 3.0, float("-inf")]
    early.output_token_ids = [2, 2]   # two tokens: min_tokens reached, nothing banned
    assert apply_logits_processors(logits, [early], {3})[0].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("engine_name", ["ar", "cb_paged"])
def test_logit_bias_and_min_tokens_steer_the_output(engine_name: str, tiny_runner: ModelRunner) -> None:
    def engine():
        return (AREngine(tiny_runner) if engine_name == "ar" else
                ContinuousBatchingEngine(tiny_runner, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), KV))
    plain = engine().run(make_requests([PROMPTS[1]], 8, ignore_eos=True)).requests[0].output_token_ids
    forced = engine().run(make_requests([PROMPTS[1]], 8, ignore_eos=True, logit_bias={7: 100.0})).requests[0]
    assert forced.output_token_ids == [7] * 8
    stop = plain[1]
    stopped = engine().run(make_requests([PROMPTS[1]], 8, stop_token_ids=[stop])).requests[0]
    assert stopped.output_token_ids == plain[:plain.index(stop) + 1]
    held = engine().run(make_requests([PROMPTS[1]], 8, stop_token_ids=[stop], min_tokens=6)).requests[0]
    assert len(held.output_token_ids) >= 6 and stop not in held.output_token_ids[:6]


def test_allowed_token_ids_and_bad_words_with_the_drafts_before_each_row() -> None:
    logits = torch.zeros(1, 6)
    only = Request("a", [0], SamplingParams(allowed_token_ids=[1, 4]))
    assert apply_logits_processors(logits, [only], set())[0].isfinite().nonzero().flatten().tolist() == [1, 4]
    bad = Request("b", [0], SamplingParams(bad_words_token_ids=[[2, 3], [5]]))
    bad.output_token_ids = [1, 2]
    # NOTE: 5 is banned everywhere; 3 only right after 2
    assert apply_logits_processors(logits, [bad], set())[0].isinf().nonzero().flatten().tolist() == [3, 5]
    rows = apply_logits_processors_to_drafts(torch.zeros(3, 6), bad, set(), [[], [4], [4, 2]])   # drafts 4, 2
    assert [r.isinf().nonzero().flatten().tolist() for r in rows] == [[3, 5], [5], [3, 5]]
    for fields, message in [({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
                            ({"bad_words_token_ids": [[1], []]}, "bad_words must not hold an empty word")]:
        with pytest.raises(LabError, match=message):
            SamplingParams(**fields)


@pytest.mark.parametrize("engine_name", ["ar", "cb_paged"])
def test_allowed_token_ids_and_bad_words_steer_the_output(engine_name: str, tiny_runner: ModelRunner) -> None:
    def run(**params) -> list[int]:
        engine = (AREngine(tiny_runner) if engine_name == "ar" else
                  ContinuousBatchingEngine(tiny_runner, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), KV))
        return engine.run(make_requests([PROMPTS[1]], 8, ignore_eos=True, **params)).requests[0].output_token_ids
    plain = run()
    assert set(run(allowed_token_ids=[7, 8])) <= {7, 8}
    banned = run(bad_words_token_ids=[[plain[0]]])
    assert plain[0] not in banned
    pair = [plain[2], plain[3]]
    no_pair = run(bad_words_token_ids=[pair])
    assert all(no_pair[i:i + 2] != pair for i in range(len(no_pair) - 1)) and no_pair[:3] == plain[:3]
    with pytest.raises(LabError, match="allowed_token_ids names token 128, outside the vocabulary"):
        run(allowed_token_ids=[5, 128])
