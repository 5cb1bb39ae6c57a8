"""NativeAttention, the `native` backend: decodes and short chunks (a verify step's k + 1 tokens) read their
keys and values straight from the blocks in one small C++ kernel per layer (no gather copy, no padding);
prefill chunks go through SplitAttention.

The kernel is vLLM's CPU paged-attention idea at its simplest: for every (query row, KV head) it walks the
row's block table, scores the G query heads of the group against each key (AVX2), softmaxes in fp32 and
sums the values. It lives with the other decode kernels in lab/models/native_gemv.py (the same code serves
`ar`'s contiguous cache) and is compiled on first use. Without a compiler or AVX2, on a GPU, or in another
dtype than fp32 the backend falls back to SplitAttention, so `native` is always safe to ask for.

Owns: the decode kernel and when to use it. Ignores: which request a block belongs to.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lab.kv_cache.split_attention import SplitAttention, SplitMeta
from lab.kv_cache.tree_mask import NO_HIDDEN
from lab.models import native_gemv

if TYPE_CHECKING:
    from lab.kv_cache.block_kv import BlockKVCache, StepIndex


def load_kernel() -> Any | None:
    """The compiled kernels (lab/models/native_gemv.py, whose `paged_decode` this backend calls), or None
    where they cannot run here (the reason is warned once)."""
    return native_gemv.load_kernel()


# NOTE: a request feeding at most this many tokens (a decode: 1; a verify step: k + 1, or a tree of up to 63
# drafts) has each token attend as its own kernel row over its context and the step's earlier tokens, so a
# verify reads K/V exactly as k + 1 decodes would (same kernel, same sums: its logits equal a decode's), and the
# model can run the whole step in one native call (paged_step_layers). Longer chunks (prefill) go to
# SplitAttention's causal SDPA, which reads the context once for all their tokens. 64: the kernel's hidden-key
# bits (a tree row hides at most 63 of the step's keys); was 8 until AMX tiles made 16-64-row verify steps cheap
# (lab/models/native_tiles.py, docs/speculative.md, session 38).
MAX_KERNEL_QUERY_TOKENS = 64


@dataclass(slots=True)
class NativeMeta:
    num_rows: int                  # leading flat-batch tokens the kernel attends (one row each)
    tables: torch.Tensor | None    # (num_rows, max_blocks) int64, each row's request's block table
    lens: torch.Tensor | None      # (num_rows,) int64, keys each row attends to (up to and including itself)
    hidden: torch.Tensor | None    # (num_rows,) int64, keys a row of a tree of drafts does not see; None: none
    chunks: SplitMeta              # the longer chunks, SplitAttention's plan


class NativeAttention:
    def __init__(self) -> None:
        self.split = SplitAttention()

    def usable(self, cache: BlockKVCache) -> bool:
        return (cache.device.type == "cpu" and cache.k[0].dtype == torch.float32 and cache.head_dim % 8 == 0
                and load_kernel() is not None)

    def prepare(self, cache: BlockKVCache, index: StepIndex) -> NativeMeta | SplitMeta:
        if not self.usable(cache):
            return self.split.prepare(cache, index)
        num_short = 0
        for seq in index.seqs:
            if seq.num_query_tokens > MAX_KERNEL_QUERY_TOKENS:
                break
            num_short += 1
        if num_short == len(index.seqs):   # NOTE: a decode or verify step: no chunk, nothing to split
            chunks = SplitMeta([], [])
        else:   # NOTE: SplitAttention sees only the longer chunks; their q_start stays absolute in the flat batch.
            rest = dataclasses.replace(index, seqs=index.seqs[num_short:], q_start=index.q_start[num_short:],
                                       block_tables=index.block_tables[num_short:],
                                       context_lens=index.context_lens[num_short:],
                                       query_lens=index.query_lens[num_short:])
            chunks = self.split.prepare(cache, rest)
        if not num_short:
            return NativeMeta(0, None, None, None, chunks)
        # NOTE: one kernel row per token: its request's block table and the keys up to and including it,
        # built in Python (a few rows per request) rather than with several small tensor ops.
        lens, rows = [], []
        for seq in index.seqs[:num_short]:
            for j in range(seq.num_query_tokens):
                lens.append(seq.num_context_tokens + j + 1)
                rows.append(seq.block_table)
        num_blocks = -(-max(lens) // cache.block_size)
        tables = torch.tensor([(r + [0] * num_blocks)[:num_blocks] for r in rows], dtype=torch.long)  # (rows, nb)
        hidden = None if index.hidden is None else index.hidden[:len(lens)].contiguous()
        return NativeMeta(len(lens), tables.to(cache.device), torch.tensor(lens, dtype=torch.long).to(cache.device),
                          hidden, chunks)

    def kernel_rows(self, meta: NativeMeta | SplitMeta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tables, lens) of paged_decode's rows when the step has no chunk for SplitAttention, every token a
        kernel row (decodes, verify steps); else None."""
        if isinstance(meta, NativeMeta) and meta.num_rows and not meta.chunks.groups and not meta.chunks.chunks:
            return meta.tables, meta.lens
        return None

    def attend(self, cache: BlockKVCache, meta: NativeMeta | SplitMeta, layer_idx: int, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k/v (N, Hkv, D) of this step (already stored) -> (N, Hq, D)."""
        if isinstance(meta, SplitMeta):
            return self.split.attend(cache, meta, layer_idx, q, k, v)
        out = self.split.attend(cache, meta.chunks, layer_idx, q, k, v)   # chunk rows filled, kernel rows not
        if meta.num_rows:
            num_rows, (num_heads, head_dim) = meta.num_rows, q.shape[1:]
            group = (num_rows, cache.num_kv_heads, num_heads // cache.num_kv_heads, head_dim)
            queries = q[:num_rows].contiguous().view(group)                                   # (rows, Hkv, G, D)
            hidden = meta.hidden if meta.hidden is not None else NO_HIDDEN
            native_gemv._KERNEL.paged_decode(queries, cache.k[layer_idx], cache.v[layer_idx], meta.tables,
                                             meta.lens, hidden, 1 / math.sqrt(head_dim), out[:num_rows].view(group))
        return out
