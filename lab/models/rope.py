"""Rotary position embeddings with the config's scaling (default, linear, llama3, yarn/longrope via HF's
init functions), served as a cos/sin table indexed by position.

Owns: inverse frequencies, the cos/sin table. Ignores: where positions come from.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lab.errors import LabError
from lab.models import native_gemv
from lab.models.config import DecoderConfig


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(config: DecoderConfig, hf_config: Any | None = None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq (D/2,), attention_scaling) for the config's rope type."""
    dim = config.head_dim
    base = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** base)  # (D/2,)
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type in ("yarn", "longrope") and hf_config is not None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        return inv.float(), float(attention_scaling)
    raise LabError(f"rope_type {rope_type!r} is not supported",
                   "use a model with default, linear, llama3, yarn or longrope RoPE scaling")


class RotaryEmbedding(torch.nn.Module):
    """cos/sin table (max_positions, 2, D), computed in fp32 as HF does, cast to the model dtype once.

    NOTE: the sin half of the table has its first D/2 entries negated, so that HF's rotate_half(x) * sin
    becomes roll(x, D/2) * signed_sin: one copy instead of two slices, a negation and a concatenation.
    """

    def __init__(self, config: DecoderConfig, hf_config: Any | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config, hf_config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]                     # (P, D/2)
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)                # (P, D)
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)        # (P, D)
        table = torch.stack((cos, signed_sin), dim=1) * self.attention_scaling
        self.register_buffer("cos_sin_table", table, persistent=False)    # (P, 2, D)

    def clamp_draft_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """For drafters only: a request near the end of the context still drafts k tokens, some past the last
        position the table holds; the engine trims those drafts to the request's room, so their positions only
        need to stay inside the table (vLLM's EAGLE proposer clamps them too). Targets never clamp: a target
        position past the table is a bug to surface."""
        return positions.clamp(max=self.cos_sin_table.shape[0] - 1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, signed_sin (B, T, 1, D), broadcast over heads."""
        cos_sin = self.cos_sin_table[positions]                            # (B, T, 2, D)
        return cos_sin[:, :, 0:1], cos_sin[:, :, 1:2]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D): rotate pairs (i, i + D/2), HF's non-interleaved convention; `signed_sin` as served by
    RotaryEmbedding (first half negated)."""
    if native_gemv.usable(x) and x.dim() == 4 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return native_gemv.rope(x, cos, signed_sin)  # NOTE: one pass instead of mul, roll (slices + cat), addcmul
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
