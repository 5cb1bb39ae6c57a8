"""AREngine: batch 1, requests in turn. `use_kv_cache=False` is `ar_nocache` (recompute the whole
sequence every step); `True` is `ar` (prefill once, then one token per forward over a ContiguousKVCache).

`start_request` and `advance` are the single-request stepping, shared with the `concurrent` engine
(each of its workers runs this same loop on its own cache).
"""

from __future__ import annotations

import time

import torch

from lab.engines.base import Engine, fail
from lab.kv_cache import ContiguousKVCache, NoCache
from lab.request import Request, RequestStatus
from lab.runner import ModelRunner
from lab.sample.logprobs import token_logprobs
from lab.sample.logits_processors import apply_logits_processors
from lab.sample.sampler import GreedyRows, Sampler

KV_ALLOC_ROUNDING = 256  # tokens; a cache this much larger is reused by the next requests


def start_request(request: Request) -> None:
    request.status = RequestStatus.RUNNING
    request.first_scheduled_time = time.perf_counter()
    request.num_computed_tokens = 0


def advance(runner: ModelRunner, sampler: Sampler, request: Request, kv_cache: ContiguousKVCache | None,
            generator: torch.Generator | None) -> bool:
    """One forward for one request, one new token; returns True when the request has just finished.

    With a cache, prefill feeds the whole prompt and each decode step the one token not yet in the cache;
    without one (`kv_cache=None`), the whole sequence is recomputed.
    """
    if kv_cache is not None:
        start = request.num_computed_tokens
        new_token_ids = request.all_token_ids[start:]
        kv_cache.begin_forward(start, len(new_token_ids))
        cache = kv_cache
    else:
        start, new_token_ids, cache = 0, request.all_token_ids, NoCache()
    input_ids = torch.tensor([new_token_ids], dtype=torch.long)                      # (1, T)
    positions = torch.arange(start, start + len(new_token_ids)).unsqueeze(0)         # (1, T)
    prompt_positions = request.prompt_logprob_positions(start, len(new_token_ids))
    params = request.sampling_params
    logits: torch.Tensor | GreedyRows
    if prompt_positions:
        every = runner.execute(input_ids, positions, cache, logits_index=None)[0]   # (T, V)
        first, end = prompt_positions.start, prompt_positions.stop
        request.record_prompt_logprobs(first, token_logprobs(every[first - start:end - start],
                                                             request.prompt_token_ids[first + 1:end + 1],
                                                             params.prompt_logprobs))
        logits = every[-1:]                                                          # (1, V)
    elif runner.greedy_head and params.needs_only_argmax:
        # NOTE: the argmax alone, found without the logits (model.greedy_head, lab/models/native_head.py)
        logits = GreedyRows(runner.execute(input_ids, positions, cache, greedy=True))   # (1,)
    else:
        logits = runner.execute(input_ids, positions, cache)                         # (1, V)
    processed = apply_logits_processors(logits, [request], runner.eos_token_ids)
    token_id = sampler.sample(processed, [params], [generator])[0]
    request.num_computed_tokens = start + len(new_token_ids)
    logprobs = None if params.logprobs is None else token_logprobs(logits, [token_id], params.logprobs)[0]
    return request.append_output_token(token_id, runner.eos_token_ids, logprobs=logprobs)


class AREngine(Engine):
    supports_logprobs = True
    supports_logits_processors = True

    def __init__(self, runner: ModelRunner, use_kv_cache: bool = True, name: str | None = None,
                 seed: int = 0) -> None:
        super().__init__(runner, name or ("ar" if use_kv_cache else "ar_nocache"), seed)
        self.use_kv_cache = use_kv_cache
        self.current: Request | None = None
        self.kv_cache: ContiguousKVCache | None = None

    def has_unfinished_requests(self) -> bool:
        return self.current is not None or bool(self.waiting)

    def _start_next(self) -> Request:
        request = self.waiting.popleft()
        start_request(request)
        if self.use_kv_cache:
            needed = request.num_prompt_tokens + request.sampling_params.max_tokens
            if self.kv_cache is None or self.kv_cache.max_len < needed:
                rounded = -(-needed // KV_ALLOC_ROUNDING) * KV_ALLOC_ROUNDING
                self.kv_cache = None  # release the old one before allocating
                self.kv_cache = self.runner.allocate_kv_cache(1, min(rounded, self.runner.max_model_len))
            self.kv_cache.reset()
        self.current = request
        return request

    def step(self) -> list[Request]:
        request = self.current or self._start_next()
        cache = self.kv_cache if self.use_kv_cache else None
        phase = "decode" if request.num_output_tokens else "prefill"
        num_new_tokens = request.num_tokens - (request.num_computed_tokens if cache is not None else 0)
        with self.phases.phase(phase, num_tokens=num_new_tokens):
            finished = advance(self.runner, self.sampler, request, cache, self.generator_for(request))
        if finished:
            self.current = None
            return [request]
        return []

    def kv_usage(self) -> tuple[int, int]:
        if not self.use_kv_cache or self.kv_cache is None:
            return 0, 0
        used = self.current.num_computed_tokens if self.current is not None else 0
        return self.kv_cache.num_bytes, used * self.kv_bytes_per_token

    def abort_running_request(self, request_id: str, error: str) -> Request | None:
        if self.current is None or self.current.request_id != request_id:
            return None
        return self.abort_running(error)[0]

    def abort_running(self, error: str) -> list[Request]:
        aborted = fail([self.current], error) if self.current else []
        self.current = None
        return aborted
