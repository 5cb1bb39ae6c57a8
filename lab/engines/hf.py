"""HFEngine: the baseline and reference, HF transformers' `generate` on the same weights,
`batch_size` requests at a time with left padding. A streamer timestamps every generated token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from lab.engines.base import Engine, fail, take_generated
from lab.errors import LabError
from lab.request import Request, RequestStatus, SamplingParams, stop_ids
from lab.runner import ModelRunner


class _TokenClock(BaseStreamer):
    """generate() calls put() once with the prompt, then once per decoding step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


@contextmanager
def _model_eos_disabled(model: torch.nn.Module, disable: bool) -> Iterator[None]:
    """NOTE: generate() fills an unset eos_token_id from the model's own generation config, so
    ignore_eos must also clear it there for the duration of the call."""
    saved = model.generation_config.eos_token_id
    if disable:
        model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def generation_settings(params: SamplingParams) -> tuple:
    """What one HF generate() call applies to every row alike."""
    return (params.temperature, params.top_k, params.top_p, params.min_p, params.ignore_eos,
            sorted(params.stop_token_ids))


class HFEngine(Engine):
    supports_arrivals = True  # batches are formed from whatever has arrived when the previous batch ends

    def __init__(self, runner: ModelRunner, batch_size: int = 1, name: str | None = None, seed: int = 0) -> None:
        super().__init__(runner, name or "hf", seed)
        if batch_size < 1:
            raise LabError(f"engine.batch_size must be >= 1, got {batch_size}", "set engine.batch_size=1 or more")
        self.batch_size = batch_size
        self.running: list[Request] = []
        self.pad_token_id = self._pad_token_id()
        runner.hf_model()  # NOTE: built now, so its construction is load time, not the first request's TTFT

    def _pad_token_id(self) -> int:
        tokenizer = self.runner.tokenizer
        if tokenizer is not None and tokenizer.pad_token_id is not None:
            return int(tokenizer.pad_token_id)
        return min(self.runner.eos_token_ids) if self.runner.eos_token_ids else 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def _generation_config(self, params: SamplingParams, max_new_tokens: int) -> GenerationConfig:
        eos = sorted(stop_ids(params, self.runner.eos_token_ids)) or None
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=self.pad_token_id,
                      bos_token_id=None, do_sample=not params.is_greedy)
        if not params.is_greedy:
            kwargs.update(temperature=params.temperature, top_k=params.top_k if params.top_k > 0 else None,
                          top_p=params.top_p, min_p=params.min_p or None)
        return GenerationConfig(**kwargs)

    def step(self) -> list[Request]:
        # NOTE: one generate() call samples and stops every row alike: a batch takes the oldest request and the
        # next ones with its settings; the others wait for a batch of their own
        batch = [self.waiting.popleft()]
        params = batch[0].sampling_params
        for request in list(self.waiting):
            if len(batch) == self.batch_size:
                break
            if generation_settings(request.sampling_params) == generation_settings(params):
                self.waiting.remove(request)
                batch.append(request)
        self.running = batch
        now = time.perf_counter()
        for request in batch:
            request.status, request.first_scheduled_time = RequestStatus.RUNNING, now
        width = max(r.num_prompt_tokens for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)   # (B, W)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)                 # (B, W)
        for row, request in enumerate(batch):
            input_ids[row, width - request.num_prompt_tokens:] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, width - request.num_prompt_tokens:] = 1
        max_new_tokens = max(r.sampling_params.max_tokens for r in batch)
        clock = _TokenClock()
        if not params.is_greedy:
            torch.manual_seed(params.seed if params.seed is not None else self.seed)
        device = self.runner.device
        model = self.runner.hf_model()
        with torch.inference_mode(), _model_eos_disabled(model, params.ignore_eos):
            sequences = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                generation_config=self._generation_config(params, max_new_tokens), streamer=clock)
        new_tokens = sequences[:, width:].tolist()
        self._record_phases(now, clock.times, len(batch), width)
        for request, row in zip(batch, new_tokens):
            take_generated(request, row, clock.times, self.runner.eos_token_ids, "generate()")
        self.running = []
        return batch

    def _record_phases(self, start: float, token_times: list[float], batch_size: int, width: int) -> None:
        """generate() is one call: the first token closes prefill, the rest is decode."""
        if not token_times:
            return
        phases = self.phases
        phases.seconds["prefill"] += token_times[0] - start
        phases.steps["prefill"] += 1
        phases.tokens["prefill"] += batch_size * width
        phases.seconds["decode"] += token_times[-1] - token_times[0]
        phases.steps["decode"] += len(token_times) - 1
        phases.tokens["decode"] += batch_size * (len(token_times) - 1)

    def abort_running(self, error: str) -> list[Request]:
        aborted = fail([r for r in self.running if not r.is_finished], error)
        self.running = []
        return aborted
