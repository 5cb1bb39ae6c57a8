"""Scheduler logic against a mock runner with uniform logits (greedy then always picks token 0):
token budget, max_num_seqs, decodes before prefill chunks, preemption order, failures that never hang."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lab.engines.continuous import ContinuousBatchingEngine
from lab.errors import LabError
from lab.kv_cache import BlockKVCache, PagedKVCacheConfig, SlotKVCacheConfig
from lab.models.config import DecoderConfig
from lab.request import Request, RequestStatus, SamplingParams
from lab.sched import SchedulerConfig, SchedulerOutput


@dataclass
class _Config:
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 2
    vocab_size: int = 8

    def kv_bytes_per_token(self, itemsize: int, num_layers: int | None = None) -> int:
        return DecoderConfig.kv_bytes_per_token(self, itemsize, num_layers)   # NOTE: the real formula


@dataclass
class MockRunner:
    """What the engine needs from a ModelRunner; every forward returns uniform logits."""

    config: _Config = field(default_factory=_Config)
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    max_model_len: int = 512
    eos_token_ids: set[int] = field(default_factory=set)
    num_forward_tokens: list[int] = field(default_factory=list)
    greedy_head: bool = False          # NOTE: no greedy screen: every step gets its logits

    def allocate_block_kv_cache(self, num_blocks: int, block_size: int, backend: str = "fast",
                                scratch_block: bool = False) -> BlockKVCache:
        c = self.config
        return BlockKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, self.dtype,
                            self.device, backend, scratch_block)

    def execute(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: BlockKVCache,
                logits_index: torch.Tensor, greedy: bool = False) -> torch.Tensor:
        assert not greedy
        assert input_ids.shape == positions.shape == (1, len(cache.index.slot_mapping))
        self.num_forward_tokens.append(input_ids.shape[1])
        return torch.zeros(1, len(logits_index), self.config.vocab_size)


class RecordingEngine(ContinuousBatchingEngine):
    """Keeps every SchedulerOutput and the running set after each step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[SchedulerOutput] = []
        self.running_sizes: list[int] = []
        original = self.scheduler.schedule

        def schedule() -> SchedulerOutput:
            out = original()
            self.outputs.append(out)
            self.running_sizes.append(len(self.scheduler.running))
            return out

        self.scheduler.schedule = schedule


def _requests(prompt_lens: list[int], max_tokens: int | list[int]) -> list[Request]:
    max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_lens)
    return [Request(f"r{i}", [1] * n, SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (n, m) in enumerate(zip(prompt_lens, max_tokens))]


def _drain(engine: ContinuousBatchingEngine, requests: list[Request]) -> list[Request]:
    for request in requests:
        engine.add_request(request)
    finished = []
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        finished += engine.step()
    assert not engine.has_unfinished_requests(), "the engine did not drain"
    return finished


def _engine(max_num_seqs: int = 8, max_num_batched_tokens: int = 64, num_blocks: int = 64, block_size: int = 4,
            chunked: bool = True, prefix: bool = False) -> RecordingEngine:
    return RecordingEngine(MockRunner(), SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked),
                           PagedKVCacheConfig(block_size=block_size, num_blocks=num_blocks,
                                              enable_prefix_caching=prefix))


def test_every_step_stays_within_the_token_budget_and_chunks_long_prompts() -> None:
    engine = _engine(max_num_batched_tokens=16)
    finished = _drain(engine, _requests([40, 5, 33, 7], 6))
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == [0] * 6 for r in finished)
    totals = [out.total_num_scheduled_tokens for out in engine.outputs]
    assert max(totals) == 16, f"budget 16, steps scheduled {totals}"
    assert engine.runner.num_forward_tokens == [t for t in totals if t], "the forward must see exactly the plan"
    first_chunks = [out.num_scheduled_tokens.get("r0") for out in engine.outputs[:3]]
    assert first_chunks == [16, 16, 8], f"a 40-token prompt in chunks of the budget, got {first_chunks}"


def test_running_decodes_are_scheduled_before_a_long_prefill_chunk() -> None:
    engine = _engine(max_num_batched_tokens=8)
    for request in _requests([2, 2], 30):
        engine.add_request(request)
    engine.step()
    engine.step()
    engine.add_request(Request("long", [1] * 50, SamplingParams(max_tokens=2, ignore_eos=True)))
    for _ in range(6):
        engine.step()
        out = engine.outputs[-1]
        assert out.num_scheduled_tokens.get("r0") == 1 and out.num_scheduled_tokens.get("r1") == 1, (
            f"decodes stalled by the prefill: {out.num_scheduled_tokens}")
        assert out.num_scheduled_tokens.get("long") == 6, f"the chunk takes the rest: {out.num_scheduled_tokens}"


def test_max_num_seqs_caps_the_running_set() -> None:
    engine = _engine(max_num_seqs=3)
    finished = _drain(engine, _requests([3] * 10, 5))
    assert len(finished) == 10
    assert max(engine.running_sizes) == 3 == engine.stats()["sched/max_running"], (
        f"running sizes {sorted(set(engine.running_sizes))}")
    assert max(len(out.scheduled) for out in engine.outputs) <= 3


def test_preemption_takes_the_newest_request_and_recomputes_it() -> None:
    # 6 blocks of 4 tokens; three requests growing from 4 to 12 tokens cannot all stay.
    engine = _engine(num_blocks=6, max_num_batched_tokens=64)
    requests = _requests([4, 4, 4], 9)
    finished = _drain(engine, requests)
    preempted = [rid for out in engine.outputs for rid in out.preempted_request_ids]
    assert preempted, "this workload must preempt"
    assert preempted[0] == "r2", f"the newest request goes first, got {preempted}"
    assert "r0" not in preempted, f"the oldest request is never the victim while others run: {preempted}"
    assert sorted(r.request_id for r in finished) == ["r0", "r1", "r2"]
    assert all(r.output_token_ids == [0] * 9 for r in finished), "recompute must not lose or repeat tokens"
    assert engine.stats()["sched/num_preemptions"] == len(preempted)
    assert engine.kv_manager.num_held_blocks == 0


def test_a_readmitted_request_is_not_a_second_prefix_cache_query() -> None:
    """vLLM counts prefix-cache queries and hits for new requests only: a preempted request finding its own
    blocks again on readmission would inflate the hit rate."""
    engine = _engine(num_blocks=6, max_num_batched_tokens=64, prefix=True)
    finished = _drain(engine, _requests([4, 4, 4], 9))
    assert sum(r.num_preemptions for r in finished) > 0, "this workload must preempt"
    counts = engine.kv_manager.prefix_cache_counters()
    assert (counts.queries, counts.hits) == (12, 0), "three 4-token prompts, nothing cached before them"


def test_a_preempted_request_waits_at_the_front_and_keeps_its_outputs() -> None:
    engine = _engine(num_blocks=6, max_num_batched_tokens=64)
    for request in _requests([4, 4, 4, 4], 9):
        engine.add_request(request)
    while not any(out.preempted_request_ids for out in engine.outputs):
        engine.step()
    preempt_step, out = len(engine.outputs), engine.outputs[-1]
    victim = next(r for r in engine.scheduler.waiting if r.request_id == out.preempted_request_ids[-1])
    assert engine.scheduler.waiting[0] is victim, "the preempted request goes to the front of the queue"
    assert victim.num_computed_tokens == 0 and victim.num_output_tokens > 0
    assert victim.status is RequestStatus.WAITING
    _drain(engine, [])
    recompute = next(o for o in engine.outputs[preempt_step:] if victim.request_id in o.scheduled_new_request_ids)
    assert recompute.num_scheduled_tokens[victim.request_id] > victim.num_prompt_tokens, (
        "the recompute prefill covers prompt + generated tokens")


def test_no_admission_in_a_step_that_preempted() -> None:
    engine = _engine(num_blocks=6)
    _drain(engine, _requests([4, 4, 4, 4], 9))
    for out in engine.outputs:
        if out.preempted_request_ids:
            assert not out.scheduled_new_request_ids, f"admitted {out.scheduled_new_request_ids} while preempting"


def test_a_request_id_already_in_flight_is_refused() -> None:
    """The scheduler, KV manager and generators key their state by request id: a second request with a live id
    would corrupt them, so it is refused before it is queued (vLLM refuses it too)."""
    engine = _engine()
    first, again = _requests([4], 3)[0], _requests([5], 3)[0]
    engine.add_request(first)
    with pytest.raises(LabError, match="request id r0 is already in flight"):
        engine.add_request(again)
    _drain(engine, [])
    engine.add_request(again)   # once finished, the id is free again


def test_engine_validation_rejects_a_request_that_can_never_fit() -> None:
    engine = _engine(num_blocks=4, block_size=4)             # 16 tokens of KV in all
    engine.validate(_requests([3], 14)[0])                   # 3 + 14 - 1 = 16 tokens: fits
    for request in _requests([20, 3], [4, 20]):
        with pytest.raises(LabError, match="more than the whole KV cache holds") as info:
            engine.validate(request)
        assert "num_blocks" in info.value.fix and "max_tokens" in info.value.fix, info.value.fix
        with pytest.raises(LabError):
            engine.add_request(request)
    assert not engine.has_unfinished_requests(), "a rejected request must not be queued"
    assert engine.kv_manager.num_held_blocks == 0


def test_engine_validation_rejects_a_prompt_over_budget_without_chunked_prefill() -> None:
    engine = _engine(max_num_batched_tokens=16, chunked=False)
    with pytest.raises(LabError, match="chunked prefill off") as info:
        engine.validate(_requests([30], 4)[0])
    assert "enable_chunked_prefill" in info.value.fix, info.value.fix
    engine.validate(_requests([10], 4)[0])


def _drain_via_scheduler(engine: ContinuousBatchingEngine, requests: list[Request]) -> list[Request]:
    """Queue past the engine's validation, straight into the scheduler (its own safeguard)."""
    for request in requests:
        engine.scheduler.add_request(request)
    return _drain(engine, [])


def test_requests_that_can_never_fit_fail_with_a_reason_and_the_rest_finish() -> None:
    engine = _engine(num_blocks=4, block_size=4)             # 16 tokens of KV in all
    requests = _requests([3, 20, 3], [4, 4, 20])
    finished = {r.request_id: r for r in _drain_via_scheduler(engine, requests)}
    assert finished["r0"].status is RequestStatus.FINISHED_LENGTH
    for request_id in ("r1", "r2"):
        assert finished[request_id].status is RequestStatus.FINISHED_ABORTED
        assert "KV for up to" in finished[request_id].error, finished[request_id].error


def test_without_chunked_prefill_a_prompt_over_budget_is_rejected_not_hung() -> None:
    engine = _engine(max_num_batched_tokens=16, chunked=False)
    finished = {r.request_id: r for r in _drain_via_scheduler(engine, _requests([10, 30, 4], 4))}
    assert finished["r1"].status is RequestStatus.FINISHED_ABORTED and "chunked prefill" in finished["r1"].error
    assert finished["r0"].status is finished["r2"].status is RequestStatus.FINISHED_LENGTH
    prompt_steps = [out.num_scheduled_tokens.get("r0") for out in engine.outputs]
    assert 10 in prompt_steps, f"the 10-token prompt runs whole, got {prompt_steps}"


def test_slot_engine_admits_only_while_slots_are_free() -> None:
    engine = RecordingEngine(MockRunner(), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                             SlotKVCacheConfig(max_len=32, num_slots=2))
    finished = _drain(engine, _requests([5, 5, 5, 5], 6))
    assert len(finished) == 4 and max(engine.running_sizes) == 2
    assert engine.stats()["sched/num_preemptions"] == 0
    assert engine.kv_manager.num_held_blocks == 0


def test_abort_request_frees_a_running_or_waiting_request() -> None:
    engine = _engine(max_num_seqs=1)
    for request in _requests([6, 6], 5):
        engine.add_request(request)
    engine.step()
    held = engine.kv_manager.num_held_blocks
    assert held == 2, f"a 6-token prompt in blocks of 4 holds 2 blocks, got {held}"
    running = engine.abort_request("r0", "client left")
    waiting = engine.abort_request("r1")
    assert running.status is waiting.status is RequestStatus.FINISHED_ABORTED and running.error == "client left"
    assert engine.abort_request("r0") is None
    assert engine.kv_manager.num_held_blocks == 0 and not engine.has_unfinished_requests()


def test_release_request_state_drops_the_request_generator() -> None:
    engine = _engine()
    request = Request("r0", [1, 2], SamplingParams(max_tokens=2, temperature=1.0))
    generator = engine.generator_for(request)
    assert generator is not None and engine.generator_for(request) is generator, "one generator per request"
    engine.release_request_state("r0")
    assert engine.generator_for(request) is not generator, "release must drop the request's generator"
    engine.release_request_state("never-seen")   # a no-op, not an error
