"""StaticDecodeView: one decode (or verify) step over BlockKVCache storage with every shape and address fixed
in advance, so that a CUDA graph can capture it once and replay it for any step that fits
(lab/runner/cuda_graphs.py).

The view has `num_rows` rows (P; a step of R <= P requests fills the first R, the rest are padding) of
`query_len` (Q) query tokens each, laid out row-major as a flat (1, P * Q) batch, and block tables
`num_block_cols` (W) wide. A plain decode step has Q = 1; a speculative verify step has Q = 1 + k (the last
accepted token, then the k drafts), and a request with fewer drafts pads the end of its row. A step copies its
token ids and indices into the view's buffers (`load`); the forward then writes every token's key/value at its
slot and attends over all W * block_size key positions of its row's table, causally: query q of a row sees
the row's context and its queries 0..q, less the keys a tree of drafts hides from it (`hidden`, the same bits as
the native kernel's: a node sees its ancestors, not its siblings; lab/kv_cache/tree_mask.py). Padding rows and
padding queries write into the cache's scratch block, which no request owns; their outputs are never read.

Owns: the static index buffers and the attention math over them. Ignores: which request a row is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.errors import LabError
from lab.kv_cache.block_kv import BlockKVCache, StepIndex
from lab.profiling.ranges import profile_range


class StaticDecodeView:
    def __init__(self, cache: BlockKVCache, num_rows: int, num_block_cols: int, query_len: int = 1) -> None:
        if cache.scratch_block is None:
            raise LabError("a fixed-shape decode step needs a KV cache with a scratch block",
                           "allocate it with allocate_block_kv_cache(..., scratch_block=True)")
        device, bs = cache.device, cache.block_size
        self.cache = cache
        self.num_rows, self.num_block_cols, self.query_len = num_rows, num_block_cols, query_len
        self.num_keys = num_block_cols * bs
        self.scratch_slot = cache.scratch_block * bs
        num_tokens = num_rows * query_len
        self.input_ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)              # (1, P*Q)
        self.positions = torch.zeros((1, num_tokens), dtype=torch.long, device=device)              # (1, P*Q)
        self.block_tables = torch.full((num_rows, num_block_cols), cache.scratch_block, dtype=torch.long,
                                       device=device)                                                # (P, W)
        self.seq_lens = torch.ones(num_rows, dtype=torch.long, device=device)   # (P,) keys of the row's query 0
        self.slot_mapping = torch.full((num_tokens,), self.scratch_slot, dtype=torch.long, device=device)  # (P*Q,)
        self.hidden = torch.zeros(num_tokens, dtype=torch.long, device=device)   # (P*Q,) hidden-key bits; 0: none
        self._block_offsets = torch.arange(bs, device=device)                                       # (bs,)
        self._key_positions = torch.arange(self.num_keys, device=device)                            # (S,)
        self._query_offsets = torch.arange(query_len, device=device)                                # (Q,)
        self._all_rows = torch.arange(num_tokens, device=device)                                    # (P*Q,)
        self._key_index: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def token_rows(self, index: StepIndex) -> torch.Tensor:
        """(N,) the view position of each token of the step's flat batch: request r's j-th token -> r * Q + j."""
        q = self.query_len
        if all(seq.num_query_tokens == q for seq in index.seqs):
            # NOTE: every plain decode step (Q = 1) and every fully drafted verify step: the first N rows, a slice
            # of a buffer already on the device (no list, no host-to-device copy in the decode step).
            return self._all_rows[:len(index.seqs) * q]
        rows = [r * q + j for r, seq in enumerate(index.seqs) for j in range(seq.num_query_tokens)]
        return torch.tensor(rows, dtype=torch.long).to(self.cache.device)

    def load(self, input_ids: torch.Tensor, index: StepIndex) -> torch.Tensor:
        """Copy a decode or verify step in: input_ids (N,), `index` of R requests of 1..Q tokens each, each
        past its prompt (R <= P, block tables at most W wide). Everything else is reset to padding. Returns
        token_rows(index): where each of the N tokens sits in the view."""
        num_seqs, width = index.block_tables.shape
        max_query = int(index.query_lens.max())
        if num_seqs > self.num_rows or width > self.num_block_cols or max_query > self.query_len:
            raise LabError(f"a step of {num_seqs} requests x {width} blocks (query lengths up to "
                           f"{max_query}) does not fit a {self.num_rows} x {self.num_block_cols} view of "
                           f"{self.query_len}-token queries", "send only steps that fit (DecodeGraphs.fits)")
        rows = self.token_rows(index)
        self.input_ids.zero_()
        self.input_ids[0].index_copy_(0, rows, input_ids.to(self.input_ids.device))
        self.positions.zero_()
        self.positions[0].index_copy_(0, rows, index.positions.to(rows.device))
        self.block_tables[:num_seqs, :width].copy_(index.block_tables)
        self.block_tables[:num_seqs, width:].fill_(self.cache.scratch_block)
        self.block_tables[num_seqs:].fill_(self.cache.scratch_block)
        self.seq_lens[:num_seqs].copy_(index.context_lens + 1)
        self.seq_lens[num_seqs:].fill_(1)
        self.slot_mapping.fill_(self.scratch_slot)
        self.slot_mapping.index_copy_(0, rows, index.slot_mapping.to(rows.device))
        if self.query_len > 1:   # NOTE: only verify views carry trees (begin_forward reads `hidden` there only)
            self.hidden.zero_()
            if index.hidden is not None:
                self.hidden.index_copy_(0, rows, index.hidden.to(rows.device))
        return rows

    def begin_forward(self) -> None:
        """Per-forward indices every layer shares (inside the captured region: they follow the buffers)."""
        bs = self.cache.block_size
        self._key_index = (self.block_tables[:, :, None] * bs + self._block_offsets).view(-1)      # (P * S,)
        visible = self.seq_lens[:, None] + self._query_offsets                                     # (P, Q)
        self._mask = (self._key_positions < visible[:, :, None])[:, None]                          # (P, 1, Q, S)
        if self.query_len > 1:   # NOTE: a verify view: a tree's hidden bits, by how far a key is behind its query
            behind = visible[:, :, None] - 1 - self._key_positions                                 # (P, Q, S)
            bits = self.hidden.view(self.num_rows, self.query_len)[:, :, None] >> behind.clamp(0, 62)
            hidden = (behind > 0) & (behind < 63) & (bits & 1).bool()                              # (P, Q, S)
            self._mask = self._mask & ~hidden[:, None]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, P*Q, Hq, D), k/v (1, P*Q, Hkv, D) -> (1, P*Q, Hq, D)."""
        cache = self.cache
        num_rows, num_heads, head_dim = self.num_rows, q.shape[2], q.shape[3]
        with profile_range("attention"):
            cache.store(layer_idx, self.slot_mapping, k[0], v[0])
            flat_shape = (cache.num_kv_heads, -1, head_dim)
            keys = cache.k[layer_idx].view(flat_shape).index_select(1, self._key_index)          # (Hkv, P*S, D)
            values = cache.v[layer_idx].view(flat_shape).index_select(1, self._key_index)
            keys = keys.view(-1, num_rows, self.num_keys, head_dim).transpose(0, 1)               # (P, Hkv, S, D)
            values = values.view(-1, num_rows, self.num_keys, head_dim).transpose(0, 1)
            queries = q[0].view(num_rows, self.query_len, num_heads, head_dim).transpose(1, 2)    # (P, Hq, Q, D)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self._mask,
                                                 enable_gqa=num_heads != keys.shape[1])           # (P, Hq, Q, D)
        return out.transpose(1, 2).reshape(1, num_rows * self.query_len, num_heads, head_dim)
