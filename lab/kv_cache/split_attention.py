"""SplitAttention, the `fast` backend: decodes batched, prefill chunks one by one.

Single-token queries (decodes) go through one SDPA call per group, with the G query heads of a KV group
folded into the query axis so each KV head is read once. Keys that sit in one block per request (every
slot) are read through a strided view, no copy. Otherwise whole blocks are gathered into a workspace
that every layer reuses, and decodes of very different lengths are split into a few groups, so a short
request is not padded to the longest one (see `split_decode_groups`).

A fresh prompt chunk attends causally to its own new keys, the same call `ar` makes. A continued chunk
(chunked prefill or a prefix-cache hit) reads its context from its blocks under a causal mask.

Owns: the fast attention math over blocks. Ignores: which request a block belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lab.kv_cache.tree_mask import hidden_keys

if TYPE_CHECKING:
    from lab.kv_cache.block_kv import BlockKVCache, StepIndex

# NOTE: one more decode group costs two gathers and an SDPA call per layer; counted as the bytes of
# this much extra KV read when deciding whether a split pays.
GROUP_OVERHEAD_BYTES = 256 * 1024


@dataclass(slots=True)
class DecodeMeta:
    row_start: int              # first flat-batch row of this group
    num_seqs: int               # B decodes in the group
    num_keys: int               # S, padded key length
    mask: torch.Tensor          # (rows, 1, 1, S)
    mode: str                   # "view": slice of consecutive blocks; "select": one block each; "gather"
    block_ids: torch.Tensor     # view: (B,) row of each decode in the slice; select: (B,); gather: (B*nb,)
    first_block: int = 0
    num_rows: int = 0           # view: blocks in the slice


@dataclass(slots=True)
class ChunkMeta:
    q_start: int
    q_end: int
    num_context: int
    block_ids: torch.Tensor | None   # None: a fresh prompt, attends to its own new keys
    mask: torch.Tensor | None        # (1, 1, T, context + T)
    single_block: int = -1           # the block holding all its keys, when there is one (no copy)


@dataclass(slots=True)
class SplitMeta:
    decodes: list[DecodeMeta]
    chunks: list[ChunkMeta]


def split_decode_groups(num_keys: list[int], overhead_keys: int) -> list[tuple[int, int]]:
    """Cut decodes (in batch order, ideally longest first) into contiguous groups [start, end) that
    minimise sum(rows x longest padded keys) + overhead_keys per group: an O(B^2) dynamic program."""
    n = len(num_keys)
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        longest = 0
        for start in range(end - 1, -1, -1):
            longest = max(longest, num_keys[start])
            cost = best[start] + (end - start) * longest + overhead_keys
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], n
    while end > 0:
        groups.append((cut[end], end))
        end = cut[end]
    return groups[::-1]


class SplitAttention:
    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None   # flat buffer for gathered decode keys and values

    def prepare(self, cache: BlockKVCache, index: StepIndex) -> SplitMeta:
        num_decodes = 0
        for seq in index.seqs:
            if seq.num_query_tokens != 1:
                break
            num_decodes += 1
        decodes = []
        if num_decodes:
            bs = cache.block_size
            padded = [-(-(s.num_context_tokens + 1) // bs) * bs for s in index.seqs[:num_decodes]]
            if max(padded) == bs:   # one block each (every slot): one group, read without copies
                groups = [(0, num_decodes)]
            else:
                bytes_per_key = 2 * cache.num_kv_heads * cache.head_dim * cache.k[0].element_size()
                groups = split_decode_groups(padded, GROUP_OVERHEAD_BYTES // bytes_per_key)
            decodes = [self._prepare_decode(cache, index, start, end) for start, end in groups]
        chunks = [self._prepare_chunk(cache, index, i) for i in range(num_decodes, len(index.seqs))]
        return SplitMeta(decodes, chunks)

    @staticmethod
    def _prepare_decode(cache: BlockKVCache, index: StepIndex, start: int, end: int) -> DecodeMeta:
        bs, device, num_seqs = cache.block_size, cache.device, end - start
        lens = index.context_lens[start:end] + 1                                             # (B,)
        num_keys = int(lens.max())
        num_blocks = -(-num_keys // bs)
        key_pos = torch.arange(num_keys if num_blocks == 1 else num_blocks * bs)
        valid = key_pos[None] < lens[:, None]                                                 # (B, S)
        if num_blocks > 1:
            block_ids = index.block_tables[start:end, :num_blocks].reshape(-1)               # (B*nb,)
            return DecodeMeta(start, num_seqs, len(key_pos), valid[:, None, None].to(device), "gather", block_ids)
        block_ids = [seq.block_table[0] for seq in index.seqs[start:end]]
        first, last = min(block_ids), max(block_ids)
        # NOTE: a slice over consecutive slots costs no copy; idle slots in it compute a wasted row
        # each, so a sparse set of slots is selected (copied) instead.
        if last - first + 1 <= 2 * num_seqs + 8:
            rows = torch.tensor(block_ids) - first
            mask = (key_pos == 0).expand(last - first + 1, -1).clone()
            mask[rows] = valid
            return DecodeMeta(start, num_seqs, len(key_pos), mask[:, None, None].to(device), "view",
                              rows.to(device), first, last - first + 1)
        return DecodeMeta(start, num_seqs, len(key_pos), valid[:, None, None].to(device), "select",
                          torch.tensor(block_ids, device=device))

    @staticmethod
    def _prepare_chunk(cache: BlockKVCache, index: StepIndex, i: int) -> ChunkMeta:
        seq, start = index.seqs[i], index.q_start[i]
        num_context, num_query = seq.num_context_tokens, seq.num_query_tokens
        if num_context == 0 and seq.tree is None:
            return ChunkMeta(start, start + num_query, 0, None, None)
        num_keys = num_context + num_query
        num_blocks = -(-num_keys // cache.block_size)
        block_ids = index.block_tables[i, :num_blocks]
        query_pos = torch.arange(num_context, num_keys)[:, None]
        mask = (torch.arange(num_keys)[None] <= query_pos)[None, None]                      # (1, 1, T, S)
        for t, key in hidden_keys(index, i):   # NOTE: a tree of drafts: a token sees its ancestors only
            mask[0, 0, t, key] = False
        single = seq.block_table[0] if num_blocks == 1 else -1
        return ChunkMeta(start, start + num_query, num_context, block_ids, mask.to(cache.device), single)

    def attend(self, cache: BlockKVCache, meta: SplitMeta, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k/v (N, Hkv, D) of this step (already stored) -> (N, Hq, D)."""
        out = torch.empty_like(q)                                                             # (N, Hq, D)
        for group in meta.decodes:
            out[group.row_start:group.row_start + group.num_seqs] = self._decode(cache, group, layer_idx, q)
        for chunk in meta.chunks:
            out[chunk.q_start:chunk.q_end] = _chunk(cache, chunk, layer_idx, q, k, v)
        return out

    def _decode_kv(self, store: torch.Tensor, meta: DecodeMeta, slot: int) -> torch.Tensor:
        """Keys or values of a decode group as (rows, Hkv, S, D), a strided view where possible."""
        heads, _, bs, head_dim = store.shape
        if meta.mode == "view":
            return store[:, meta.first_block:meta.first_block + meta.num_rows, :meta.num_keys].transpose(0, 1)
        if meta.mode == "select":
            return store[:, :, :meta.num_keys].index_select(1, meta.block_ids).transpose(0, 1)
        num_blocks = meta.block_ids.numel()
        size = heads * num_blocks * bs * head_dim
        if self._workspace is None or self._workspace.numel() < 2 * size or self._workspace.dtype != store.dtype:
            self._workspace = torch.empty(2 * size, dtype=store.dtype, device=store.device)
        out = self._workspace[slot * size:(slot + 1) * size].view(heads, num_blocks, bs, head_dim)
        torch.index_select(store, 1, meta.block_ids, out=out)
        return out.view(heads, meta.num_seqs, meta.num_keys, head_dim).transpose(0, 1)      # (B, Hkv, S, D)

    def _decode(self, cache: BlockKVCache, meta: DecodeMeta, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        keys = self._decode_kv(cache.k[layer_idx], meta, 0)
        values = self._decode_kv(cache.v[layer_idx], meta, 1)
        num_kv_heads, num_heads, head_dim = keys.shape[1], q.shape[1], q.shape[2]
        rows = q[meta.row_start:meta.row_start + meta.num_seqs]                                # (B, Hq, D)
        queries = rows.reshape(meta.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if meta.mode == "view":
            padded = queries.new_zeros((meta.num_rows, *queries.shape[1:]))
            padded[meta.block_ids] = queries
            out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=meta.mask)[meta.block_ids]
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask)  # (B, Hkv, G, D)
        return out.reshape(meta.num_seqs, num_heads, head_dim)


def _chunk(cache: BlockKVCache, chunk: ChunkMeta, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> torch.Tensor:
    queries = q[chunk.q_start:chunk.q_end].transpose(0, 1)[None]                            # (1, Hq, T, D)
    if chunk.block_ids is None:
        keys = k[chunk.q_start:chunk.q_end].transpose(0, 1)[None]                            # (1, Hkv, T, D)
        values = v[chunk.q_start:chunk.q_end].transpose(0, 1)[None]
    else:
        num_keys = chunk.mask.shape[-1]
        keys = _chunk_kv(cache.k[layer_idx], chunk, num_keys)
        values = _chunk_kv(cache.v[layer_idx], chunk, num_keys)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                         enable_gqa=queries.shape[1] != keys.shape[1])      # (1, Hq, T, D)
    return out[0].transpose(0, 1)                                                            # (T, Hq, D)


def _chunk_kv(store: torch.Tensor, chunk: ChunkMeta, num_keys: int) -> torch.Tensor:
    """One request's first `num_keys` keys or values as (1, Hkv, S, D); no copy for a single block."""
    if chunk.single_block >= 0:
        return store[:, chunk.single_block, :num_keys][None]
    heads, _, bs, head_dim = store.shape
    blocks = store.index_select(1, chunk.block_ids)                                          # (Hkv, nb, bs, D)
    return blocks.view(heads, -1, head_dim)[:, :num_keys][None]
