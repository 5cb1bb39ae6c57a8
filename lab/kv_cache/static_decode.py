"""StaticDecodeView: one decode step over BlockKVCache storage with every shape and address fixed in advance,
so that a CUDA graph can capture it once and replay it for any step that fits (lab/runner/cuda_graphs.py).

The view has `num_rows` rows (P; a step of R <= P requests fills the first R, the rest are padding) of one
new token each, and block tables `num_block_cols` (W) wide. A step copies its token ids and indices into
the view's buffers (`load`); the forward then writes every row's key/value at its slot and attends over
all W * block_size key positions of its table, masked beyond the row's length. Padding rows write into
the cache's scratch block, which no request owns, and attend to that one key.

Owns: the static index buffers and the attention math over them. Ignores: which request a row is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.errors import LabError
from lab.kv_cache.block_kv import BlockKVCache, StepIndex
from lab.profiling.ranges import profile_range


class StaticDecodeView:
    def __init__(self, cache: BlockKVCache, num_rows: int, num_block_cols: int) -> None:
        if cache.scratch_block is None:
            raise LabError("a fixed-shape decode step needs a KV cache with a scratch block",
                           "allocate it with allocate_block_kv_cache(..., scratch_block=True)")
        device, bs = cache.device, cache.block_size
        self.cache = cache
        self.num_rows, self.num_block_cols = num_rows, num_block_cols
        self.num_keys = num_block_cols * bs
        self.scratch_slot = cache.scratch_block * bs
        self.input_ids = torch.zeros((1, num_rows), dtype=torch.long, device=device)                # (1, P)
        self.positions = torch.zeros((1, num_rows), dtype=torch.long, device=device)                # (1, P)
        self.block_tables = torch.full((num_rows, num_block_cols), cache.scratch_block, dtype=torch.long,
                                       device=device)                                                # (P, W)
        self.seq_lens = torch.ones(num_rows, dtype=torch.long, device=device)                       # (P,) keys
        self.slot_mapping = torch.full((num_rows,), self.scratch_slot, dtype=torch.long, device=device)  # (P,)
        self._block_offsets = torch.arange(bs, device=device)                                       # (bs,)
        self._key_positions = torch.arange(self.num_keys, device=device)                            # (S,)
        self._key_index: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def load(self, input_ids: torch.Tensor, index: StepIndex) -> None:
        """Copy a decode step in: input_ids (R,), `index` of R single-token requests (R <= P, its block
        tables at most W wide). Rows R.. are reset to padding."""
        num_seqs, width = index.block_tables.shape
        max_query = int(index.query_lens.max())
        if num_seqs > self.num_rows or width > self.num_block_cols or max_query != 1:
            raise LabError(f"a step of {num_seqs} requests x {width} blocks (query lengths up to "
                           f"{max_query}) does not fit a {self.num_rows} x {self.num_block_cols} "
                           "decode view", "send only single-token steps that fit (DecodeGraphs.fits)")
        self.input_ids[0, :num_seqs].copy_(input_ids)
        self.input_ids[0, num_seqs:].zero_()
        self.positions[0, :num_seqs].copy_(index.positions)
        self.positions[0, num_seqs:].zero_()
        self.block_tables[:num_seqs, :width].copy_(index.block_tables)
        self.block_tables[:num_seqs, width:].fill_(self.cache.scratch_block)
        self.block_tables[num_seqs:].fill_(self.cache.scratch_block)
        self.seq_lens[:num_seqs].copy_(index.context_lens + 1)
        self.seq_lens[num_seqs:].fill_(1)
        self.slot_mapping[:num_seqs].copy_(index.slot_mapping)
        self.slot_mapping[num_seqs:].fill_(self.scratch_slot)

    def begin_forward(self) -> None:
        """Per-forward indices every layer shares (inside the captured region: they follow the buffers)."""
        bs = self.cache.block_size
        self._key_index = (self.block_tables[:, :, None] * bs + self._block_offsets).view(-1)      # (P * S,)
        self._mask = (self._key_positions[None] < self.seq_lens[:, None])[:, None, None, :]        # (P, 1, 1, S)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, P, Hq, D), k/v (1, P, Hkv, D) -> (1, P, Hq, D)."""
        cache = self.cache
        num_rows, num_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
        with profile_range("attention"):
            cache.store(layer_idx, self.slot_mapping, k[0], v[0])
            flat_shape = (cache.num_kv_heads, -1, head_dim)
            keys = cache.k[layer_idx].view(flat_shape).index_select(1, self._key_index)          # (Hkv, P*S, D)
            values = cache.v[layer_idx].view(flat_shape).index_select(1, self._key_index)
            keys = keys.view(-1, num_rows, self.num_keys, head_dim).transpose(0, 1)               # (P, Hkv, S, D)
            values = values.view(-1, num_rows, self.num_keys, head_dim).transpose(0, 1)
            out = F.scaled_dot_product_attention(q[0][:, :, None], keys, values, attn_mask=self._mask,
                                                 enable_gqa=num_heads != keys.shape[1])           # (P, Hq, 1, D)
        return out[:, :, 0][None]
