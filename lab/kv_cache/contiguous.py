"""ContiguousKVCache: one preallocated (B, Hkv, max_len, D) key and value tensor per layer.

Owns: KV storage for B rows that advance together (batch 1 for `ar`, left-padded rows for static
batching). Ignores: which request a row belongs to.
"""

from __future__ import annotations

import torch

from lab.kv_cache.base import sdpa


class ContiguousKVCache:
    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.start = 0                               # write offset of this forward
        self.num_tokens = 0                          # tokens this forward appends
        self.key_padding: torch.Tensor | None = None  # (B, max_len) bool, True = real token
        self._mask: torch.Tensor | None = None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self) -> None:
        self.start = self.num_tokens = 0
        self.key_padding = None

    def begin_forward(self, start: int, num_tokens: int, key_padding: torch.Tensor | None = None) -> None:
        """Prepare for a forward writing `num_tokens` at positions [start, start + num_tokens) of every row."""
        if start + num_tokens > self.max_len:
            raise ValueError(f"KV cache overflow: {start} + {num_tokens} tokens > max_len {self.max_len}")
        self.start, self.num_tokens = start, num_tokens
        if key_padding is not None:
            self.key_padding = key_padding
        self._mask = self._build_mask()

    def _build_mask(self) -> torch.Tensor | None:
        """None when plain causal attention is right; else (B, 1, T, S) bool, True = may attend."""
        end = self.start + self.num_tokens
        if self.key_padding is None and (self.start == 0 or self.num_tokens == 1):
            return None
        device = self.k[0].device
        query_pos = torch.arange(self.start, end, device=device)[:, None]          # (T, 1)
        key_pos = torch.arange(end, device=device)[None, :]                          # (1, S)
        mask = (key_pos <= query_pos)[None, None]                                    # (1, 1, T, S)
        if self.key_padding is not None:
            mask = mask & self.key_padding[:, None, None, :end]                      # (B, 1, T, S)
            # NOTE: a padding query sees itself, so its row is never fully masked (SDPA would give NaN).
            mask = mask | (key_pos == query_pos)[None, None]
        return mask

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.start + self.num_tokens
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        # NOTE: narrow + copy_ rather than slice assignment: Python indexing costs more than the copy at T = 1.
        k_cache.narrow(2, self.start, self.num_tokens).copy_(k.transpose(1, 2))
        v_cache.narrow(2, self.start, self.num_tokens).copy_(v.transpose(1, 2))
        out = sdpa(q.transpose(1, 2), k_cache.narrow(2, 0, end), v_cache.narrow(2, 0, end), self._mask,
                   is_causal=self.start == 0)
        return out.transpose(1, 2)  # (B, T, Hq, D)
