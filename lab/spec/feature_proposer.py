"""FeatureProposer: what the EAGLE and DFlash proposers share. A trained drafter (from its checkpoint, or
random-init for tests) that reads the target's features, which the engine hands over after every target
forward (`observe`), and the target's frozen embedding, final norm and LM head.

Owns: building the drafter for a target, the FeatureStore, turning drafter hidden states into tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lab.drafters.checkpoint import load_drafter
from lab.errors import LabError
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
        return fresh.to(device=target.device, dtype=target.dtype).eval()
    return load_drafter(resolve_checkpoint(checkpoint), kind, target.model, target.source.hf_config,
                        target.dtype, target.device)


class FeatureProposer:
    def __init__(self, target: ModelRunner, drafter: nn.Module) -> None:
        self.target = target.model
        self.drafter = drafter
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
        return self.target.compute_logits(self.target.norm(hidden)).float()

    def free(self, request_id: str) -> None:
        self.store.free(request_id)

    def reset_history(self) -> None:
        pass   # NOTE: features are per request

    def stats(self) -> dict[str, float]:
        return {"spec/draft_forwards": self.num_forwards, "spec/draft_unready_requests": self.num_unready}
