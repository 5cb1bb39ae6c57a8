"""Shard a loaded DecoderModel across the ranks of a process group, in place, without changing its code.

Per layer: the fused qkv_proj keeps this rank's query heads and their key/value heads (column-parallel),
o_proj the matching input columns (row-parallel, all-reduce); the fused gate_up_proj keeps this rank's
slice of gate and of up (column-parallel), down_proj the matching columns (row-parallel). The embedding
and the head are split by vocabulary. Each attention module's head counts become the local ones, and the
runner's config too, so KV caches are allocated for the local heads only.

Owns: which rows and columns each rank keeps. Ignores: scheduling and serving.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from lab.errors import LabError
from lab.models.config import DecoderConfig
from lab.models.decoder import Attention, DecoderModel, MLP
from lab.models.packed_linear import can_pack, pack_linear_weights
from lab.parallel.distributed import current
from lab.parallel.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, padded_rows, vocab_range
from lab.runner import ModelRunner


def check_divisible(c: DecoderConfig, world_size: int) -> None:
    for name, value in (("attention heads", c.num_heads), ("key/value heads", c.num_kv_heads),
                        ("intermediate size", c.intermediate_size)):
        if value % world_size:
            raise LabError(f"tensor_parallel={world_size} does not divide the model's {name} ({value})",
                           "pick a tensor_parallel size that divides the head counts and the MLP width")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                      dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


def _shard_attention(attn: Attention, rank: int, world_size: int, group: dist.ProcessGroup) -> None:
    d = attn.head_dim
    num_heads, num_kv_heads = attn.num_heads // world_size, attn.num_kv_heads // world_size
    q_rows = slice(rank * num_heads * d, (rank + 1) * num_heads * d)
    k_rows = slice(attn.q_size + rank * num_kv_heads * d, attn.q_size + (rank + 1) * num_kv_heads * d)
    v_rows = slice(k_rows.start + attn.kv_size, k_rows.stop + attn.kv_size)
    qkv = attn.qkv_proj

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[q_rows], t[k_rows], t[v_rows]])

    attn.qkv_proj = _linear(rows(qkv.weight.data), rows(qkv.bias.data) if qkv.bias is not None else None)
    attn.o_proj = RowParallelLinear(attn.o_proj.weight.data[:, q_rows].contiguous(), group)
    attn.num_heads, attn.num_kv_heads = num_heads, num_kv_heads
    attn.q_size, attn.kv_size = num_heads * d, num_kv_heads * d


def _shard_mlp(mlp: MLP, rank: int, world_size: int, group: dist.ProcessGroup) -> None:
    size = mlp.intermediate_size // world_size
    local = slice(rank * size, (rank + 1) * size)
    gate, up = mlp.gate_up_proj.weight.data.split(mlp.intermediate_size)
    mlp.gate_up_proj = _linear(torch.cat([gate[local], up[local]]), None)
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data[:, local].contiguous(), group)
    mlp.intermediate_size = size


def shard_model(model: DecoderModel, rank: int, world_size: int, group: dist.ProcessGroup) -> DecoderModel:
    """Cut `model` (every rank holding the full weights) down to rank `rank`'s shard, in place."""
    check_divisible(model.config, world_size)
    vocab_size = model.config.vocab_size
    start, end, per_rank = vocab_range(vocab_size, rank, world_size)
    # NOTE: read the head before replacing the embedding: with tied weights they are one tensor.
    head = padded_rows(model.lm_head.weight.data, start, end, per_rank)
    model.embed_tokens = VocabParallelEmbedding(padded_rows(model.embed_tokens.weight.data, start, end, per_rank),
                                                start, end, group)
    model.lm_head = VocabParallelHead(head, vocab_size, world_size, group)
    model.head_screen = None             # NOTE: the greedy screen reads the whole head; a shard holds a slice of it
    model.allow_fused_layers = False     # NOTE: decode_layers / paged_step_layers would skip the all-reduces
    for layer in model.layers:
        _shard_attention(layer.self_attn, rank, world_size, group)
        _shard_mlp(layer.mlp, rank, world_size, group)
    return model


def shard_runner(runner: ModelRunner, group: dist.ProcessGroup | None = None) -> ModelRunner:
    """Shard the runner's model over `group` (default: the initialised context's) and make its config
    describe the local heads, so every KV cache it allocates holds this rank's heads only."""
    ctx = current()
    group = group if group is not None else ctx.group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    shard_model(runner.model, rank, world_size, group)
    if can_pack(runner.device, runner.dtype):
        pack_linear_weights(runner.model)  # NOTE: the new column-parallel linears get the runner's fast path too
    if runner.block_linears:               # NOTE: and the blocks of their rows (lab/models/weight_blocks.py)
        runner.block_linears = runner.model.use_block_weights(tiles=runner.model.block_tiles)[0]
        if runner.use_huge_pages:
            runner.model.use_huge_pages()
    c = runner.config
    runner.config = dataclasses.replace(c, num_heads=c.num_heads // world_size,
                                        num_kv_heads=c.num_kv_heads // world_size)
    return runner
