"""BlockKVCache: preallocated KV storage in blocks, shared by the slot (2D) and paged (2E) engines.

Owns: per layer keys and values of shape (Hkv, num_blocks, block_size, D), writing a step's new keys
and values through `slot_mapping`, and handing attention to a backend (block_attention.py). Ignores:
which request a block belongs to (the step's SeqSlices carry each request's block table).

A step is a flat batch of N tokens from R requests, (1, N) for the model: every request contributes
`num_query_tokens` consecutive tokens (1 for a decode, a chunk for a prefill) at positions
`num_context_tokens ...`. `begin_step` builds every index tensor once; each layer then only writes and
attends. A slot manager is the case of one `max_len`-token block per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.kv_cache.block_attention import make_backend
from lab.kv_cache.tree_mask import NO_HIDDEN, tree_layout
from lab.models import native_gemv
from lab.profiling.ranges import profile_range


@dataclass(slots=True)
class SeqSlice:
    """One request's share of a step's flat batch.

    `tree`: the step's tokens are a tree of drafts (lab/spec/tree.py), not a chain: the parent (query index) of
    query tokens 1..T-1; query 0 is the root (-1: another root, as a drafter's first-position candidates are). Token
    j is still stored at `num_context_tokens + j`, but its position is the context plus its depth, and it sees the
    context, its ancestors and itself only."""

    block_table: list[int]
    num_context_tokens: int   # tokens whose KV is already stored (num_computed_tokens)
    num_query_tokens: int     # tokens fed this step (num_scheduled_tokens)
    tree: tuple[int, ...] | None = None


@dataclass(slots=True)
class StepIndex:
    """Per-token and per-request index tensors of one step (built once, used by every layer)."""

    seqs: list[SeqSlice]
    q_start: list[int]                 # offset of each request's first token in the flat batch
    block_tables: torch.Tensor         # (R, max_blocks) long, padded with block 0
    context_lens: torch.Tensor         # (R,) num_context_tokens
    query_lens: torch.Tensor           # (R,) num_query_tokens
    positions: torch.Tensor            # (N,) position of each token in its request
    slot_mapping: torch.Tensor         # (N,) flat storage index of each new token
    hidden: torch.Tensor | None = None  # (N,) int64 per token: bit b set = it does not see the key b slots before
    #                                     its own (a tree's siblings); None: every token sees all keys before it


class BlockKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, backend: str = "fast", scratch_block: bool = False) -> None:
        # NOTE: with `scratch_block`, one block past the pool's `num_blocks` that no request ever owns: the
        # padding rows of a fixed-shape decode step (a CUDA graph's) write their keys there.
        shape = (num_kv_heads, num_blocks + int(scratch_block), block_size, head_dim)
        # NOTE: zeros, not empty: padded keys are masked, but a NaN bit pattern in them would still
        # poison SDPA's sums.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = device
        self.scratch_block: int | None = num_blocks if scratch_block else None
        self.backend = make_backend(backend)
        self.index: StepIndex | None = None
        self._meta: object = None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin_step(self, seqs: list[SeqSlice], prepare_backend: bool = True) -> None:
        """Build this step's indices; the model's forward follows with the same token order. Without
        `prepare_backend` the step runs elsewhere (a fixed-shape decode view) and only the index is built."""
        self.index = build_step_index(seqs, self.block_size, self.device)
        self._meta = self.backend.prepare(self, self.index) if prepare_backend else None

    def store(self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write N new tokens' k/v (N, Hkv, D) at their flat storage slots (N,)."""
        flat_shape = (self.num_kv_heads, -1, self.head_dim)
        self.k[layer_idx].view(flat_shape).index_copy_(1, slot_mapping, k.transpose(0, 1))
        self.v[layer_idx].view(flat_shape).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def native_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(slot_mapping (N,), tables (N, nb), lens (N,), hidden (N,) or empty) when the native backend attends
        every token of this step as one kernel row (a decode or verify step, fp32 on CPU), so the model may run all
        its layers in one native call (native_gemv.paged_step_layers) instead of `attend` per layer; else None."""
        kernel_rows = getattr(self.backend, "kernel_rows", None)
        rows = kernel_rows(self._meta) if kernel_rows is not None and self.index is not None else None
        if rows is None or rows[1].numel() != self.index.slot_mapping.numel():
            return None
        hidden = self.index.hidden if self.index.hidden is not None else NO_HIDDEN
        return self.index.slot_mapping, rows[0], rows[1], hidden

    def move_tokens(self, block_table: list[int], src_positions: list[int], dst_positions: list[int]) -> None:
        """Copy one request's keys and values at `src_positions` to `dst_positions`, in every layer (a tree's
        accepted path, moved to where a chain's would be)."""
        bs = self.block_size
        src, dst = (torch.tensor([block_table[p // bs] * bs + p % bs for p in positions], dtype=torch.long,
                                 device=self.device) for positions in (src_positions, dst_positions))
        if native_gemv.usable(self.k[0]):   # NOTE: one call for every layer's K and V, not two ops a store
            native_gemv.copy_slots(self.k + self.v, src, dst)
            return
        flat_shape = (self.num_kv_heads, -1, self.head_dim)
        for store in self.k + self.v:
            flat = store.view(flat_shape)
            flat.index_copy_(1, dst, flat.index_select(1, src))

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, N, Hq, D), k/v (1, N, Hkv, D) -> (1, N, Hq, D)."""
        # NOTE: every token's KV is written before any attention, so a request that hit a prefix block
        # published this step reads it in the same forward that computes it.
        with profile_range("attention"):
            self.store(layer_idx, self.index.slot_mapping, k[0], v[0])
            out = self.backend.attend(self, self._meta, layer_idx, q[0], k[0], v[0])   # (N, Hq, D)
        return out.unsqueeze(0)


# NOTE: up to this many tokens a step's positions and slots are computed in plain Python, above it with
# tensor ops: a decode or verify step has a few tokens per request, where each small tensor op (~5-10 us)
# costs more than the loop; a prefill chunk of thousands of tokens is the other way round.
PYTHON_INDEX_MAX_TOKENS = 256


def build_step_index(seqs: list[SeqSlice], block_size: int, device: torch.device) -> StepIndex:
    q_start, total = [], 0
    for seq in seqs:
        q_start.append(total)
        total += seq.num_query_tokens
    max_blocks = max((len(s.block_table) for s in seqs), default=1) or 1
    tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                          dtype=torch.long).view(len(seqs), max_blocks)                       # (R, max_blocks)
    context_lens = torch.tensor([s.num_context_tokens for s in seqs], dtype=torch.long)        # (R,)
    query_lens = torch.tensor([s.num_query_tokens for s in seqs], dtype=torch.long)            # (R,)
    if total <= PYTHON_INDEX_MAX_TOKENS:
        spans = [range(s.num_context_tokens, s.num_context_tokens + s.num_query_tokens) for s in seqs]
        positions = torch.tensor([p for span in spans for p in span], dtype=torch.long)       # (N,)
        slot_mapping = torch.tensor([s.block_table[p // block_size] * block_size + p % block_size
                                     for s, span in zip(seqs, spans) for p in span], dtype=torch.long)
    else:
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), query_lens)                 # (N,)
        starts = torch.tensor(q_start, dtype=torch.long)
        positions = torch.arange(total) - starts[seq_idx] + context_lens[seq_idx]              # (N,)
        slot_mapping = tables[seq_idx, positions // block_size] * block_size + positions % block_size
    hidden = None
    if any(s.tree is not None for s in seqs):
        # NOTE: slots stay the storage order above; a tree's tokens take their depth as position.
        positions, hidden = positions.clone(), torch.zeros(total, dtype=torch.long)
        for seq, start in zip(seqs, q_start):
            if seq.tree is not None:
                if len(seq.tree) != seq.num_query_tokens - 1:
                    raise ValueError(f"a tree of {len(seq.tree) + 1} tokens for {seq.num_query_tokens} query tokens")
                depth, bits = tree_layout(seq.tree)
                span = slice(start, start + seq.num_query_tokens)
                positions[span] = seq.num_context_tokens + torch.tensor(depth)
                hidden[span] = torch.tensor(bits)
        hidden = hidden.to(device)
    return StepIndex(seqs, q_start, tables.to(device), context_lens, query_lens, positions,
                     slot_mapping.to(device), hidden)
