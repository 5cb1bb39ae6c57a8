"""EarlyExitModel: the target's first `num_layers` decoder layers plus its final norm and LM head, sharing
the target's weights (no copy, no training): the `layerskip` self-draft.

Owns: the truncated forward. Ignores: caches (the draft gets its own, with `num_layers` layers).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from lab.errors import LabError
from lab.models.decoder import DecoderModel
from lab.runner import ModelRunner


class EarlyExitModel(nn.Module):
    def __init__(self, model: DecoderModel, num_layers: int) -> None:
        super().__init__()
        if not 1 <= num_layers <= model.config.num_layers:
            raise LabError(f"layerskip needs 1 <= num_layers <= {model.config.num_layers}, got {num_layers}",
                           f"set engine.proposer.num_layers between 1 and {model.config.num_layers}")
        self.config = replace(model.config, num_layers=num_layers)
        self.embed_tokens, self.norm, self.rotary, self.lm_head = (model.embed_tokens, model.norm, model.rotary,
                                                                   model.lm_head)
        self.layers = nn.ModuleList(list(model.layers)[:num_layers])
        self._fused_layers: list[list[torch.Tensor]] | None = None
        self._fused_block_layers: list[list[torch.Tensor]] | None = None
        self.allow_fused_layers = model.allow_fused_layers
        self.block_max_rows = model.block_max_rows
        self.block_tiles = model.block_tiles

    # NOTE: the target's forward over fewer layers, its one-call native paths included
    forward = DecoderModel.forward
    _run_layers = DecoderModel._run_layers
    _native_decode_layers = DecoderModel._native_decode_layers
    _with_blocks = DecoderModel._with_blocks
    fused_max_rows = DecoderModel.fused_max_rows
    compute_logits = DecoderModel.compute_logits


def early_exit_runner(target: ModelRunner, num_layers: int) -> ModelRunner:
    """A ModelRunner over the target's first layers: same device, dtype, tokenizer and weights."""
    runner = copy.copy(target)
    runner.model = EarlyExitModel(target.model, num_layers)
    runner.config = runner.model.config
    runner.model_id = f"{target.model_id}[:{num_layers} layers]"
    runner._hf_model = None
    return runner


def share_weights(draft: torch.nn.Module, target: torch.nn.Module) -> bool:
    """True when the draft holds no parameter of its own (every tensor is the target's)."""
    target_ids = {id(p) for p in target.parameters()}
    return all(id(p) in target_ids for p in draft.parameters())
