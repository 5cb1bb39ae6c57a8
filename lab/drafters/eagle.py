"""EagleDrafter: EAGLE's draft head. One decoder layer that reads, at position i, the target's feature at
i-1 (its last hidden state after the final norm, as EAGLE uses) with the embedding of token i, and predicts
the target's feature at i; the target's frozen LM head turns it into token i+1. Drafting a chain feeds
each predicted feature back in place of the target's.

Owns: the head's weights and forward. Ignores: KV bookkeeping (lab/spec/eagle.py) and training
(lab/training/). The target's embedding, norm and head are passed in, never stored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from lab.kv_cache.base import AttentionCache
from lab.models.config import DecoderConfig
from lab.models.decoder import DecoderLayer
from lab.models.rope import RotaryEmbedding


@dataclass(slots=True)
class EagleConfig:
    feature_layer: int = -1           # which target layer's output is the feature (-1: the last)
    intermediate_size: int | None = None   # the layer's MLP width; None: the target's

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class EagleDrafter(nn.Module):
    kind = "eagle"

    def __init__(self, target_config: DecoderConfig, config: EagleConfig, hf_config: object | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = target_config.hidden_size
        layer_config = replace(target_config, num_layers=1,
                               intermediate_size=config.intermediate_size or target_config.intermediate_size)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(layer_config, 0)
        self.rotary = RotaryEmbedding(layer_config, hf_config)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.config.feature_layer,)

    def forward(self, token_embeds: torch.Tensor, prev_features: torch.Tensor, positions: torch.Tensor,
                cache: AttentionCache) -> torch.Tensor:
        """token_embeds (B, T, H) of tokens i, prev_features (B, T, H) at i-1 -> predicted features at i (B, T, H)."""
        x = self.fc(torch.cat((token_embeds, prev_features), dim=-1))
        cos, sin = self.rotary(self.rotary.clamp_draft_positions(positions))
        return self.layer(x, cos, sin, cache)
