"""The parallel modules (Megatron-LM's split): a column-parallel linear is a plain nn.Linear holding some
output rows, so it needs no communication; a row-parallel linear holds some input columns and all-reduces
its partial sums; the vocab-parallel embedding looks up only its rows and all-reduces; the vocab-parallel
head computes its slice of the logits and all-gathers them.

Owns: the forward passes and their collectives. Ignores: which weights go where (shard.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, end, padded rows per rank): every rank holds ceil(V / world) rows (the last one padded),
    since all-gather needs equal shapes."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size), per_rank


def padded_rows(weight: torch.Tensor, start: int, end: int, num_rows: int) -> torch.Tensor:
    rows = weight[start:end]
    if rows.shape[0] < num_rows:
        rows = torch.cat([rows, rows.new_zeros(num_rows - rows.shape[0], *rows.shape[1:])])
    return rows.clone()


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W[:, local columns]^T): the input arrives already split (by heads or by
    the MLP's intermediate features), so each rank's product is one term of the full sum."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # (out, in / world)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids in its vocab range (zeros elsewhere); the all-reduce sums one real row
    with zeros, so the result equals the unsharded lookup exactly."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # (V / world, H)
        self.start, self.end, self.group = start, end, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_local = (input_ids >= self.start) & (input_ids < self.end)            # (B, T)
        local_ids = torch.where(is_local, input_ids - self.start, 0)
        out = F.embedding(local_ids, self.weight) * is_local.unsqueeze(-1)      # (B, T, H)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """logits = all_gather(hidden @ W[local vocab rows]^T) along the vocab, trimmed to the true size."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, world_size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # (ceil(V / world), H)
        self.vocab_size, self.world_size, self.group = vocab_size, world_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()                      # (..., V / world)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]                   # (..., V)
