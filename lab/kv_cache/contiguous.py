"""ContiguousKVCache: one preallocated (B, Hkv, max_len, D) key and value tensor per layer.

Owns: KV storage for B rows that advance together (batch 1 for `ar`, left-padded rows for static
batching). Ignores: which request a row belongs to.
"""

from __future__ import annotations

import math

import torch

from lab.kv_cache.base import sdpa
from lab.models import native_gemv


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
        # NOTE: batch-1 decode (one row, one token, no padding) can take the native kernel: the KV write and
        # the attention in one call instead of ~10 small ops and SDPA (docs/profiling.md).
        self._native_decode = (batch_size == 1 and head_dim % 8 == 0 and dtype == torch.float32
                               and torch.device(device).type == "cpu")
        self._scale = 1 / math.sqrt(head_dim)
        # NOTE: the batch row's (Hkv, L, D) views, made once: what the native decode kernels take.
        self._k_rows = [k[0] for k in self.k] if self._native_decode else []
        self._v_rows = [v[0] for v in self.v] if self._native_decode else []

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

    def native_decode_rows(self) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Per layer (Hkv, L, D) keys and values for a native one-token decode at `start`, when this forward is
        one (batch 1, one token, no padding, fp32 on CPU); else None."""
        if self.num_tokens == 1 and self._native_decode and self.key_padding is None:
            return self._k_rows, self._v_rows
        return None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        end = self.start + self.num_tokens
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        if self.num_tokens == 1 and self._native_decode and self.key_padding is None and native_gemv.usable(q):
            return native_gemv.decode_attention(q, k, v, self._k_rows[layer_idx], self._v_rows[layer_idx], self.start,
                                                self._scale)
        # NOTE: narrow + copy_ rather than slice assignment: Python indexing costs more than the copy at T = 1.
        k_cache.narrow(2, self.start, self.num_tokens).copy_(k.transpose(1, 2))
        v_cache.narrow(2, self.start, self.num_tokens).copy_(v.transpose(1, 2))
        out = sdpa(q.transpose(1, 2), k_cache.narrow(2, 0, end), v_cache.narrow(2, 0, end), self._mask,
                   is_causal=self.start == 0)
        return out.transpose(1, 2)  # (B, T, Hq, D)
