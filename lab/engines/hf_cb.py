"""HFCBEngine (`hf_cb`): the anchor for continuous batching, HF transformers' own ContinuousBatchingManager
(the engine behind `model.generate_batch`: paged KV blocks, FIFO scheduler, token budget per step) on the
same weights and the same arrivals.

Each request is handed to the manager's background thread at its arrival time; HF records a timestamp
per generated token (`record_timestamps`, on the same perf_counter clock), so TTFT/TPOT/ITL are per
token. Owns: the manager's lifetime over one run, translating requests and results.
Ignores: how HF schedules, pages and attends (that is what is being measured).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.utils import WorkloadHints

from lab.engines.base import Engine, RunResult, fail, take_generated
from lab.errors import LabError
from lab.request import Request, RequestStatus, stop_ids
from lab.runner import ModelRunner

POLL_S = 0.002  # how long a step waits for a finished request before the run loop admits new arrivals
ATTN_IMPLEMENTATIONS = ("sdpa", "paged|eager", "flash_attention_2", "flash_attention_3")


class HFCBEngine(Engine):
    def __init__(self, runner: ModelRunner, max_num_seqs: int = 64, block_size: int = 256,
                 num_blocks: int | None = None, kv_cache_memory_mb: float | None = 1024,
                 max_batch_tokens: int | None = 2048, attn_implementation: str = "sdpa",
                 prefix_sharing: bool = True, name: str | None = None, seed: int = 0) -> None:
        super().__init__(runner, name or "hf_cb", seed)
        if attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise LabError(f"engine.attn_implementation={attn_implementation!r} is not one HF's continuous batching "
                           "runs", f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
        if max_num_seqs < 1 or block_size < 4:
            raise LabError(f"engine.max_num_seqs ({max_num_seqs}) must be >= 1 and engine.block_size ({block_size}) "
                           ">= 4 (HF's smallest page)", "raise them")
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_cache_memory_mb = kv_cache_memory_mb
        self.max_batch_tokens = max_batch_tokens
        self.attn_implementation = attn_implementation
        self.prefix_sharing = prefix_sharing
        self.manager: ContinuousBatchingManager | None = None
        self.running: dict[str, Request] = {}
        self.num_missing_timestamps = 0
        self.resolved: dict[str, float] = {}   # the cache HF built: blocks, token budget
        self._last_kv_usage = (0, 0)

    # -- the manager's lifetime ----------------------------------------------------------------
    def run(self, requests: list[Request], max_concurrency: int | None = None) -> RunResult:
        for request in requests:
            self.validate(request)
        if not requests:   # NOTE: the manager sizes its cache from the requests; with none there is nothing to run
            return super().run(requests, max_concurrency)
        self.manager = self._start_manager(requests)
        try:
            return super().run(requests, max_concurrency)
        finally:
            manager, self.manager = self.manager, None
            manager.stop(block=True, timeout=60)
            manager.destroy()

    def _start_manager(self, requests: list[Request]) -> ContinuousBatchingManager:
        model = self.runner.hf_model()
        if model.config._attn_implementation != self.attn_implementation:
            # NOTE: the manager restores the implementation it switched away from on stop; this one stays set,
            # which is harmless: `sdpa` is what the hf engine uses too.
            model.set_attn_implementation(self.attn_implementation)
        cb_config = ContinuousBatchingConfig(
            page_size=self.block_size, num_blocks=self._num_blocks(requests), max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_num_seqs, allow_block_sharing=self.prefix_sharing,
            seed=self._sampling_seed(requests))
        hints = WorkloadHints(max_prompt_length=max(r.num_prompt_tokens for r in requests),
                              max_generated_length=max(r.sampling_params.max_tokens for r in requests),
                              num_requests=len(requests))
        manager = model.init_continuous_batching(generation_config=self._generation_config(requests),
                                                 continuous_batching_config=cb_config, workload_hints=hints)
        manager.warmup()  # NOTE: builds the paged cache (and captures CUDA graphs on a GPU)
        cache = manager.batch_processor.cache
        self.resolved = {"hf_cb/num_blocks": cache.num_blocks, "hf_cb/max_batch_tokens": cache.max_batch_tokens,
                         "hf_cb/max_requests_per_batch": manager.continuous_batching_config.max_requests_per_batch}
        with torch.inference_mode():
            manager.start()  # NOTE: the generation thread inherits the caller's inference mode
        return manager

    def _num_blocks(self, requests: list[Request]) -> int:
        """engine.num_blocks, else as many as kv_cache_memory_mb holds, capped at what max_num_seqs of this
        run's longest requests could use (cb_paged's rule).

        NOTE: left unset, HF would size its cache from free memory (60% of RAM on CPU)."""
        max_len = max(r.num_prompt_tokens + r.sampling_params.max_tokens for r in requests)
        per_request = math.ceil(max_len / self.block_size) + 1
        if self.num_blocks is not None:
            num_blocks = self.num_blocks
        else:
            num_blocks = self.max_num_seqs * per_request
            if self.kv_cache_memory_mb is not None:
                bytes_per_block = self.block_size * self.kv_bytes_per_token
                num_blocks = min(num_blocks, int(self.kv_cache_memory_mb * 2**20) // bytes_per_block)
        if num_blocks < per_request:
            raise LabError(f"hf_cb: {num_blocks} KV blocks of {self.block_size} tokens cannot hold one request of "
                           f"{max_len} tokens ({per_request} blocks)",
                           "raise engine.num_blocks or engine.kv_cache_memory_mb, or lower engine.block_size")
        return num_blocks

    def _generation_config(self, requests: list[Request]) -> GenerationConfig:
        """HF's manager applies one set of logits processors to every request."""
        params = requests[0].sampling_params
        key = (params.temperature, params.top_k, params.top_p, params.min_p)
        if any((r.sampling_params.temperature, r.sampling_params.top_k, r.sampling_params.top_p,
                r.sampling_params.min_p) != key for r in requests):
            raise LabError("hf_cb needs one temperature/top_k/top_p/min_p for every request of a run",
                           "set the sampling settings once (sampling.*) for the whole workload")
        kwargs: dict[str, Any] = dict(max_new_tokens=params.max_tokens, do_sample=not params.is_greedy,
                                      eos_token_id=-1, pad_token_id=0, bos_token_id=None)
        if not params.is_greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k if params.top_k > 0 else None,
                          top_p=params.top_p, min_p=params.min_p or None)
        return GenerationConfig(**kwargs)

    def _sampling_seed(self, requests: list[Request]) -> int:
        seed = requests[0].sampling_params.seed
        return self.seed if seed is None else seed

    # -- engine interface ----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def step(self) -> list[Request]:
        if self.manager is None:
            raise LabError("hf_cb serves requests only inside run()", "call engine.run(requests)")
        while self.waiting:
            self._submit(self.waiting.popleft())
        finished: list[Request] = []
        output = self.manager.get_result(timeout=POLL_S)
        while output is not None:
            finished += self._apply(output)
            output = self.manager.get_result(timeout=0)
        fatal = self.manager.background_thread_status.fatal_error
        if fatal is not None and self.running:
            raise RuntimeError(f"HF's continuous batching loop stopped: {fatal}")
        return finished

    def _submit(self, request: Request) -> None:
        params = request.sampling_params
        eos = sorted(stop_ids(params, self.runner.eos_token_ids)) or -1
        request.status, request.first_scheduled_time = RequestStatus.RUNNING, time.perf_counter()
        self.running[request.request_id] = request
        self.manager.add_request(input_ids=request.prompt_token_ids, request_id=request.request_id,
                                 max_new_tokens=params.max_tokens, record_timestamps=True,
                                 eos_token_id=eos or -1)

    def _apply(self, output: Any) -> list[Request]:
        """Replay one finished GenerationOutput onto its Request, token by token with HF's timestamps."""
        request = self.running.pop(output.request_id, None)
        if request is None or not output.is_finished():
            return []
        if output.error is not None:
            return fail([request], f"HF continuous batching: {output.error}")
        if output.lifespan[0] > 0:
            request.first_scheduled_time = output.lifespan[0]  # when HF's scheduler took it off its queue
        tokens, times = list(output.generated_tokens), list(output.timestamps or [])
        if len(times) < len(tokens):
            # NOTE: a request HF preempted restarts its timestamp list; its earlier tokens get the first one kept.
            self.num_missing_timestamps += len(tokens) - len(times)
            first = times[0] if times else output.lifespan[1]
            times = [first] * (len(tokens) - len(times)) + times
        take_generated(request, tokens, times, self.runner.eos_token_ids, "HF continuous batching")
        return [request]

    def abort_running_request(self, request_id: str, error: str) -> Request | None:
        request = self.running.pop(request_id, None)
        if request is None:
            return None
        if self.manager is not None:
            self.manager.cancel_request(request_id)
        return fail([request], error)[0]

    def abort_running(self, error: str) -> list[Request]:
        if self.manager is not None:
            for request_id in self.running:
                self.manager.cancel_request(request_id)
        aborted = fail(list(self.running.values()), error)
        self.running = {}
        return aborted

    # -- measurement ---------------------------------------------------------------------------
    def kv_usage(self) -> tuple[int, int]:
        """(the paged cache's bytes, bytes of the blocks in use): block-granular, read across threads."""
        processor = self.manager.batch_processor if self.manager is not None else None
        if processor is None:
            return self._last_kv_usage
        cache = processor.cache
        reserved = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
        try:
            free = cache.compute_free_capacity(relative=False)
        except RuntimeError:  # NOTE: the generation thread changed the free lists mid-read; keep the last value
            return self._last_kv_usage
        self._last_kv_usage = (reserved, max(0, int(reserved - free)))
        return self._last_kv_usage

    def kv_cache_usage(self) -> float:
        pool, in_use = self.kv_usage()
        return in_use / pool if pool else 0.0

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "hf_cb/per_token_timestamps": 1.0, "hf_cb/block_size": self.block_size,
                "hf_cb/missing_timestamps": self.num_missing_timestamps, **self.resolved}
