"""The attention-cache interface the decoder calls, and NoCache (recompute everything every step).

Owns: the contract between model attention and KV storage. Ignores: requests and scheduling.
The runner prepares a cache for one forward (positions, masks); every layer then calls `attend`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionCache(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this forward's k, v for `layer_idx` and attend q over every visible key.

        q (B, T, Hq, D), k/v (B, T, Hkv, D) -> out (B, T, Hq, D).
        """
        ...


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         is_causal: bool) -> torch.Tensor:
    """Scaled dot-product attention with GQA. q (B, Hq, T, D), k/v (B, Hkv, S, D) -> (B, Hq, T, D)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if q.shape[2] == 1 and mask is None and num_heads != num_kv_heads:
        # NOTE: one query per sequence: fold the query heads of a group into the query-length axis, so
        # each KV head is read once instead of being repeated per query head.
        batch, _, _, head_dim = q.shape
        group = num_heads // num_kv_heads
        folded = q.view(batch, num_kv_heads, group, head_dim)                   # (B, Hkv, G, D)
        out = F.scaled_dot_product_attention(folded, k, v)                      # (B, Hkv, G, D)
        return out.reshape(batch, num_heads, 1, head_dim)   # NOTE: CUDA's SDPA may lay heads out last
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                          enable_gqa=num_heads != num_kv_heads)


class NoCache:
    """No KV storage: every forward sees only its own tokens, causally (the `ar_nocache` engine)."""

    def __init__(self, attn_mask: torch.Tensor | None = None) -> None:
        self.attn_mask = attn_mask  # optional (B, 1, T, T) bool, True = may attend (padding)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.attn_mask, is_causal=True)
        return out.transpose(1, 2)  # (B, T, Hq, D)
