"""SplitAttention, the `fast` backend: few-token queries batched, prefill chunks one by one.

Requests that each feed the same few tokens (decodes: 1; verify steps: k + 1) and sit side by side in the
flat batch go through one SDPA call per group, with the G query heads of a KV group folded into the query
axis (as G x T rows against the mask tiled G times) so each KV head is read once and no backend has to
repeat the keys for GQA. Keys that sit in one block per request (every slot) are read through a strided
view, no copy. Otherwise whole blocks are gathered into a workspace that every layer reuses, and requests
of very different lengths are split into a few groups, so a short request is not padded to the longest one
(see `split_decode_groups`).

A fresh prompt chunk attends causally to its own new keys, the same call `ar` makes. A continued chunk
(chunked prefill or a prefix-cache hit), or a lone verify step, reads its context from its blocks under a
causal mask.

Owns: the fast attention math over blocks. Ignores: which request a block belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lab.kv_cache.tree_mask import hidden_keys

if TYPE_CHECKING:
    from lab.kv_cache.block_kv import BlockKVCache, SeqSlice, StepIndex

# NOTE: one more group costs two gathers and an SDPA call per layer; counted as the bytes of this much
# extra KV read when deciding whether a split pays.
GROUP_OVERHEAD_BYTES = 256 * 1024
# NOTE: requests feeding 2..this many tokens with a context (verify steps, a tree of drafts) are batched like
# decodes when two or more sit side by side; longer chunks (prefill) keep one causal SDPA call each.
MAX_GROUPED_QUERY_TOKENS = 16


@dataclass(slots=True)
class GroupMeta:
    """Requests that each feed `num_query` tokens (decodes: 1), attended in one SDPA call."""

    row_start: int              # first flat-batch row of this group
    num_seqs: int               # B requests in the group
    num_query: int              # T tokens each
    num_keys: int               # S, padded key length
    mask: torch.Tensor          # (rows, 1, T, S): token t of a row sees key s
    mode: str                   # "view": slice of consecutive blocks; "select": one block each; "gather"
    block_ids: torch.Tensor     # view: (B,) row of each request in the slice; select: (B,); gather: (B*nb,)
    first_block: int = 0
    num_rows: int = 0           # view: blocks in the slice
    folded_mask: torch.Tensor | None = None   # (rows, 1, G*T, S), the mask tiled over the G folded query heads


@dataclass(slots=True)
class ChunkMeta:
    q_start: int
    q_end: int
    num_context: int
    block_ids: torch.Tensor | None   # None: a fresh prompt, attends to its own new keys
    mask: torch.Tensor | None        # (1, 1, T, context + T)
    single_block: int = -1           # the block holding all its keys, when there is one (no copy)
    folded_mask: torch.Tensor | None = None   # (1, 1, G*T, S), the mask tiled over the G folded query heads


@dataclass(slots=True)
class SplitMeta:
    groups: list[GroupMeta]
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
        groups: list[GroupMeta] = []
        chunks: list[ChunkMeta] = []
        for start, end in _runs_of_equal_queries(index.seqs):
            if end - start == 1 and index.seqs[start].num_query_tokens > 1:
                chunks.append(self._prepare_chunk(cache, index, start))
                continue
            bs, num_query = cache.block_size, index.seqs[start].num_query_tokens
            padded = [-(-(s.num_context_tokens + num_query) // bs) * bs for s in index.seqs[start:end]]
            if max(padded) == bs:   # one block each (every slot): one group, read without copies
                cuts = [(start, end)]
            else:
                bytes_per_key = 2 * cache.num_kv_heads * cache.head_dim * cache.k[0].element_size()
                cuts = [(start + a, start + b)
                        for a, b in split_decode_groups(padded, GROUP_OVERHEAD_BYTES // bytes_per_key)]
            groups += [self._prepare_group(cache, index, a, b) for a, b in cuts]
        return SplitMeta(groups, chunks)

    @staticmethod
    def _prepare_group(cache: BlockKVCache, index: StepIndex, start: int, end: int) -> GroupMeta:
        bs, device, num_seqs = cache.block_size, cache.device, end - start
        num_query = index.seqs[start].num_query_tokens
        num_keys = int(index.context_lens[start:end].max()) + num_query
        num_blocks = -(-num_keys // bs)
        key_pos = torch.arange(num_keys if num_blocks == 1 else num_blocks * bs)
        visible = _visible_keys(index, start, end, len(key_pos))                               # (B, T, S)
        row = index.q_start[start]
        if num_blocks > 1:
            block_ids = index.block_tables[start:end, :num_blocks].reshape(-1)               # (B*nb,)
            return GroupMeta(row, num_seqs, num_query, len(key_pos), visible[:, None].to(device), "gather", block_ids)
        block_ids = [seq.block_table[0] for seq in index.seqs[start:end]]
        first, last = min(block_ids), max(block_ids)
        # NOTE: a slice over consecutive slots costs no copy; idle slots in it compute a wasted row
        # each, so a sparse set of slots is selected (copied) instead.
        if last - first + 1 <= 2 * num_seqs + 8:
            rows = torch.tensor(block_ids) - first
            mask = (key_pos == 0).expand(last - first + 1, num_query, -1).clone()
            mask[rows] = visible
            return GroupMeta(row, num_seqs, num_query, len(key_pos), mask[:, None].to(device), "view",
                             rows.to(device), first, last - first + 1)
        return GroupMeta(row, num_seqs, num_query, len(key_pos), visible[:, None].to(device), "select",
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
        mask = _visible_keys(index, i, i + 1, num_keys)[:, None]                                # (1, 1, T, S)
        single = seq.block_table[0] if num_blocks == 1 else -1
        return ChunkMeta(start, start + num_query, num_context, block_ids, mask.to(cache.device), single)

    def attend(self, cache: BlockKVCache, meta: SplitMeta, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k/v (N, Hkv, D) of this step (already stored) -> (N, Hq, D)."""
        out = torch.empty_like(q)                                                             # (N, Hq, D)
        for group in meta.groups:
            rows = slice(group.row_start, group.row_start + group.num_seqs * group.num_query)
            out[rows] = self._group(cache, group, layer_idx, q[rows])
        for chunk in meta.chunks:
            out[chunk.q_start:chunk.q_end] = _chunk(cache, chunk, layer_idx, q, k, v)
        return out

    def _group_kv(self, store: torch.Tensor, meta: GroupMeta, slot: int) -> torch.Tensor:
        """Keys or values of a group as (rows, Hkv, S, D), a strided view where possible."""
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

    def _group(self, cache: BlockKVCache, meta: GroupMeta, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
        """rows (B*T, Hq, D), the group's queries token by token -> their outputs, the same shape."""
        keys = self._group_kv(cache.k[layer_idx], meta, 0)
        values = self._group_kv(cache.v[layer_idx], meta, 1)
        num_kv_heads, (num_heads, head_dim) = keys.shape[1], rows.shape[1:]
        group, num_seqs, num_query = num_heads // num_kv_heads, meta.num_seqs, meta.num_query
        queries = (rows.reshape(num_seqs, num_query, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
                   .reshape(num_seqs, num_kv_heads, group * num_query, head_dim))               # (B, Hkv, G*T, D)
        if num_query == 1:
            mask = meta.mask                                                                   # (rows, 1, 1, S)
        else:
            if meta.folded_mask is None:   # NOTE: once a step, every layer reuses it
                meta.folded_mask = _fold_mask(meta.mask, group)
            mask = meta.folded_mask
        if meta.mode == "view":
            padded = queries.new_zeros((meta.num_rows, *queries.shape[1:]))
            padded[meta.block_ids] = queries
            out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=mask)[meta.block_ids]
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)          # (B, Hkv, G*T, D)
        return (out.view(num_seqs, num_kv_heads, group, num_query, head_dim).permute(0, 3, 1, 2, 4)
                .reshape(num_seqs * num_query, num_heads, head_dim))


def _runs_of_equal_queries(seqs: list[SeqSlice]) -> list[tuple[int, int]]:
    """The step's requests cut into runs [start, end) in flat-batch order: side-by-side requests feeding the same
    few tokens (decodes, verify steps) share a run; any other request is a run of its own."""
    runs: list[tuple[int, int]] = []
    start = 0
    while start < len(seqs):
        end = start + 1
        if _groupable(seqs[start]):
            while end < len(seqs) and _groupable(seqs[end]) and \
                    seqs[end].num_query_tokens == seqs[start].num_query_tokens:
                end += 1
        runs.append((start, end))
        start = end
    return runs


def _groupable(seq: SeqSlice) -> bool:
    return seq.num_query_tokens == 1 or (seq.num_query_tokens <= MAX_GROUPED_QUERY_TOKENS
                                         and (seq.num_context_tokens > 0 or seq.tree is not None))


def _visible_keys(index: StepIndex, start: int, end: int, num_keys: int) -> torch.Tensor:
    """(B, T, S) bool for requests [start, end), each feeding T tokens: token t sees key s, its context and its own
    tokens up to itself, less the keys a tree of drafts hides (a node sees its ancestors only)."""
    num_query = index.seqs[start].num_query_tokens
    query_pos = index.context_lens[start:end, None] + torch.arange(num_query)                  # (B, T)
    visible = torch.arange(num_keys)[None, None] <= query_pos[:, :, None]                      # (B, T, S)
    for b in range(start, end):
        for t, key in hidden_keys(index, b):
            visible[b - start, t, key] = False
    return visible


def _fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """(rows, 1, T, S) -> (rows, 1, G*T, S): row g*T + t is token t's, for each of the G query heads folded in."""
    return mask.repeat(1, 1, group, 1)


def _chunk(cache: BlockKVCache, chunk: ChunkMeta, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> torch.Tensor:
    queries = q[chunk.q_start:chunk.q_end].transpose(0, 1)[None]                            # (1, Hq, T, D)
    if chunk.block_ids is None:
        keys = k[chunk.q_start:chunk.q_end].transpose(0, 1)[None]                            # (1, Hkv, T, D)
        values = v[chunk.q_start:chunk.q_end].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                             enable_gqa=queries.shape[1] != keys.shape[1])  # (1, Hq, T, D)
        return out[0].transpose(0, 1)                                                        # (T, Hq, D)
    num_keys = chunk.mask.shape[-1]
    keys = _chunk_kv(cache.k[layer_idx], chunk, num_keys)                                    # (1, Hkv, S, D)
    values = _chunk_kv(cache.v[layer_idx], chunk, num_keys)
    # NOTE: the G query heads of a KV head folded into the query axis under the mask tiled G times: a masked SDPA
    # with enable_gqa falls to the math backend on CUDA (cuDNN off in eager steps), a plain one does not.
    (_, num_heads, num_query, head_dim), num_kv_heads = queries.shape, keys.shape[1]
    group = num_heads // num_kv_heads
    folded = queries.reshape(1, num_kv_heads, group * num_query, head_dim)                   # (1, Hkv, G*T, D)
    if chunk.folded_mask is None:   # NOTE: once a step, every layer reuses it
        chunk.folded_mask = _fold_mask(chunk.mask, group)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=chunk.folded_mask)
    # NOTE: reshape: CUDA's SDPA kernels return (1, Hkv, G*T, D) laid out as (1, G*T, Hkv, D), which no view merges
    return out.reshape(num_heads, num_query, head_dim).transpose(0, 1)                       # (T, Hq, D)


def _chunk_kv(store: torch.Tensor, chunk: ChunkMeta, num_keys: int) -> torch.Tensor:
    """One request's first `num_keys` keys or values as (1, Hkv, S, D); no copy for a single block."""
    if chunk.single_block >= 0:
        return store[:, chunk.single_block, :num_keys][None]
    heads, _, bs, head_dim = store.shape
    blocks = store.index_select(1, chunk.block_ids)                                          # (Hkv, nb, bs, D)
    return blocks.view(heads, -1, head_dim)[:, :num_keys][None]
