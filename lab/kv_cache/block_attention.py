"""Attention over BlockKVCache storage for a flat batch of requests: the backend interface and the
`gather` backend, the clear reference (`fast`, batched SDPA, is in split_attention.py; `native`, the
default, decodes and verify steps in a C++ kernel over the blocks, in native_attention.py).

`gather`: every request's keys are gathered token by token into a padded (R, Hkv, S, D), queries into
a padded (R, Hq, T, D), and one SDPA call with a causal + padding mask serves decodes and prefill
chunks alike.

Owns: attention math over blocks. Ignores: which request a block belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from lab.errors import LabError
from lab.kv_cache.tree_mask import hidden_keys
from lab.kv_cache.native_attention import NativeAttention
from lab.kv_cache.split_attention import SplitAttention

if TYPE_CHECKING:
    from lab.kv_cache.block_kv import BlockKVCache, StepIndex


class AttentionBackend(Protocol):
    def prepare(self, cache: BlockKVCache, index: StepIndex) -> object:
        """The step's plan; a request's tree of drafts (SeqSlice.tree) is masked: each token sees its ancestors."""
        ...

    def attend(self, cache: BlockKVCache, meta: object, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k/v (N, Hkv, D) of this step (already stored) -> (N, Hq, D)."""
        ...


def make_backend(name: str) -> AttentionBackend:
    backends = {"fast": SplitAttention, "gather": GatherAttention, "native": NativeAttention}
    if name not in backends:
        raise LabError(f"unknown attention backend {name!r}", f"use one of {sorted(backends)}")
    return backends[name]()


def _flat(store: torch.Tensor) -> torch.Tensor:
    heads, num_blocks, block_size, head_dim = store.shape
    return store.view(heads, num_blocks * block_size, head_dim)   # (Hkv, num_blocks * block_size, D)


# -- gather: the reference ---------------------------------------------------------------------------
@dataclass(slots=True)
class GatherMeta:
    key_index: torch.Tensor     # (R * S,) flat storage index of every (request, key position)
    query_index: torch.Tensor   # (R * T,) flat-batch row of every (request, query position)
    out_index: torch.Tensor     # (N,) padded row of each flat-batch token
    mask: torch.Tensor          # (R, 1, T, S) True = may attend
    num_seqs: int
    max_query: int
    max_keys: int


class GatherAttention:
    def prepare(self, cache: BlockKVCache, index: StepIndex) -> GatherMeta:
        num_seqs, bs = len(index.seqs), cache.block_size
        ctx, qlen = index.context_lens, index.query_lens
        max_query, max_keys = int(qlen.max()), int((ctx + qlen).max())
        key_pos = torch.arange(max_keys)                                                     # (S,)
        blocks = index.block_tables.cpu().gather(1, (key_pos // bs).clamp(max=index.block_tables.shape[1] - 1)
                                                 .expand(num_seqs, -1))                      # (R, S)
        key_index = blocks * bs + key_pos % bs                                               # (R, S)
        query_pos = torch.arange(max_query)                                                  # (T,)
        query_valid = query_pos[None] < qlen[:, None]                                        # (R, T)
        starts = torch.tensor(index.q_start, dtype=torch.long)
        query_index = torch.where(query_valid, starts[:, None] + query_pos[None], 0)         # (R, T)
        causal = key_pos[None, None] <= (ctx[:, None] + query_pos[None])[..., None]          # (R, T, S)
        # NOTE: a padded query row may see key 0 only, so SDPA never softmaxes an all-masked row.
        mask = torch.where(query_valid[..., None], causal, key_pos == 0)
        if index.hidden is not None:   # NOTE: a tree of drafts: a token does not see its siblings' branches
            for row in range(num_seqs):
                for t, key in hidden_keys(index, row):
                    mask[row, t, key] = False
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), qlen)
        out_index = seq_idx * max_query + (torch.arange(len(seq_idx)) - starts[seq_idx])
        device = cache.device
        return GatherMeta(key_index.view(-1).to(device), query_index.view(-1).to(device), out_index.to(device),
                          mask[:, None].to(device), num_seqs, max_query, max_keys)

    def attend(self, cache: BlockKVCache, meta: GatherMeta, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        num_seqs, max_query, max_keys = meta.num_seqs, meta.max_query, meta.max_keys
        num_heads, head_dim = q.shape[1], q.shape[2]
        keys = _flat(cache.k[layer_idx]).index_select(1, meta.key_index)                     # (Hkv, R*S, D)
        values = _flat(cache.v[layer_idx]).index_select(1, meta.key_index)
        keys = keys.view(-1, num_seqs, max_keys, head_dim).transpose(0, 1)                   # (R, Hkv, S, D)
        values = values.view(-1, num_seqs, max_keys, head_dim).transpose(0, 1)
        queries = q.index_select(0, meta.query_index).view(num_seqs, max_query, num_heads, head_dim)
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=meta.mask,
                                             enable_gqa=num_heads != keys.shape[1])          # (R, Hq, T, D)
        out = out.transpose(1, 2).reshape(num_seqs * max_query, num_heads, head_dim)
        return out.index_select(0, meta.out_index)                                           # (N, Hq, D)
