"""Every engine's greedy output equals HF transformers' greedy generate token for token (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.hf import HFEngine
from lab.request import RequestStatus
from lab.runner import ModelRunner
from tests.helpers import chat_prompt, hf_greedy, make_requests

ENGINES = {
    "ar": lambda runner: AREngine(runner, use_kv_cache=True),
    "ar_nocache": lambda runner: AREngine(runner, use_kv_cache=False),
    "hf": lambda runner: HFEngine(runner, batch_size=1),
    "hf_batch3": lambda runner: HFEngine(runner, batch_size=3),
}


def _random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=generator).tolist()
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in lengths]


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_greedy_tokens_equal_hf_generate_on_tiny(engine_name: str, tiny_runner: ModelRunner) -> None:
    prompts = _random_prompts(4, tiny_runner.vocab_size, seed=0)
    references = [hf_greedy(tiny_runner, p, 24) for p in prompts]
    result = ENGINES[engine_name](tiny_runner).run(make_requests(prompts, 24, ignore_eos=True))
    for request, reference in zip(result.requests, references):
        assert request.output_token_ids == reference, f"{engine_name} request {request.request_id} diverged"
        assert request.status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("engine_name", ["ar", "ar_nocache", "hf"])
def test_greedy_tokens_equal_hf_generate_on_smollm2(engine_name: str, smollm2_runner: ModelRunner) -> None:
    tokenizer = smollm2_runner.tokenizer
    prompts = [chat_prompt(tokenizer, text) for text in
               ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")]
    references = [hf_greedy(smollm2_runner, p, 32, ignore_eos=False) for p in prompts]
    result = ENGINES[engine_name](smollm2_runner).run(make_requests(prompts, 32))
    for request, reference in zip(result.requests, references):
        assert request.output_token_ids == reference, (
            f"{engine_name}: {tokenizer.decode(request.output_token_ids)!r} != {tokenizer.decode(reference)!r}")


def test_eos_stops_unless_ignore_eos(tiny_runner: ModelRunner) -> None:
    prompt = _random_prompts(1, tiny_runner.vocab_size, seed=5)[0]
    free_run = AREngine(tiny_runner).run(make_requests([prompt], 12, ignore_eos=True)).requests[0]
    stop_at = free_run.output_token_ids[4]
    first = free_run.output_token_ids.index(stop_at)
    stopped = AREngine(tiny_runner).run(make_requests([prompt], 12, stop_token_ids=[stop_at])).requests[0]
    assert stopped.output_token_ids == free_run.output_token_ids[:first + 1]
    assert stopped.status is RequestStatus.FINISHED_STOPPED
    # NOTE: vLLM's meaning: ignore_eos skips EOS only; a stop token still stops
    still_stopped = AREngine(tiny_runner).run(make_requests([prompt], 12, stop_token_ids=[stop_at],
                                                            ignore_eos=True)).requests[0]
    assert still_stopped.output_token_ids == stopped.output_token_ids


@pytest.mark.parametrize("engine_name", ["ar", "hf_batch3"])
def test_ignore_eos_runs_past_eos_to_max_tokens(engine_name: str, tiny_runner: ModelRunner) -> None:
    prompt = _random_prompts(1, tiny_runner.vocab_size, seed=5)[0]
    free_run = AREngine(tiny_runner).run(make_requests([prompt], 12, ignore_eos=True)).requests[0]
    eos = free_run.output_token_ids[4]
    tiny_runner.eos_token_ids.add(eos)   # NOTE: a token greedy decoding emits early stands in for EOS
    try:
        ignored = ENGINES[engine_name](tiny_runner).run(make_requests([prompt], 12, ignore_eos=True)).requests[0]
        stopped = ENGINES[engine_name](tiny_runner).run(make_requests([prompt], 12)).requests[0]
    finally:
        tiny_runner.eos_token_ids.discard(eos)
    assert ignored.output_token_ids == free_run.output_token_ids and ignored.status is RequestStatus.FINISHED_LENGTH
    assert stopped.output_token_ids[-1] == eos and stopped.status is RequestStatus.FINISHED_STOPPED


def test_hf_batches_only_requests_that_stop_alike(tiny_runner: ModelRunner) -> None:
    """One generate() call stops every row at the same ids: a request with other stop tokens waits for a batch of
    its own instead of being cut at its neighbour's stop token (or failing the batch)."""
    prompts = _random_prompts(3, tiny_runner.vocab_size, seed=8)
    free = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 10, ignore_eos=True)).requests]
    stop = free[1][3]   # NOTE: r1 generates it: a batch stopping every row at r0's stop tokens would cut r1 there
    requests = make_requests(prompts, 10, ignore_eos=True)
    requests[0].sampling_params.stop_token_ids = [stop]
    expected = [free[0][:free[0].index(stop) + 1] if stop in free[0] else free[0], free[1], free[2]]
    result = HFEngine(tiny_runner, batch_size=3).run(requests)
    assert [r.output_token_ids for r in result.requests] == expected
    assert [r.error for r in result.requests] == [None] * 3


def test_every_token_is_timestamped_in_order(tiny_runner: ModelRunner) -> None:
    result = AREngine(tiny_runner).run(make_requests(_random_prompts(2, 128, seed=6), 6, ignore_eos=True))
    for request in result.requests:
        assert len(request.token_times) == request.num_output_tokens == 6
        assert request.arrival_time <= request.token_times[0]
        assert request.token_times == sorted(request.token_times)
    assert result.duration > 0


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny_runner: ModelRunner) -> None:
    prompts = _random_prompts(2, 128, seed=7)

    def sample(seed: int) -> list[list[int]]:
        requests = make_requests(prompts, 16, temperature=1.5, top_k=50, top_p=0.95, seed=seed, ignore_eos=True)
        return [r.output_token_ids for r in AREngine(tiny_runner).run(requests).requests]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    greedy = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 16, ignore_eos=True)).requests]
    assert sample(1) != greedy
