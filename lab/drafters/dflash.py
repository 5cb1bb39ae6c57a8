"""DFlashDrafter: a block-diffusion drafter. The input block is the last accepted token followed by
B-1 mask embeddings; a few decoder layers, non-causal inside the block, predict all B-1 masked tokens
in one forward. Every layer also attends to the target's context: the hidden states of several target
layers, concatenated, projected and normalised ("KV injection": the context enters each layer only as
keys and values). The target's frozen embedding, final norm and LM head are passed in, never stored.
A drafter trained with `max_fill` also takes a block whose first offsets are known tokens (denoising steps: the
drafts kept so far); its masked rest is then drafted as a block anchored at the last known token.

Owns: the weights, the context K/V projection and the block forward (one code path for training, with
many blocks per sequence, and for drafting, one block per request). Ignores: which context is valid
(lab/spec/dflash.py) and training data (lab/training/).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from lab.models.config import DecoderConfig
from lab.models.decoder import MLP, RMSNorm
from lab.models.packed_linear import project_rows
from lab.models.rope import RotaryEmbedding, apply_rope


def spaced_layers(num_target_layers: int, count: int) -> list[int]:
    """`count` target layers from shallow to the last, evenly spaced (30 layers, 5 -> 1, 8, 15, 22, 29)."""
    if num_target_layers <= 2 or count == 1:
        return list(range(num_target_layers))[-count:]
    step = (num_target_layers - 2) / (count - 1)
    return sorted({1 + round(j * step) for j in range(count)})


@dataclass(slots=True)
class DFlashConfig:
    block_size: int = 16                   # B: the last accepted token + B - 1 drafted positions
    num_layers: int = 1
    feature_layers: list[int] = field(default_factory=list)   # target layers read; [] -> 5 evenly spaced
    intermediate_size: int | None = None   # MLP width; None: the target's
    # NOTE: also add the context stream of the block's last context position (the target's features of
    # the token before the block) to every block input: the direct path EAGLE's input fusion gives, which a
    # 1-layer drafter otherwise has to find through attention.
    fuse_last_context: bool = False
    # NOTE: with one shared mask embedding, the inputs at block positions 1..B-1 are identical vectors that
    # only RoPE tells apart, so a 1-layer drafter's MLP cannot know which offset it predicts: one per offset.
    mask_per_position: bool = False
    # NOTE: EAGLE's input fusion for every block position: a learnt projection of [the block's first token's
    # embedding, the context stream of the position before the block], the mask positions adding their mask.
    # Adding the raw embedding instead (RMS ~0.12 beside the context stream's ~1) all but hid the last token:
    # 10 % top-1 at offset 1 where EAGLE, which reads the same two inputs through its fc, gets 47 %.
    input_fusion: bool = False
    # NOTE: trained with its first 0..max_fill offsets given as tokens (`block_inputs`' fills), the rest masked: the
    # proposer may then redraft a block's later offsets knowing its earlier drafts (`denoise_steps`).
    max_fill: int = 0

    def resolved(self, num_target_layers: int) -> "DFlashConfig":
        layers = self.feature_layers or spaced_layers(num_target_layers, 5)
        return replace(self, feature_layers=[i % num_target_layers for i in layers])

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class DFlashLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def _split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv (S, T, (Hq + 2 Hkv) D) -> roped q (S, Hq, T, D), roped k and v (S, Hkv, T, D)."""
        s, t, _ = qkv.shape
        qk = qkv[..., :self.q_size + self.kv_size].view(s, t, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=2)
        v = qkv[..., self.q_size + self.kv_size:].view(s, t, self.num_kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """context (S, C, H), already projected and normalised -> this layer's k, v (S, Hkv, C, D)."""
        s, c, _ = context.shape
        kv = project_rows(self.qkv_proj, context, slice(self.q_size, None))          # (S, C, 2 Hkv D)
        k, v = kv.view(s, c, 2 * self.num_kv_heads, self.head_dim).split(self.num_kv_heads, dim=2)
        return apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, mask: torch.Tensor | None, rows: slice = slice(None)) -> torch.Tensor:
        """x (S, Q, H) block tokens; context k/v (S, Hkv, C, D); mask (S, 1, Q, C + Q), True = may attend (None: all)
        -> (S, R, H) for the block `rows` (R of the Q; every row's keys and values are still attended to)."""
        q, k, v = self._split(self.qkv_proj(self.input_layernorm(x)), cos, sin)
        k, v = torch.cat((context_k, k), dim=2), torch.cat((context_v, v), dim=2)   # (S, Hkv, C + Q, D)
        q, x = q[:, :, rows], x[:, rows]                                            # (S, Hq, R, D), (S, R, H)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, :, rows],
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        x = x + self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], self.q_size))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    kind = "dflash"

    def __init__(self, target_config: DecoderConfig, config: DFlashConfig, hf_config: object | None = None) -> None:
        super().__init__()
        if config.block_size < 2:
            raise ValueError(f"DFlash block_size must be >= 2, got {config.block_size}")
        self.config = config.resolved(target_config.num_layers)
        hidden = target_config.hidden_size
        layer_config = replace(target_config, num_layers=self.config.num_layers,
                               intermediate_size=config.intermediate_size or target_config.intermediate_size)
        self.fc = nn.Linear(len(self.config.feature_layers) * hidden, hidden, bias=False)
        self.context_norm = RMSNorm(hidden, target_config.rms_norm_eps)
        # NOTE: not zeros: RMSNorm of a zero vector has a ~1/sqrt(eps) gradient, which blows up the first steps.
        shape = (config.block_size - 1, hidden) if config.mask_per_position else (hidden,)
        self.mask_embedding = nn.Parameter(torch.randn(shape) * 0.02)                 # (B-1, H) or (H,)
        self.input_fc = nn.Linear(2 * hidden, hidden, bias=False) if config.input_fusion else None
        self.layers = nn.ModuleList(DFlashLayer(layer_config) for _ in range(self.config.num_layers))
        self.rotary = RotaryEmbedding(layer_config, hf_config)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def reads_last_context(self) -> bool:
        """Whether `block_inputs` reads the context stream of the position before each block."""
        return self.config.fuse_last_context or self.config.input_fusion

    def context_stream(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (..., L*H) -> the projected, normalised context stream (..., H)."""
        return self.context_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target features (S, C, L*H) at positions (S, C) -> per drafter layer (k, v), each (S, Hkv, C, D)."""
        return self.stream_kv(self.context_stream(features), positions)

    def stream_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The context stream (S, C, H) at positions (S, C) -> per drafter layer (k, v), each (S, Hkv, C, D)."""
        cos, sin = self.rotary(positions)
        return [layer.context_kv(context, cos, sin) for layer in self.layers]

    def block_inputs(self, first_embeds: torch.Tensor, last_stream: torch.Tensor | None = None,
                     block_size: int | None = None, fill_embeds: torch.Tensor | None = None,
                     filled: torch.Tensor | None = None) -> torch.Tensor:
        """first_embeds (S, M, H): each block's first (known) token; last_stream (S, M, H): the context stream
        (`context_stream`) of the position before each block (read when `reads_last_context`); block_size: B,
        the trained block (default) or the first B of its positions (drafting needs no more than it verifies);
        fill_embeds (S, M, F, H), F < B - 1: embeddings of known tokens at offsets 1..F, the first f of them taken
        per block (`filled` (S, M, F), a prefix of Trues; None: all F) -> inputs (S, M * B, H).
        Known tokens are built alike (input fusion of the embedding and the stream before the block); with f
        filled, the block's masked rest is drafted as a block anchored at offset f: offset j gets mask j - f."""
        s, m, h = first_embeds.shape
        block_size = self.block_size if block_size is None else block_size
        if not 2 <= block_size <= self.block_size:
            raise ValueError(f"a DFlash block holds 2..{self.block_size} positions, got {block_size}")
        mask = self.mask_embedding[:block_size - 1] if self.mask_embedding.dim() == 2 else self.mask_embedding
        mask = mask.to(first_embeds.dtype)                                                       # (B-1, H) or (H,)
        known = first_embeds[:, :, None]                                                         # (S, M, 1+F, H)
        if fill_embeds is not None:
            known = torch.cat((known, fill_embeds), dim=2)
        if self.input_fc is not None:
            known = self.input_fc(torch.cat((known, last_stream[:, :, None].expand_as(known)), dim=-1))
        elif self.config.fuse_last_context:
            known = known + last_stream[:, :, None]
        if fill_embeds is None:   # NOTE: f = 0 for every block: the masks ride on the first token
            masks, anchor = mask.expand(s, m, block_size - 1, h), known                          # (S, M, B-1, H)
        else:
            num_fills = fill_embeds.shape[2]
            fills = (torch.full((s, m), num_fills, device=known.device) if filled is None
                     else filled.sum(-1))                                                        # (S, M): f
            offsets = torch.arange(1, block_size, device=known.device)                           # (B-1,): j
            relative = offsets - fills[..., None]                                                # (S, M, B-1): j - f
            masks = mask[(relative - 1).clamp(min=0)] if mask.dim() == 2 else mask.expand(s, m, block_size - 1, h)
            anchor = known.gather(2, fills[..., None, None].expand(-1, -1, 1, h))                # the last known token
        if self.input_fc is not None:
            masks = masks + anchor
        elif self.config.fuse_last_context:
            masks = masks + last_stream[:, :, None]
        if fill_embeds is None:
            return torch.cat((known, masks), dim=2).reshape(s, m * block_size, h)
        given = known[:, :, 1:].gather(2, (offsets - 1).clamp(max=num_fills - 1)[None, None, :, None]
                                       .expand(s, m, -1, h))                                     # (S, M, B-1, H)
        rest = torch.where((relative <= 0)[..., None], given, masks)
        return torch.cat((known[:, :, :1], rest), dim=2).reshape(s, m * block_size, h)

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
                rows: slice = slice(None)) -> torch.Tensor:
        """block_embeds (S, Q, H), block_positions (S, Q), context_kv from `context_kv`, mask (S, 1, Q, C + Q)
        -> hidden (S, R, H) of the block `rows` (default all Q); the target's norm + LM head turn it into logits.
        NOTE: the last layer computes only those rows after its attention (a drafter that verifies 1 of 7 drafts
        pushes 1 row, not 8, through o_proj and the MLP); each row's result is unchanged."""
        cos, sin = self.rotary(self.rotary.clamp_draft_positions(block_positions))
        x = block_embeds
        last = len(self.layers) - 1
        for i, (layer, (k, v)) in enumerate(zip(self.layers, context_kv)):
            x = layer(x, cos, sin, k, v, mask, rows if i == last else slice(None))
        return x


def block_mask(context_lens: torch.Tensor, anchors: torch.Tensor, num_context: int, block_size: int) -> torch.Tensor:
    """Attention mask for blocks at `anchors` (S, M): block m's queries see context positions < anchors[s, m]
    (and < context_lens[s]) and every position of their own block. -> (S, 1, M * B, C + M * B) bool."""
    s, m = anchors.shape
    context_pos = torch.arange(num_context, device=anchors.device)
    sees_context = (context_pos[None, None] < anchors[..., None]) & (context_pos[None, None] < context_lens[:, None, None])
    sees_context = sees_context.repeat_interleave(block_size, dim=1)             # (S, M*B, C)
    block_id = torch.arange(m, device=anchors.device).repeat_interleave(block_size)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(s, -1, -1)      # (S, M*B, M*B)
    return torch.cat((sees_context, sees_block), dim=2)[:, None]
