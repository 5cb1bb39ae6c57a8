"""Attention over BlockKVCache storage for a flat batch of requests: two interchangeable backends.

`gather` (the clear reference): every request's keys are gathered token by token into a padded
(R, Hkv, S, D), queries into a padded (R, Hq, T, D), and one SDPA call with a causal + padding mask
serves decodes and prefill chunks alike.

`fast` (the default): single-token queries (decodes) are batched into one SDPA call with the query
heads of a KV group folded into the query axis; a request whose keys sit in one block (every slot) is
read through a strided view with no copy, otherwise whole blocks are gathered into a workspace reused
by every layer. Prefill chunks run separately: a fresh prompt attends causally to its own new keys
(exactly `ar`'s call); a continued chunk reads its context from its blocks.

Owns: attention math over blocks. Ignores: which request a block belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from lab.errors import LabError

if TYPE_CHECKING:
    from lab.kv_cache.block_kv import BlockKVCache, StepIndex


class AttentionBackend(Protocol):
    def prepare(self, cache: BlockKVCache, index: StepIndex) -> object: ...

    def attend(self, cache: BlockKVCache, meta: object, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k/v (N, Hkv, D) of this step (already stored) -> (N, Hq, D)."""
        ...


def make_backend(name: str) -> AttentionBackend:
    backends = {"fast": SplitAttention, "gather": GatherAttention}
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


# -- fast: batched decodes + separate chunks -------------------------------------------------------
@dataclass(slots=True)
class DecodeMeta:
    num_seqs: int               # B decodes, the first B tokens of the batch
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
    decode: DecodeMeta | None
    chunks: list[ChunkMeta]


class SplitAttention:
    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None   # flat buffer for gathered decode keys and values

    def prepare(self, cache: BlockKVCache, index: StepIndex) -> SplitMeta:
        num_decodes = 0
        for seq in index.seqs:
            if seq.num_query_tokens != 1:
                break
            num_decodes += 1
        decode = self._prepare_decode(cache, index, num_decodes) if num_decodes else None
        chunks = [self._prepare_chunk(cache, index, i) for i in range(num_decodes, len(index.seqs))]
        return SplitMeta(decode, chunks)

    def _prepare_decode(self, cache: BlockKVCache, index: StepIndex, num_seqs: int) -> DecodeMeta:
        bs, device = cache.block_size, cache.device
        lens = index.context_lens[:num_seqs] + 1                                              # (B,)
        num_keys = int(lens.max())
        num_blocks = -(-num_keys // bs)
        key_pos = torch.arange(num_keys if num_blocks == 1 else num_blocks * bs)
        valid = key_pos[None] < lens[:, None]                                                 # (B, S)
        if num_blocks == 1:
            block_ids = [seq.block_table[0] for seq in index.seqs[:num_seqs]]
            first, last = min(block_ids), max(block_ids)
            # NOTE: a slice over consecutive slots costs no copy; idle slots in it compute a wasted row
            # each, so a sparse set of slots is selected (copied) instead.
            if last - first + 1 <= 2 * num_seqs + 8:
                rows = torch.tensor(block_ids) - first
                mask = (key_pos == 0).expand(last - first + 1, -1).clone()
                mask[rows] = valid
                return DecodeMeta(num_seqs, len(key_pos), mask[:, None, None].to(device), "view",
                                  rows.to(device), first, last - first + 1)
            return DecodeMeta(num_seqs, len(key_pos), valid[:, None, None].to(device), "select",
                              torch.tensor(block_ids, device=device))
        block_ids = index.block_tables[:num_seqs, :num_blocks].reshape(-1)                    # (B*nb,)
        return DecodeMeta(num_seqs, len(key_pos), valid[:, None, None].to(device), "gather", block_ids)

    @staticmethod
    def _prepare_chunk(cache: BlockKVCache, index: StepIndex, i: int) -> ChunkMeta:
        seq, start = index.seqs[i], index.q_start[i]
        num_context, num_query = seq.num_context_tokens, seq.num_query_tokens
        if num_context == 0:
            return ChunkMeta(start, start + num_query, 0, None, None)
        num_keys = num_context + num_query
        num_blocks = -(-num_keys // cache.block_size)
        block_ids = index.block_tables[i, :num_blocks]
        query_pos = torch.arange(num_context, num_keys)[:, None]
        mask = (torch.arange(num_keys)[None] <= query_pos)[None, None]                      # (1, 1, T, S)
        single = seq.block_table[0] if num_blocks == 1 else -1
        return ChunkMeta(start, start + num_query, num_context, block_ids, mask.to(cache.device), single)

    def attend(self, cache: BlockKVCache, meta: SplitMeta, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)                                                             # (N, Hq, D)
        if meta.decode is not None:
            out[:meta.decode.num_seqs] = self._decode(cache, meta.decode, layer_idx, q)
        for chunk in meta.chunks:
            out[chunk.q_start:chunk.q_end] = self._chunk(cache, chunk, layer_idx, q, k, v)
        return out

    def _decode_kv(self, store: torch.Tensor, meta: DecodeMeta, slot: int) -> torch.Tensor:
        """Keys or values of the decodes as (rows, Hkv, S, D), a strided view where possible."""
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
        # NOTE: fold the G query heads of a KV group into the query axis: each KV head is read once.
        queries = q[:meta.num_seqs].reshape(meta.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if meta.mode == "view":
            padded = queries.new_zeros((meta.num_rows, *queries.shape[1:]))
            padded[meta.block_ids] = queries
            out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=meta.mask)[meta.block_ids]
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask)  # (B, Hkv, G, D)
        return out.reshape(meta.num_seqs, num_heads, head_dim)

    @staticmethod
    def _chunk(cache: BlockKVCache, chunk: ChunkMeta, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        queries = q[chunk.q_start:chunk.q_end].transpose(0, 1)[None]                        # (1, Hq, T, D)
        if chunk.block_ids is None:
            keys = k[chunk.q_start:chunk.q_end].transpose(0, 1)[None]                        # (1, Hkv, T, D)
            values = v[chunk.q_start:chunk.q_end].transpose(0, 1)[None]
        else:
            num_keys = chunk.mask.shape[-1]
            keys = _chunk_kv(cache.k[layer_idx], chunk, num_keys)
            values = _chunk_kv(cache.v[layer_idx], chunk, num_keys)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask,
                                             is_causal=chunk.mask is None,
                                             enable_gqa=queries.shape[1] != keys.shape[1])  # (1, Hq, T, D)
        return out[0].transpose(0, 1)                                                        # (T, Hq, D)


def _chunk_kv(store: torch.Tensor, chunk: ChunkMeta, num_keys: int) -> torch.Tensor:
    """One request's first `num_keys` keys or values as (1, Hkv, S, D); no copy for a single block."""
    if chunk.single_block >= 0:
        return store[:, chunk.single_block, :num_keys][None]
    heads, _, bs, head_dim = store.shape
    blocks = store.index_select(1, chunk.block_ids)                                          # (Hkv, nb, bs, D)
    return blocks.view(heads, -1, head_dim)[:, :num_keys][None]
