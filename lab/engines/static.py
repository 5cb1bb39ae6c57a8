"""StaticBatchEngine (`engine=static`): `batch_size` requests left-padded into one batch that advances
together, one forward per step for the whole batch over a shared ContiguousKVCache.

Owns: forming a batch from the waiting queue, the padded inputs (left padding, key-padding mask,
per-row positions) and the waste counters (padding slots, slots of rows that already finished).
Ignores: admission while a batch runs (new requests wait for the next batch; that is `cb_*`'s job).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lab.engines.ar import start_request
from lab.engines.base import Engine, RunResult, fail
from lab.engines.concurrent import PeakRSS
from lab.errors import LabError
from lab.kv_cache import ContiguousKVCache
from lab.request import Request
from lab.runner import ModelRunner

# NOTE: padding slots are masked out of every real row's attention, so their token id never matters.
PAD_TOKEN_ID = 0


@dataclass(slots=True)
class PaddedPrompts:
    input_ids: torch.Tensor             # (B, W) prompts right-aligned, PAD_TOKEN_ID on the left
    positions: torch.Tensor             # (B, W) each row's own positions from 0; padding sits at 0
    key_padding: torch.Tensor | None    # (B, max_len) True = a real token; None when no row is padded
    num_padding_tokens: int


def pad_prompts(prompts: list[list[int]], max_len: int) -> PaddedPrompts:
    """Left-pad `prompts` to the longest one; `max_len` is the KV cache's width (prompt + decode)."""
    width = max(len(p) for p in prompts)
    num_rows = len(prompts)
    input_ids = torch.full((num_rows, width), PAD_TOKEN_ID, dtype=torch.long)     # (B, W)
    num_pad = torch.tensor([width - len(p) for p in prompts])                     # (B,)
    for row, prompt in enumerate(prompts):
        input_ids[row, num_pad[row]:] = torch.tensor(prompt, dtype=torch.long)
    positions = (torch.arange(width)[None, :] - num_pad[:, None]).clamp(min=0)    # (B, W)
    key_padding = None
    if int(num_pad.sum()) > 0:
        key_padding = torch.arange(max_len)[None, :] >= num_pad[:, None]          # (B, max_len)
    return PaddedPrompts(input_ids, positions, key_padding, int(num_pad.sum()))


@dataclass(slots=True)
class _Batch:
    requests: list[Request]
    width: int                          # W: the padded prompt length
    kv_cache: ContiguousKVCache
    key_padding: torch.Tensor | None    # (B, max_len)
    num_steps: int = 0                  # forwards run so far (the first is the prefill)


class StaticBatchEngine(Engine):
    supports_arrivals = True  # a batch is formed from whatever has arrived when the previous one ends

    def __init__(self, runner: ModelRunner, batch_size: int = 8, name: str | None = None, seed: int = 0) -> None:
        super().__init__(runner, name or "static", seed)
        if batch_size < 1:
            raise LabError(f"engine.batch_size must be >= 1, got {batch_size}", "set engine.batch_size=1 or more")
        self.batch_size = batch_size
        self.batch: _Batch | None = None
        self.counters = {"num_batches": 0, "num_rows": 0, "padding_tokens": 0, "wasted_token_slots": 0,
                         "computed_token_slots": 0}
        self.peak_rss = PeakRSS()

    def reset_stats(self) -> None:
        super().reset_stats()
        self.counters = dict.fromkeys(self.counters, 0)

    def has_unfinished_requests(self) -> bool:
        return self.batch is not None or bool(self.waiting)

    def run(self, requests: list[Request], max_concurrency: int | None = None) -> RunResult:
        with self.peak_rss:
            return super().run(requests, max_concurrency)

    def _form_batch(self) -> tuple[_Batch, torch.Tensor, torch.Tensor]:
        """Pop up to batch_size waiting requests; returns the batch and its prefill input_ids, positions."""
        requests = [self.waiting.popleft() for _ in range(min(self.batch_size, len(self.waiting)))]
        for request in requests:
            start_request(request)
        width = max(r.num_prompt_tokens for r in requests)
        max_new = max(r.sampling_params.max_tokens for r in requests)
        # NOTE: the last sampled token is never fed back, so W + max_new - 1 columns are enough.
        kv_cache = self.runner.allocate_kv_cache(len(requests), width + max_new - 1)
        padded = pad_prompts([r.prompt_token_ids for r in requests], max_len=kv_cache.max_len)
        self.counters["num_batches"] += 1
        self.counters["num_rows"] += len(requests)
        self.counters["padding_tokens"] += padded.num_padding_tokens
        return _Batch(requests, width, kv_cache, padded.key_padding), padded.input_ids, padded.positions

    def _decode_inputs(self, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row feeds its last token, finished rows included (static batching keeps computing them)."""
        last = [r.output_token_ids[-1] for r in batch.requests]
        # NOTE: a finished row's positions run on past its own length; clamp them into the RoPE table.
        max_pos = self.runner.max_model_len - 1
        pos = [min(r.num_prompt_tokens + batch.num_steps - 1, max_pos) for r in batch.requests]
        return torch.tensor(last, dtype=torch.long)[:, None], torch.tensor(pos)[:, None]   # (B, 1), (B, 1)

    def step(self) -> list[Request]:
        if self.batch is None:
            self.batch, input_ids, positions = self._form_batch()
        else:
            input_ids, positions = self._decode_inputs(self.batch)
        batch = self.batch
        start = 0 if batch.num_steps == 0 else batch.width + batch.num_steps - 1
        batch.kv_cache.begin_forward(start, input_ids.shape[1], batch.key_padding)
        with self.phases.phase("prefill" if batch.num_steps == 0 else "decode", num_tokens=input_ids.numel()):
            token_ids = self.execute_and_sample(input_ids, positions, batch.kv_cache, batch.requests)
        now = time.perf_counter()
        finished = []
        for request, token_id in zip(batch.requests, token_ids):
            if request.is_finished:
                self.counters["wasted_token_slots"] += 1
            elif request.append_output_token(token_id, self.runner.eos_token_ids, now=now):
                finished.append(request)
        batch.num_steps += 1
        self.counters["computed_token_slots"] += input_ids.numel()
        if all(r.is_finished for r in batch.requests):
            self.batch = None  # NOTE: the batch ends with its longest request; its cache is freed here
        return finished

    def kv_usage(self) -> tuple[int, int]:
        if self.batch is None:
            return 0, 0
        live = sum(r.num_tokens for r in self.batch.requests if not r.is_finished)
        return self.batch.kv_cache.num_bytes, live * self.kv_bytes_per_token

    def abort_running(self, error: str) -> list[Request]:
        aborted = fail([r for r in self.batch.requests if not r.is_finished], error) if self.batch else []
        self.batch = None
        return aborted

    def stats(self) -> dict[str, float]:
        """Waste and memory of the batches run so far (slash-namespaced, merged into results.json)."""
        c = self.counters
        waste = c["padding_tokens"] + c["wasted_token_slots"]
        weights = self.runner.weight_bytes
        return {**super().stats(),
                "batch/num_batches": c["num_batches"],
                "batch/mean_batch_size": c["num_rows"] / max(c["num_batches"], 1),
                "batch/padding_tokens": c["padding_tokens"],
                "batch/wasted_token_slots": c["wasted_token_slots"],
                "batch/computed_token_slots": c["computed_token_slots"],
                "batch/waste_fraction": waste / max(c["computed_token_slots"], 1),
                "memory/weights_mb": weights / 2**20,
                "memory/peak_estimated_mb": (weights + self.peak_kv_reserved_bytes) / 2**20,
                **self.peak_rss.stats()}
