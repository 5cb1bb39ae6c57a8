"""FeatureStore: per request, the target's features (hidden states of the drafter's layers) by position.

The engine writes every target forward's features (`write`, at the positions it computed, drafts
included); only positions below the request's `num_computed_tokens` hold accepted tokens, so
`num_valid` caps there: rejected drafts' rows are simply overwritten later.
"""

from __future__ import annotations

import torch

from lab.request import Request


class FeatureStore:
    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dim, self.dtype, self.device = dim, dtype, device
        self._rows: dict[str, torch.Tensor] = {}    # request_id -> (capacity, F)
        self._filled: dict[str, int] = {}           # leading positions written without a gap

    def write(self, request_id: str, start: int, features: torch.Tensor) -> None:
        """features (num, F) of positions start..start+num-1."""
        end = start + features.shape[0]
        rows = self._rows.get(request_id)
        if rows is None or rows.shape[0] < end:
            grown = torch.empty(max(end, 2 * (0 if rows is None else rows.shape[0]), 64), self.dim,
                                dtype=self.dtype, device=self.device)
            if rows is not None:
                grown[:rows.shape[0]] = rows
            rows = self._rows[request_id] = grown
        rows[start:end] = features
        filled = self._filled.get(request_id, 0)
        if start <= filled:
            self._filled[request_id] = end
        # NOTE: a write past a gap (never expected) leaves `filled` where it was: those rows stay unused.

    def num_valid(self, request: Request) -> int:
        return min(self._filled.get(request.request_id, 0), request.num_computed_tokens)

    def read(self, request_id: str, start: int, end: int) -> torch.Tensor:
        return self._rows[request_id][start:end]                                    # (end - start, F)

    def move(self, request_id: str, src: list[int], dst: list[int]) -> None:
        """Features of positions `src` now belong to positions `dst` (a tree's accepted path, lab/spec/tree.py)."""
        rows = self._rows[request_id]
        rows[dst] = rows[src]

    def free(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._filled.pop(request_id, None)
