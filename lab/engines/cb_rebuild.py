"""CBRebuildEngine (`cb_rebuild`): continuous batching stages 2A-2C on one left-padded contiguous cache.

2A: a request that finishes leaves the batch with its KV row before the next forward (the cache shrinks).
2B: waiting requests are admitted as soon as a row frees (`max_num_seqs` rows at most): they are
    prefilled on their own, then every live row's KV is re-laid-out into a new left-padded cache of
    the new common width (the "rebuild", the seed's current limitation, counted and timed).
2C: prompts of different lengths share one padded width; a key-padding mask and per-row positions
    keep padding out of every real token's attention.
`admit=False` is 2A alone: nothing is admitted until the batch is empty, so a batch only shrinks.

Owns: the running rows, FIFO admission, the rebuild and its counters. Ignores: slots, paging, preemption.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lab.engines.base import Engine, RunResult, fail
from lab.errors import LabError
from lab.kv_cache import ContiguousKVCache
from lab.request import Request, RequestStatus
from lab.runner import ModelRunner

PAD_TOKEN_ID = 0  # any id: padding positions are masked out of every real token's attention


@dataclass(slots=True)
class PaddedBatch:
    """Rows of one left-padded cache: row i's real tokens fill columns [width - n_i, width), where
    n_i = requests[i].num_computed_tokens. A finished request keeps its row until the next rebuild."""

    cache: ContiguousKVCache
    requests: list[Request]
    width: int                  # columns written so far, common to every row
    key_padding: torch.Tensor   # (B, max_len) bool, True = real token

    @property
    def num_live(self) -> int:
        return sum(not r.is_finished for r in self.requests)


def _columns_needed(width: int, requests: list[Request]) -> int:
    """Cache columns for `width` written tokens plus every decode step the rows may still take."""
    # NOTE: a row feeds one token per remaining output token; the last output is never fed back.
    return width + max(r.sampling_params.max_tokens - r.num_output_tokens for r in requests)


class CBRebuildEngine(Engine):
    def __init__(self, runner: ModelRunner, max_num_seqs: int = 64, admit: bool = True,
                 name: str | None = None, seed: int = 0) -> None:
        super().__init__(runner, name or "cb_rebuild", seed)
        if max_num_seqs < 1:
            raise LabError(f"engine.max_num_seqs must be >= 1, got {max_num_seqs}", "set engine.max_num_seqs=1 or more")
        self.max_num_seqs = max_num_seqs
        self.admit = admit
        self.batch: PaddedBatch | None = None
        self.admitting: list[Request] = []   # popped from `waiting`, prefill not yet merged into the batch
        self._reset_rebuild_counters()

    def _reset_rebuild_counters(self) -> None:
        self.num_rebuilds = self.num_shrink_rebuilds = self.num_admit_rebuilds = 0
        self.rebuild_bytes_copied = 0
        self.run_seconds = 0.0

    # -- engine interface ----------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or (self.batch is not None and self.batch.num_live > 0)

    def step(self) -> list[Request]:
        finished: list[Request] = []
        sources = [self.batch] if self.batch is not None and self.batch.num_live else []
        newcomers = self._take_admissible(sum(b.num_live for b in sources))
        if newcomers:
            prefilled = self._prefill(newcomers, joins_batch=bool(sources))
            finished += [r for r in newcomers if r.is_finished]
            sources.append(prefilled)
        self.batch = self._merge(sources)
        self.admitting = []
        if self.batch is not None:
            finished += self._decode(self.batch)
            if not self.batch.num_live:
                self.batch = None  # NOTE: release the cache now, not at the next request's step
        return finished

    def abort_running(self, error: str) -> list[Request]:
        in_flight = list(self.admitting) + (self.batch.requests if self.batch is not None else [])
        self.batch, self.admitting = None, []
        return fail([r for r in in_flight if not r.is_finished], error)

    def abort_running_request(self, request_id: str, error: str) -> Request | None:
        """The request's row stays in the cache until the next step's rebuild drops it, as a finished row's does."""
        in_flight = list(self.admitting) + (self.batch.requests if self.batch is not None else [])
        for request in in_flight:
            if request.request_id == request_id and not request.is_finished:
                return fail([request], error)[0]
        return None

    def kv_usage(self) -> tuple[int, int]:
        if self.batch is None:
            return 0, 0
        used = sum(r.num_computed_tokens for r in self.batch.requests if not r.is_finished)
        return self.batch.cache.num_bytes, used * self.kv_bytes_per_token

    def run(self, requests: list[Request], max_concurrency: int | None = None) -> RunResult:
        result = super().run(requests, max_concurrency)
        self.run_seconds += result.duration
        return result

    def reset_stats(self) -> None:
        super().reset_stats()
        self._reset_rebuild_counters()

    def stats(self) -> dict[str, float]:
        rebuild_seconds = self.phases.seconds.get("rebuild", 0.0)
        return {**super().stats(), "rebuild/count": self.num_rebuilds,
                "rebuild/shrink_count": self.num_shrink_rebuilds, "rebuild/admit_count": self.num_admit_rebuilds,
                "rebuild/total_s": rebuild_seconds, "rebuild/bytes_copied": self.rebuild_bytes_copied,
                "rebuild/share": rebuild_seconds / self.run_seconds if self.run_seconds > 0 else 0.0}

    # -- admission and prefill (2B, 2C) --------------------------------------------------------
    def _take_admissible(self, num_live: int) -> list[Request]:
        if not self.admit and num_live > 0:
            return []  # stage 2A alone: the batch only shrinks
        num_free = self.max_num_seqs - num_live
        self.admitting = [self.waiting.popleft() for _ in range(min(num_free, len(self.waiting)))]
        return self.admitting

    def _prefill(self, requests: list[Request], joins_batch: bool) -> PaddedBatch:
        """Left-pad the prompts to a common width and prefill them in one forward."""
        width = max(r.num_prompt_tokens for r in requests)
        # NOTE: prompts that join a running batch are copied into a rebuilt cache at once, so their own
        # cache holds the prompt only; a batch of newcomers alone decodes in place and needs room to grow.
        max_len = width if joins_batch else width + max(r.sampling_params.max_tokens for r in requests) - 1
        device = self.runner.device
        input_ids = torch.full((len(requests), width), PAD_TOKEN_ID, dtype=torch.long)      # (B, W)
        positions = torch.zeros((len(requests), width), dtype=torch.long)                   # (B, W)
        key_padding = torch.zeros((len(requests), max_len), dtype=torch.bool, device=device)  # (B, max_len)
        now = time.perf_counter()
        for row, request in enumerate(requests):
            n = request.num_prompt_tokens
            input_ids[row, width - n:] = torch.tensor(request.prompt_token_ids)
            positions[row, width - n:] = torch.arange(n)
            key_padding[row, width - n:width] = True
            request.status, request.first_scheduled_time, request.num_computed_tokens = RequestStatus.RUNNING, now, 0
        cache = self.runner.allocate_kv_cache(len(requests), max_len)
        cache.begin_forward(0, width, key_padding)
        with self.phases.phase("prefill", num_tokens=sum(r.num_prompt_tokens for r in requests)):
            token_ids = self.execute_and_sample(input_ids, positions, cache, requests)
        self._record(requests, token_ids, num_fed=[r.num_prompt_tokens for r in requests])
        return PaddedBatch(cache, requests, width, key_padding)

    # -- decode --------------------------------------------------------------------------------
    def _decode(self, batch: PaddedBatch) -> list[Request]:
        """One token for every row: each feeds its last output at column `width`, at its own position."""
        rows = batch.requests
        input_ids = torch.tensor([[r.output_token_ids[-1]] for r in rows], dtype=torch.long)   # (B, 1)
        positions = torch.tensor([[r.num_computed_tokens] for r in rows], dtype=torch.long)    # (B, 1)
        batch.key_padding[:, batch.width] = True
        batch.cache.begin_forward(batch.width, 1, batch.key_padding)
        with self.phases.phase("decode", num_tokens=len(rows)):
            token_ids = self.execute_and_sample(input_ids, positions, batch.cache, rows)
        batch.width += 1
        return self._record(rows, token_ids, num_fed=[1] * len(rows))

    def _record(self, requests: list[Request], token_ids: list[int], num_fed: list[int]) -> list[Request]:
        now = time.perf_counter()
        finished = []
        for request, token_id, n in zip(requests, token_ids, num_fed):
            request.num_computed_tokens += n
            if request.append_output_token(token_id, self.runner.eos_token_ids, now=now):
                finished.append(request)
        return finished

    # -- rebuild (2A shrink, 2B admission) -----------------------------------------------------
    def _merge(self, sources: list[PaddedBatch]) -> PaddedBatch | None:
        """The batch for the next decode: a source as it is when nothing left or joined, else a rebuild."""
        live = [b for b in sources if b.num_live]
        if not live:
            return None
        if len(live) == 1 and live[0].num_live == len(live[0].requests):
            return live[0]
        with self.phases.phase("rebuild", num_tokens=sum(r.num_computed_tokens for b in live for r in b.requests
                                                         if not r.is_finished)):
            batch = self._relayout(live)
        self.num_rebuilds += 1
        if len(live) > 1:
            self.num_admit_rebuilds += 1
        else:
            self.num_shrink_rebuilds += 1
        return batch

    def _relayout(self, sources: list[PaddedBatch]) -> PaddedBatch:
        """Copy every live row's real tokens, right-aligned, into a new cache as wide as the longest row."""
        rows = [(src, i, r) for src in sources for i, r in enumerate(src.requests) if not r.is_finished]
        requests = [r for _, _, r in rows]
        width = max(r.num_computed_tokens for r in requests)
        max_len = _columns_needed(width, requests)
        cache = self.runner.allocate_kv_cache(len(rows), max_len)
        key_padding = torch.zeros((len(rows), max_len), dtype=torch.bool, device=self.runner.device)  # (B, max_len)
        for row, (src, src_row, request) in enumerate(rows):
            n = request.num_computed_tokens
            for dst_layer, src_layer in zip(cache.k + cache.v, src.cache.k + src.cache.v):
                dst_layer[row, :, width - n:width] = src_layer[src_row, :, src.width - n:src.width]   # (Hkv, n, D)
            key_padding[row, width - n:width] = True
            self.rebuild_bytes_copied += n * self.kv_bytes_per_token
        return PaddedBatch(cache, requests, width, key_padding)
