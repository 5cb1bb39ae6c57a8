"""Logprobs (SamplingParams.logprobs, vLLM's raw logprobs): every engine that computes them reports, for each
generated token, log_softmax of HF transformers' own logits at that position (the token's logprob, its rank and
the k most likely); speculative steps report the target's, a tree of drafts included; engines that do not compute
them refuse such requests by name."""

from __future__ import annotations

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.base import Engine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.speculative import SpeculativeEngine
from lab.engines.static import StaticBatchEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.sample.logprobs import token_logprobs
from lab.sched import SchedulerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.ngram_config import NgramProposerConfig
from tests.helpers import make_requests

KV = PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None)
# NOTE: the prompts of test_tree.py's off-chain test: an untrained EAGLE tree gets runners-up accepted on them
PROMPTS = [torch.randint(3, 128, (4 + (7 * i) % 23,), generator=torch.Generator().manual_seed(i)).tolist()
           for i in range(6)] + [[5, 17, 99, 5, 17, 99, 5, 17]]
NUM_TOP = 3


def hf_logprobs(runner: ModelRunner, prompt: list[int], output: list[int]) -> torch.Tensor:
    """HF's log_softmax at the positions that chose each output token: (len(output), V)."""
    with torch.inference_mode():
        logits = runner.hf_model()(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)], dim=-1)


def build_engine(name: str, runner: ModelRunner) -> Engine:
    scheduler = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64)
    if name == "ar":
        return AREngine(runner)
    if name == "cb_paged":
        return ContinuousBatchingEngine(runner, scheduler, KV)
    if name == "speculative_ngram":
        return SpeculativeEngine(runner, NgramProposerConfig(min_n=1, max_n=3), 3, scheduler, KV)
    return SpeculativeEngine(runner, EagleProposerConfig(checkpoint=None, tree_width=4, draft_vocab_size=0), 2,
                             scheduler, KV)


@pytest.mark.parametrize("name", ["ar", "cb_paged", "speculative_ngram", "eagle_tree"])
def test_every_tokens_logprobs_are_hf_log_softmax_at_its_position(name: str, tiny_runner: ModelRunner) -> None:
    engine = build_engine(name, tiny_runner)
    requests = make_requests(PROMPTS, 24, ignore_eos=True, logprobs=NUM_TOP)
    requests.append(Request("none", [8, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True)))   # asked for none
    done = {r.request_id: r for r in engine.run(requests).requests}
    assert done["none"].output_logprobs == []
    for request in (done[f"r{i}"] for i in range(len(PROMPTS))):
        assert len(request.output_logprobs) == len(request.output_token_ids) == 24
        reference = hf_logprobs(tiny_runner, request.prompt_token_ids, request.output_token_ids)
        for position, (token_id, entry) in enumerate(zip(request.output_token_ids, request.output_logprobs)):
            row = reference[position]
            assert entry.token_id == token_id and entry.logprob == pytest.approx(float(row[token_id]), abs=1e-4)
            assert entry.rank == 1   # greedy: the most likely token
            top = torch.topk(row, NUM_TOP)
            assert [t for t, _ in entry.top] == top.indices.tolist(), (name, position)
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    stats = engine.stats()
    if name == "speculative_ngram":
        assert stats["spec_decode_accepted_tokens"] > 0   # some tokens came from accepted drafts
    if name == "eagle_tree":
        assert stats["spec/tree_off_chain_accepts"] > 0   # and some from a runner-up's branch of the tree


def test_a_sampled_token_gets_its_rank_and_zero_top_means_none() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    (entry,) = token_logprobs(logits, [2], 0)
    assert entry.rank == 2 and entry.top == ()
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 2]))
    (entry,) = token_logprobs(logits, [3], 2)
    assert entry.rank == 4 and [t for t, _ in entry.top] == [1, 2]


def test_engines_without_logprobs_refuse_them_by_name_and_the_range_is_checked(tiny_runner: ModelRunner) -> None:
    with pytest.raises(LabError, match="engine static does not compute logprobs"):
        StaticBatchEngine(tiny_runner, batch_size=2).run(make_requests([[1, 2, 3]], 4, logprobs=1))
    with pytest.raises(LabError, match="logprobs must be between 0 and 20, got 21"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("name", ["ar", "cb_paged", "speculative_ngram"])
def test_prompt_logprobs_are_hf_log_softmax_over_the_prompt_chunked_and_prefix_cached(name: str,
                                                                                      tiny_runner: ModelRunner) -> None:
    """Chunked prefill (a 16-token budget) splits the prompts; a second copy of a prompt whose blocks are cached
    still gets every prompt logprob (its prefix is computed, not read from the cache)."""
    scheduler = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16)
    engine = {"ar": AREngine(tiny_runner), "cb_paged": ContinuousBatchingEngine(tiny_runner, scheduler, KV),
              "speculative_ngram": SpeculativeEngine(tiny_runner, NgramProposerConfig(min_n=1, max_n=3), 3,
                                                     scheduler, KV)}[name]
    long_prompt = PROMPTS[3] + PROMPTS[5] + PROMPTS[4]   # 56 tokens: 4 chunks
    engine.run(make_requests([long_prompt], 2))          # its blocks are now in the prefix cache
    requests = make_requests([long_prompt, PROMPTS[0], [42]], 3, ignore_eos=True, prompt_logprobs=2)
    done = engine.run(requests).requests
    for request in done[:2]:
        prompt = request.prompt_token_ids
        reference = hf_logprobs(tiny_runner, prompt[:1], prompt[1:])                  # rows for tokens 1..n-1
        assert len(request.prompt_logprobs) == len(prompt) and request.prompt_logprobs[0] is None
        for position, entry in enumerate(request.prompt_logprobs[1:]):
            row = reference[position]
            assert entry.token_id == prompt[position + 1]
            assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4), (name, position)
            assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
            assert [t for t, _ in entry.top] == torch.topk(row, 2).indices.tolist()
        assert request.output_token_ids == AREngine(tiny_runner).run(make_requests([prompt], 3, ignore_eos=True)
                                                                      ).requests[0].output_token_ids
    assert done[2].prompt_logprobs in ([], [None])   # one token: nothing to score
