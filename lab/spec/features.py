"""FeatureStore: the target's features (hidden states of the drafter's layers) in the target's KV blocks.

Paged like the KV cache and indexed by the same block tables: position p of a request lives in row
`block_table[p // block_size] * block_size + p % block_size` of a (num_blocks * block_size, F) tensor, next to
that position's keys and values. So a prompt block served from the prefix cache brings the features of its
tokens along (the forward that computed its KV wrote them), and feature-reading drafters (EAGLE, DFlash) can
leave prefix caching on, as vLLM keeps EAGLE's draft KV in the target's blocks.

Which rows are valid follows the KV: the engine writes every target forward's features (`write`, at the
positions it computed, drafts included), so every position below a request's `num_computed_tokens` holds an
accepted token's features (its own or a shared prefix block's); a rejected draft's row is overwritten when the
position is computed again, exactly as its KV is. Freeing a request frees nothing here: its blocks go back to
the pool, features and all.
"""

from __future__ import annotations

import torch

from lab.kv_cache.manager import KVCacheManager
from lab.request import Request


class FeatureStore:
    def __init__(self, kv: KVCacheManager, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kv, self.dim, self.dtype, self.device = kv, dim, dtype, device
        self.block_size = kv.block_size
        # NOTE: torch.empty: on CPU the OS maps pages on first write, so unused blocks cost no memory.
        self.rows = torch.empty(kv.num_blocks * kv.block_size, dim, dtype=dtype, device=device)  # (slots, F)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def _runs(self, request_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """Positions start..end-1 as runs of consecutive storage rows: (first row, count) per block touched."""
        table, bs = self.kv.block_table(request_id), self.block_size
        runs, position = [], start
        while position < end:
            offset = position % bs
            count = min(bs - offset, end - position)
            runs.append((table[position // bs] * bs + offset, count))
            position += count
        return runs

    def _slots(self, request_id: str, positions: list[int] | range) -> torch.Tensor:
        """The storage rows of a request's positions (N,): the KV's slot mapping for them."""
        table, bs = self.kv.block_table(request_id), self.block_size
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.long, device=self.device)

    def write_slots(self, slot_mapping: torch.Tensor, features: torch.Tensor) -> None:
        """features (N, F) into the rows slot_mapping (N,) names: a forward's rows where its KV went."""
        self.rows.index_copy_(0, slot_mapping, features)

    def write(self, request_id: str, start: int, features: torch.Tensor) -> None:
        """features (num, F) of positions start..start+num-1 (the request holds blocks for them)."""
        self.write_slots(self._slots(request_id, range(start, start + features.shape[0])), features)

    def num_valid(self, request: Request) -> int:
        """Leading positions whose features are known: those whose KV is (see the module's docstring)."""
        return request.num_computed_tokens

    def read(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Features (end - start, F) of positions start..end-1: a view within one block, else a copy."""
        runs = self._runs(request_id, start, end)
        if len(runs) == 1:
            row, count = runs[0]
            return self.rows[row:row + count]
        if not runs:
            return self.rows[:0]
        return torch.cat([self.rows[row:row + count] for row, count in runs])

    def move(self, request_id: str, src: list[int], dst: list[int]) -> None:
        """Features of positions `src` now belong to positions `dst` (a tree's accepted path, lab/spec/tree.py)."""
        self.rows[self._slots(request_id, dst)] = self.rows[self._slots(request_id, src)]
