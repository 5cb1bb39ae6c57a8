"""Static batching and naive concurrency: greedy outputs equal AR's and HF's whatever the mix of prompt
lengths, padding leaves every row's logits alone, waste and memory rejections are counted (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from lab.engines.ar import AREngine
from lab.engines.concurrent import ConcurrentEngine, max_requests_within_budget
from lab.engines.static import StaticBatchEngine, pad_prompts
from lab.kv_cache import ContiguousKVCache
from lab.request import RequestStatus
from lab.runner import ModelRunner
from tests.conftest import compose_cfg
from tests.helpers import chat_prompt, hf_greedy, make_requests

CHAT = ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.")


def _mixed_prompts(n: int, vocab: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=generator).tolist()
    lengths[:2] = [low, high]  # NOTE: always include the extremes, so padding spans the whole range
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in lengths]


def _outputs(engine: object, prompts: list[list[int]], max_tokens: int, **params: object) -> list[list[int]]:
    result = engine.run(make_requests(prompts, max_tokens, **params))
    return [r.output_token_ids for r in result.requests]


@pytest.fixture(scope="module")
def mixed_reference(tiny_runner: ModelRunner) -> tuple[list[list[int]], list[list[int]]]:
    prompts = _mixed_prompts(8, tiny_runner.vocab_size, seed=11)
    return prompts, [hf_greedy(tiny_runner, p, 20) for p in prompts]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_static_greedy_equals_ar_and_hf_for_mixed_prompt_lengths(
        batch_size: int, tiny_runner: ModelRunner, mixed_reference: tuple) -> None:
    prompts, hf = mixed_reference
    ar = _outputs(AREngine(tiny_runner), prompts, 20, ignore_eos=True)
    static = _outputs(StaticBatchEngine(tiny_runner, batch_size=batch_size), prompts, 20, ignore_eos=True)
    for i, (got, want_ar, want_hf) in enumerate(zip(static, ar, hf)):
        assert got == want_ar == want_hf, f"batch_size={batch_size} prompt {i} ({len(prompts[i])} tokens) diverged"


def test_static_greedy_equals_hf_on_smollm2_chat(smollm2_runner: ModelRunner) -> None:
    """Three chat prompts in one batch, stopping at EOS at different steps (finished rows keep computing)."""
    prompts = [chat_prompt(smollm2_runner.tokenizer, text) for text in CHAT]
    references = [hf_greedy(smollm2_runner, p, 32, ignore_eos=False) for p in prompts]
    engine = StaticBatchEngine(smollm2_runner, batch_size=3)
    for got, want in zip(_outputs(engine, prompts, 32), references):
        assert got == want, f"{smollm2_runner.tokenizer.decode(got)!r} != {smollm2_runner.tokenizer.decode(want)!r}"


def test_left_padding_does_not_change_any_rows_logits(tiny_runner: ModelRunner) -> None:
    """Prefill logits at every real position and three decode steps match each row run alone (fp32)."""
    prompts = _mixed_prompts(4, tiny_runner.vocab_size, seed=12, high=30)
    num_decode, c = 3, tiny_runner.config
    width = max(len(p) for p in prompts)
    padded = pad_prompts(prompts, max_len=width + num_decode)
    batch_cache = ContiguousKVCache(c.num_layers, len(prompts), width + num_decode, c.num_kv_heads, c.head_dim,
                                    torch.float32, torch.device("cpu"))
    batch_cache.begin_forward(0, width, padded.key_padding)
    batched = [tiny_runner.execute(padded.input_ids, padded.positions, batch_cache, logits_index=None)]  # (B, W, V)
    next_ids = torch.randint(3, tiny_runner.vocab_size, (num_decode, len(prompts)), generator=torch.Generator())
    for step in range(num_decode):
        positions = torch.tensor([[len(p) + step] for p in prompts])                               # (B, 1)
        batch_cache.begin_forward(width + step, 1, padded.key_padding)
        batched.append(tiny_runner.execute(next_ids[step][:, None], positions, batch_cache, logits_index=None))
    for row, prompt in enumerate(prompts):
        cache = tiny_runner.allocate_kv_cache(1, len(prompt) + num_decode)
        cache.begin_forward(0, len(prompt))
        alone = [tiny_runner.execute(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, logits_index=None)]
        for step in range(num_decode):
            cache.begin_forward(len(prompt) + step, 1)
            alone.append(tiny_runner.execute(next_ids[step][row].view(1, 1),
                                             torch.tensor([[len(prompt) + step]]), cache, logits_index=None))
        diff = max((batched[0][row, width - len(prompt):] - alone[0][0]).abs().max(),
                   *((b[row] - a[0]).abs().max() for b, a in zip(batched[1:], alone[1:])))
        # NOTE: relative to the logits' scale: the padded batch and the lone row can take different GEMM kernels
        # (native GEMV up to 12 rows, oneDNN above), so fp32 summation order may differ.
        scale = float(alone[0].abs().max().clamp(min=1))
        assert diff <= 1e-6 * scale + 1e-5, (f"row {row} ({len(prompt)} tokens, {width - len(prompt)} padding): "
                                             f"max diff {diff:.2e} (logits up to {scale:.1f})")


def test_static_counts_padding_and_finished_row_waste_and_shares_step_times(tiny_runner: ModelRunner) -> None:
    prompts = _mixed_prompts(2, tiny_runner.vocab_size, seed=13, low=5, high=9)
    requests = make_requests(prompts, 6, ignore_eos=True)
    requests[0].sampling_params.max_tokens = 2
    engine = StaticBatchEngine(tiny_runner, batch_size=2)
    short, long = engine.run(requests).requests
    stats = engine.stats()
    # 6 steps of 2 rows over a 9-wide prefill: 2*9 + 2*5 slots; 4 padding, 4 slots of the finished short row
    assert (stats["batch/padding_tokens"], stats["batch/wasted_token_slots"]) == (4, 4), stats
    assert stats["batch/computed_token_slots"] == 28, stats
    assert stats["batch/waste_fraction"] == pytest.approx(8 / 28)
    assert (short.num_output_tokens, long.num_output_tokens, stats["batch/num_batches"]) == (2, 6, 1)
    assert short.token_times == long.token_times[:2], "rows of one batch must share each step's timestamp"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_concurrent_greedy_equals_ar(mode: str, tiny_runner: ModelRunner, mixed_reference: tuple) -> None:
    prompts, _ = mixed_reference
    ar = _outputs(AREngine(tiny_runner), prompts, 20, ignore_eos=True)
    concurrent = _outputs(ConcurrentEngine(tiny_runner, num_workers=3, mode=mode), prompts, 20, ignore_eos=True)
    assert concurrent == ar, f"{mode}: concurrent outputs differ from ar"


def test_concurrent_seeded_sampling_equals_ar(tiny_runner: ModelRunner) -> None:
    prompts = _mixed_prompts(3, tiny_runner.vocab_size, seed=14)
    params = dict(temperature=1.0, top_k=20, ignore_eos=True)
    ar = _outputs(AREngine(tiny_runner), prompts, 12, **params)
    assert _outputs(ConcurrentEngine(tiny_runner, num_workers=3), prompts, 12, **params) == ar


def test_over_budget_admission_is_rejected_reported_and_counted(tiny_runner: ModelRunner) -> None:
    prompts = [[5] * 30 for _ in range(4)]
    per_request_mb = 40 * AREngine(tiny_runner).kv_bytes_per_token / 2**20   # 30 prompt + 10 new tokens
    budget = tiny_runner.weight_bytes / 2**20 + 2.5 * per_request_mb
    engine = ConcurrentEngine(tiny_runner, num_workers=4, memory_budget_mb=budget)
    result = engine.run(make_requests(prompts, 10, ignore_eos=True))
    statuses = [r.status for r in result.requests]
    assert statuses.count(RequestStatus.FINISHED_LENGTH) == 2, statuses
    rejected = [r for r in result.requests if r.status is RequestStatus.FINISHED_ABORTED]
    assert len(rejected) == 2 and all(r.error.startswith("rejected: ") for r in rejected), [r.error for r in rejected]
    assert engine.stats()["concurrent/num_rejected"] == 2
    assert max_requests_within_budget(budget, tiny_runner.weight_bytes / 2**20, per_request_mb / 40, 40) == 2


def test_cuda_out_of_memory_is_reported_not_raised(tiny_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(batch_size: int, max_len: int) -> ContiguousKVCache:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(tiny_runner, "allocate_kv_cache", out_of_memory)
    engine = ConcurrentEngine(tiny_runner, num_workers=2)
    result = engine.run(make_requests([[5, 6, 7], [8, 9]], 4, ignore_eos=True))
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in result.requests)
    assert all(r.error.startswith("CUDA out of memory") for r in result.requests), [r.error for r in result.requests]
    assert engine.stats()["concurrent/num_oom"] == 2


@pytest.mark.parametrize("experiment", ["static_batching", "naive_concurrency"])
def test_experiments_compose_and_concurrency_feeds_both_engines(experiment: str) -> None:
    cfg = compose_cfg([f"+experiment={experiment}", "model=tiny", "logger=none"])
    assert cfg.workload.num_prompts >= 1
    for engine, key in (("static", "batch_size"), ("concurrent", "num_workers")):
        cfg = compose_cfg(["+experiment=naive_concurrency", f"engine={engine}", "concurrency=16"])
        assert cfg.engine[key] == 16 and cfg.workload.num_prompts == 16
