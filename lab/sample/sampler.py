"""Sampler: greedy, temperature, min-p, top-k, top-p, per-request seeded generators.

Owns: turning logits into token ids. Ignores: requests (it sees SamplingParams and generators only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lab.models import native_gemv
from lab.request import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class GreedyRows:
    """What a step's forward hands its sampler in place of the sample rows' logits (R, V) when every request in it
    reads only their argmax (SamplingParams.needs_only_argmax): those argmax token ids, which the head's greedy
    screen finds without the logits (ModelRunner.execute(greedy=True), lab/models/native_head.py). Rows slice as
    the logits' do; argmax_rows, Sampler and the rejection sampler's greedy verifies take it."""

    token_ids: torch.Tensor       # (R,) int64

    def __getitem__(self, rows: slice) -> GreedyRows:
        return GreedyRows(self.token_ids[rows])

    def __len__(self) -> int:
        return len(self.token_ids)


def argmax_rows(logits: torch.Tensor | GreedyRows) -> torch.Tensor:
    """logits (..., V) -> (...) int64, torch.argmax(logits, -1): the native kernel's two vectorised passes a row where
    it takes the call (fp32 on CPU), ~7x faster than torch's on a 49152-token vocabulary (0.50 -> 0.07 ms for
    a 7-row verify step), else torch's own (CUDA, other dtypes). GreedyRows are their argmax already."""
    if isinstance(logits, GreedyRows):
        return logits.token_ids
    return native_gemv.argmax_rows(logits) if native_gemv.usable(logits) else logits.argmax(dim=-1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits (V,) already temperature-scaled -> logits with filtered entries at -inf: min-p first, then top-k and
    top-p (vLLM's order; each as HF's and vLLM's define it)."""
    if min_p > 0.0:
        # NOTE: p < min_p * p_max  <=>  logit < max logit + log(min_p)
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop the low tail whose mass is <= 1 - top_p; the most likely token always stays
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[-1] = False
        remove = torch.zeros_like(remove_sorted).scatter(0, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class Sampler:
    def sample(self, logits: torch.Tensor | GreedyRows, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """logits (B, V) -> one token id per row (GreedyRows: greedy params only)."""
        if all(p.is_greedy for p in params):
            return argmax_rows(logits).tolist()
        token_ids: list[int] = []
        for row, p, generator in zip(logits, params, generators):
            if p.is_greedy:
                token_ids.append(int(argmax_rows(row)))
                continue
            scaled = filter_logits(row.float() / p.temperature, p.top_k, p.top_p, p.min_p)
            probs = scaled.softmax(-1)
            token_ids.append(int(torch.multinomial(probs, 1, generator=generator)))
        return token_ids
