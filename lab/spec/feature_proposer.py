"""FeatureProposer: what the EAGLE and DFlash proposers share. A trained drafter (from its checkpoint, or
random-init for tests) that reads the target's features, which the engine hands over after every target
forward (`observe`), and the target's frozen embedding, final norm and LM head.

The head may be cut to a draft vocabulary (`draft_vocab_size`, as EAGLE-3's smaller draft vocabulary): only
the first N token ids get draft logits, the rest -inf. A byte-level BPE tokenizer numbers its tokens in
merge order, which follows their frequency, so the first ids are the common ones (SmolLM2: the first
8192 of 49152 cover 88 % of its MT-Bench answer tokens, 16384 cover 94.5 %; docs/speculative.md). The
drafter then never proposes a rarer token, a proposal the target would have to confirm anyway; the
verification and so the output are unchanged (q is 0 outside the draft vocabulary, which rejection
sampling handles like any other q).

Owns: building the drafter for a target, the FeatureStore, turning drafter hidden states into tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lab.drafters.checkpoint import load_drafter
from lab.errors import LabError
from lab.models.packed_linear import can_pack, pack_linear_weights
from lab.request import Request
from lab.runner import ModelRunner
from lab.spec.features import FeatureStore

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_checkpoint(path: str) -> Path:
    """Absolute, or relative to the working directory, else to the repository (committed checkpoints)."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return REPO_ROOT / candidate


def build_drafter(kind: str, target: ModelRunner, checkpoint: str | None, fresh: nn.Module | None) -> nn.Module:
    """The checkpoint's drafter on the target's device and dtype, or `fresh` (random init) when checkpoint is None."""
    if checkpoint is None:
        if fresh is None:
            raise LabError(f"proposer={kind} needs a checkpoint", "set engine.proposer.checkpoint")
        drafter = fresh.to(device=target.device, dtype=target.dtype).eval()
    else:
        drafter = load_drafter(resolve_checkpoint(checkpoint), kind, target.model, target.source.hf_config,
                               target.dtype, target.device)
    if can_pack(target.device, target.dtype):
        # NOTE: the target's own fast paths (few-row GEMV, panel GEMM): a drafter forward at batch 1 is a
        # handful of matrix-vector products, which MKL's F.linear streams markedly slower.
        pack_linear_weights(drafter)
    return drafter


def draft_head(target: ModelRunner, draft_vocab_size: int) -> nn.Linear | None:
    """The target's LM head over its first `draft_vocab_size` token ids, sharing the weight (a view of its
    first rows); None for the whole vocabulary (0, or >= the vocabulary)."""
    vocab = target.config.vocab_size
    if draft_vocab_size < 0:
        raise LabError(f"engine.proposer.draft_vocab_size must be >= 0 (0: the whole vocabulary), got "
                       f"{draft_vocab_size}", f"e.g. engine.proposer.draft_vocab_size=16384 (of {vocab})")
    if draft_vocab_size == 0 or draft_vocab_size >= vocab:
        return None
    full = target.model.lm_head
    head = nn.Linear(full.in_features, draft_vocab_size, bias=full.bias is not None,
                     device=target.device, dtype=target.dtype)
    head.weight = nn.Parameter(full.weight.detach()[:draft_vocab_size], requires_grad=False)
    if full.bias is not None:
        head.bias = nn.Parameter(full.bias.detach()[:draft_vocab_size], requires_grad=False)
    if can_pack(target.device, target.dtype):
        pack_linear_weights(head)       # NOTE: the target's own fast paths: few-row GEMV, panel GEMM
    return head.eval()


class FeatureProposer:
    def __init__(self, target: ModelRunner, drafter: nn.Module, draft_vocab_size: int = 0) -> None:
        self.target = target.model
        self.drafter = drafter
        self.vocab_size = target.config.vocab_size
        self.draft_head = draft_head(target, draft_vocab_size)
        self.device, self.dtype = target.device, target.dtype
        self.feature_layers = tuple(i % target.config.num_layers for i in drafter.feature_layers)
        self.store = FeatureStore(len(self.feature_layers) * target.config.hidden_size, target.dtype, target.device)
        self.num_forwards = 0
        self.num_unready = 0   # requests not drafted because some of their features were never computed

    def observe(self, layout: list[tuple[Request, int, int]], features: torch.Tensor) -> None:
        """features (N, F) of one target forward; layout: (request, first position, count) in row order."""
        offset = 0
        for request, start, num in layout:
            self.store.write(request.request_id, start, features[offset:offset + num])
            offset += num

    def ready(self, request: Request) -> bool:
        """Features of every token but the last (the bonus token the target has not run yet) are known."""
        ok = self.store.num_valid(request) >= request.num_tokens - 1
        self.num_unready += not ok
        return ok

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states (..., H) -> logits (..., V) through the target's frozen norm and head."""
        return self.head_logits(self.target.norm(hidden))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Post-norm states (..., H) -> fp32 logits (..., V): the target's head, or the draft vocabulary's
        logits with -inf past it."""
        if self.draft_head is None:
            return self.target.compute_logits(normed).float()
        head = self.draft_head(normed).float()                                               # (..., N)
        logits = head.new_full((*head.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., :head.shape[-1]] = head
        return logits

    def free(self, request_id: str) -> None:
        self.store.free(request_id)

    def reset_history(self) -> None:
        pass   # NOTE: features are per request

    def stats(self) -> dict[str, float]:
        return {"spec/draft_forwards": self.num_forwards, "spec/draft_unready_requests": self.num_unready}
