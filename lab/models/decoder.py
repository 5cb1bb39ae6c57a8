"""Our Llama/Qwen-family decoder: embedding, RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied or untied head,
Qwen2's q/k/v biases and Qwen3's q/k norm. Loads an HF state dict.

Owns: the math of one forward. Ignores: where keys and values live (the AttentionCache passed in) and
which requests the rows belong to. q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lab import huge_pages
from lab.errors import LabError
from lab.kv_cache.base import AttentionCache
from lab.kv_cache.block_kv import BlockKVCache
from lab.kv_cache.contiguous import ContiguousKVCache
from lab.models import native_gemv, native_head
from lab.models.config import DecoderConfig
from lab.models.packed_linear import (BLOCK_MAX_ROWS, GEMV_MAX_ROWS, NATIVE_MAX_ROWS, PackedLinear,
                                     move_streamed_weights_to_huge_pages, use_block_weights)
from lab.models.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # NOTE: in fp32 HF's casts are no-ops, so the weight can go into the one fused call. On CPU the
            # native kernel does it in one pass, ~1.5 us a row against ~14 for F.rms_norm's composite ops.
            if native_gemv.usable(x, self.weight):
                return native_gemv.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # NOTE: normalise in fp32 and scale after casting back, exactly as HF's Llama/Qwen RMSNorm.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.use_qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        batch, num_tokens, _ = x.shape
        qkv = self.qkv_proj(x)                                                     # (B, T, (Hq + 2 Hkv) D)
        num_qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[..., :self.q_size + self.kv_size].view(batch, num_tokens, num_qk_heads, self.head_dim)
        v = qkv[..., self.q_size + self.kv_size:].view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)               # (B, T, Hq + Hkv, D)
        # NOTE: q and k heads are rotated together: one RoPE call instead of two, which matters at T = 1.
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=2)
        out = cache.attend(self.layer_idx, q, k, v)                                # (B, T, Hq, D)
        return self.o_proj(out.reshape(batch, num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if native_gemv.usable(gate_up):
            return self.down_proj(native_gemv.silu_mul(gate_up))  # NOTE: one pass instead of split, silu, mul
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache)
        norm = self.post_attention_layernorm
        if norm.weight.dtype == torch.float32 and native_gemv.usable(x, attn, norm.weight):
            x, normed = native_gemv.add_rms_norm(x, attn, norm.weight, norm.eps)  # NOTE: one call, not two
            return x + self.mlp(normed)
        x = x + attn
        return x + self.mlp(norm(x))


class DecoderModel(nn.Module):
    """forward(input_ids (B, T), positions (B, T), cache) -> hidden (B, T, H); compute_logits -> (..., V)."""

    def __init__(self, config: DecoderConfig, hf_config: Any | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, hf_config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._fused_layers: list[list[torch.Tensor]] | None = None   # built on first use (forward)
        self._fused_block_layers: list[list[torch.Tensor]] | None = None   # the same with GGUF blocks, if any
        # NOTE: False for a tensor-parallel shard: the one-call native paths have no all-reduce between the layers
        self.allow_fused_layers = True
        self.block_max_rows = BLOCK_MAX_ROWS   # steps of up to this many tokens stream GGUF blocks (use_block_weights)
        self.block_tiles = False               # whether they stream them as AMX tiles (use_block_weights)
        self.head_screen: native_head.HeadScreen | None = None   # the head's greedy screen (use_head_screen)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)       # (B, T, H)
        cos, sin = self.rotary(positions)      # (B, T, 1, D)
        return self.norm(self._run_layers(x, cos, sin, cache, ())[0])

    def _run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache,
                    feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x (B, T, H) through every layer -> (the residual stream after the last, {i: the stream after layer i}
        for i in feature_layers).
        NOTE: a batch-1 decode on the contiguous cache, and a step of a few tokens per request on the paged
        cache (decodes, verify steps: up to fused_max_rows tokens in all), run all layers in one native call:
        the same kernels in the same order as the loop below (bit-identical), without the Python between them
        (~20 % of a batch-1 step on the contiguous cache, docs/benchmarks.md; ~19 % on the paged one,
        docs/speculative.md, session 19)."""
        rows = x.shape[0] * x.shape[1]
        layers = self._native_decode_layers(rows) if native_gemv.usable(x, self.embed_tokens.weight) else None
        c = self.config
        if layers is not None and not feature_layers and isinstance(cache, ContiguousKVCache):
            rows = cache.native_decode_rows()
            if rows is not None:
                x = native_gemv.decode_layers(x, layers, rows[0], rows[1], cos, sin, cache.start, c.num_heads,
                                              c.num_kv_heads, self.norm.eps, c.head_dim ** -0.5)
                return x, {}
        if (layers is not None and isinstance(cache, BlockKVCache) and x.shape[0] == 1
                and x.shape[1] <= self.fused_max_rows):
            step = cache.native_step()
            if step is not None:
                capture = sorted(set(feature_layers))
                out = native_gemv.paged_step_layers(x, layers, cache.k, cache.v, cos, sin, *step, c.num_heads,
                                                    c.num_kv_heads, self.norm.eps, c.head_dim ** -0.5, capture)
                return out[0], dict(zip(capture, out[1:]))
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache)
            if i in feature_layers:
                captured[i] = x
        return x, captured

    @property
    def fused_max_rows(self) -> int:
        """The most tokens a paged step may have to run in one native call: NATIVE_MAX_ROWS, or up to GEMV_MAX_ROWS
        where the projections stream AMX tiles there (64 rows of projections cost ~6 one-row calls on tiles, ~15 on
        the AVX blocks: docs/benchmarks.md, "AMX tiles")."""
        return max(NATIVE_MAX_ROWS, self.block_max_rows) if self.block_tiles else NATIVE_MAX_ROWS

    def _native_decode_layers(self, rows: int = 1) -> list[list[torch.Tensor]] | None:
        """Per layer the 7 tensors native_gemv.decode_layers reads for a step of `rows` tokens, or None where the
        fused path cannot run (q/k norms, non-fp32 weights, a weight not row-major, a tensor-parallel shard). Up to
        block_max_rows rows a projection that streams GGUF blocks gives its blocks, taken when the list is built:
        call use_block_weights again after changing a weight in place."""
        if not self.allow_fused_layers:
            return None
        if self._fused_layers is None:
            layers: list[list[torch.Tensor]] = []
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                bias = attn.qkv_proj.bias if attn.qkv_proj.bias is not None else torch.empty(0)
                layers.append([layer.input_layernorm.weight, attn.qkv_proj.weight, bias, attn.o_proj.weight,
                               layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                               mlp.down_proj.weight])
            fits = not self.config.use_qk_norm and all(
                t.dtype == torch.float32 and t.is_cpu and (t.dim() < 2 or t.stride(-1) == 1)
                for tensors in layers for t in tensors)
            self._fused_layers = layers if fits else []
            self._fused_block_layers = self._with_blocks(layers) if fits else None
        if not self._fused_layers:
            return None
        if rows <= self.block_max_rows and self._fused_block_layers is not None:
            return self._fused_block_layers
        return self._fused_layers

    def _with_blocks(self, layers: list[list[torch.Tensor]]) -> list[list[torch.Tensor]] | None:
        """`layers` with each projection's GGUF blocks in place of its weight where it has them; None if none has."""
        swapped, any_blocks = [list(tensors) for tensors in layers], False
        for tensors, layer in zip(swapped, self.layers):
            for slot, linear in ((1, layer.self_attn.qkv_proj), (3, layer.self_attn.o_proj),
                                 (5, layer.mlp.gate_up_proj), (6, layer.mlp.down_proj)):
                blocks = linear.fresh_blocks() if isinstance(linear, PackedLinear) else None
                if blocks is not None:
                    tensors[slot], any_blocks = blocks, True
        return swapped if any_blocks else None

    def forward_with_features(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                              feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, plus the residual stream after each of `feature_layers` (pre-norm), concatenated:
        (hidden (B, T, H), features (B, T, len(feature_layers) * H)). EAGLE and DFlash drafters read these."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        x, captured = self._run_layers(x, cos, sin, cache, feature_layers)
        return self.norm(x), torch.cat([captured[i] for i in feature_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)            # (..., V)

    def use_head_screen(self, on_huge_pages: bool = False) -> bool:
        """Screen greedy rows' argmax over the head's Q8_0 blocks (lab/models/native_head.py: the ids `gemv` over the
        blocks gives, without the logits) where the head streams such blocks (use_block_weights, not as tiles) and
        the CPU has AVX-512 VNNI; the screen on 2 MiB pages with `on_huge_pages`. Call after use_block_weights and
        use_huge_pages. Returns whether it does."""
        blocks = self.lm_head.fresh_blocks() if isinstance(self.lm_head, PackedLinear) else None
        self.head_screen = None
        if native_head.can_screen(blocks) and native_head.supported():
            self.head_screen = native_head.HeadScreen(blocks)
            if on_huge_pages:
                self.head_screen.screen, self.head_screen.scales = huge_pages.move(
                    [self.head_screen.screen, self.head_screen.scales])
        return self.head_screen is not None

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden (..., H) -> (...) int64, the argmax of each row's logits by the head's greedy screen: the first
        largest of the logits the native GEMV computes over the head's blocks, which are compute_logits' own up to
        block_max_rows rows (more rows go to a GEMM, whose sums round differently). None where the screen does not
        take the call (none built, its blocks stale, more than 64 rows, not fp32 on CPU): then compute the logits."""
        screen = self.head_screen
        rows = hidden.numel() // max(hidden.shape[-1], 1)
        if (screen is None or not 1 <= rows <= GEMV_MAX_ROWS or not native_gemv.usable(hidden)
                or not isinstance(self.lm_head, PackedLinear) or screen.blocks is not self.lm_head.fresh_blocks()):
            return None
        return screen.argmax(hidden)

    def use_column_major_weights(self) -> None:
        """Store every projection's (out, in) weight column-major, i.e. as a transposed (in, out) matrix.

        NOTE: at batch 1 each projection is a matrix-vector product that streams its weight from DRAM. On
        CPU, MKL's fp32 gemv reads an (in, out) row-major matrix (axpy form) markedly faster than an
        (out, in) one (dot-product form); see docs/benchmarks.md. Only the memory layout changes: shapes,
        values, tying and the state dict's names stay the same, so results are bit-identical up to
        the BLAS summation order.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()  # (out, in), strides (1, out)
        self._fused_layers = None

    def use_block_weights(self, tiles: bool = False) -> tuple[int, int]:
        """Stream every projection whose fp32 weights are exactly GGUF block values as those blocks (few-row
        calls, the native kernel): bit-identical, a fifth of the bytes (lab/models/weight_blocks.py); with `tiles`
        in AMX tile order (lab/models/native_tiles.py), within fp32 rounding. Call after pack_linear_weights.
        Returns (linears streaming blocks, linears)."""
        self.block_tiles = tiles
        counts = use_block_weights(self, tiles)
        self.set_block_max_rows(self.block_max_rows)
        self._fused_layers = None
        return counts

    def use_huge_pages(self) -> int:
        """Move what the few-row calls stream (the GGUF blocks) onto 2 MiB pages, in layer order
        (packed_linear.move_streamed_weights_to_huge_pages): the same values, fewer TLB misses a step. Call after
        use_block_weights. Returns the bytes moved."""
        moved = move_streamed_weights_to_huge_pages(self)
        self._fused_layers = None               # NOTE: the fused path's lists still point at the old copies
        return moved

    def set_block_max_rows(self, rows: int) -> None:
        """Calls and steps of up to `rows` rows stream GGUF blocks (bit-identical either way on the AVX blocks: a
        speed choice)."""
        if not 1 <= rows <= GEMV_MAX_ROWS:
            raise ValueError(f"GGUF blocks serve 1 to {GEMV_MAX_ROWS} rows (the native GEMV's), not {rows}")
        self.block_max_rows = rows
        for module in self.modules():
            if isinstance(module, PackedLinear):
                module.block_max_rows = rows

    def block_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fp32 weight, its GGUF blocks) of every projection streaming blocks, in layer order."""
        linears = (m for m in self.modules() if isinstance(m, PackedLinear))
        return [(m.weight, blocks) for m in linears if (blocks := m.fresh_blocks()) is not None]

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF parameter names (model.layers.N.self_attn.q_proj.weight, ...) into the fused layout."""
        self.load_state_dict(fuse_hf_state_dict(state_dict, self.config), strict=True)


def fuse_hf_state_dict(state_dict: dict[str, torch.Tensor], config: DecoderConfig) -> dict[str, torch.Tensor]:
    sd = {k.removeprefix("model."): v for k, v in state_dict.items()}
    out: dict[str, torch.Tensor] = {"embed_tokens.weight": sd.pop("embed_tokens.weight"),
                                    "norm.weight": sd.pop("norm.weight")}
    head = sd.pop("lm_head.weight", None)
    out["lm_head.weight"] = out["embed_tokens.weight"] if config.tie_word_embeddings or head is None else head
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for kind in (["weight", "bias"] if config.attention_bias else ["weight"]):
            out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat(
                [sd.pop(p + f"self_attn.{n}_proj.{kind}") for n in ("q", "k", "v")], dim=0)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd.pop(p + "mlp.gate_proj.weight"), sd.pop(p + "mlp.up_proj.weight")], dim=0)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight"):
            out[p + name] = sd.pop(p + name)
        if config.use_qk_norm:
            out[p + "self_attn.q_norm.weight"] = sd.pop(p + "self_attn.q_norm.weight")
            out[p + "self_attn.k_norm.weight"] = sd.pop(p + "self_attn.k_norm.weight")
    leftover = [k for k in sd if "rotary_emb" not in k]
    if leftover:
        raise LabError(f"unexpected weights in checkpoint: {leftover[:5]}",
                       "use a Llama/Qwen2/Qwen3-family checkpoint without extra modules")
    return out
