"""CascadeProposer (proposer=suffix_eagle, suffix_dflash, or any pair): a free proposer first, a model drafter where it
has nothing to say.

Suffix decoding drafts only where earlier text makes a continuation likely, and then several tokens
for free; elsewhere it drafts nothing and the step is a plain decode. The fallback (a trained drafter,
EAGLE by default) drafts exactly those requests, with its own, shorter budget (a model draft costs time
and is less sure). Each request's draft comes from one proposer, so the rejection sampler sees one q per
token as before: deterministic for the primary (suffix), the drafter's for the fallback; lossless either way.

The fallback is called only for some steps, so it must catch up on the tokens accepted meanwhile; EAGLE
and DFlash do (they keep the draft KV of every position fed real target features and run the rest).

Owns: routing requests between the two and merging their stats. Ignores: how either drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lab.errors import LabError
from lab.kv_cache.manager import KVCacheManager
from lab.request import Request
from lab.spec.proposer import Draft, Proposer, check_num_spec_tokens


class CascadeProposer:
    def __init__(self, primary: Proposer, fallback: Proposer, fallback_num_spec_tokens: int) -> None:
        if primary.feature_layers:
            raise LabError("the cascade's primary proposer must not read target features",
                           "put the feature drafter (eagle, dflash) in engine.proposer.fallback")
        check_num_spec_tokens(fallback, fallback_num_spec_tokens, "engine.proposer.fallback_num_spec_tokens",
                              "the fallback", lowest=0)
        self.primary, self.fallback = primary, fallback
        self.fallback_num_spec_tokens = fallback_num_spec_tokens
        self.feature_layers = fallback.feature_layers
        self.num_primary_drafts = self.num_fallback_drafts = 0

    def observe(self, slot_mapping: torch.Tensor, features: torch.Tensor) -> None:
        self.fallback.observe(slot_mapping, features)

    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        drafts = {rid: d for rid, d in self.primary.propose(requests, num_spec_tokens, generators).items()
                  if d.token_ids}
        rest = [(r, g) for r, g in zip(requests, generators) if r.request_id not in drafts]
        budget = min(num_spec_tokens, self.fallback_num_spec_tokens)
        fallback = (self.fallback.propose([r for r, _ in rest], budget, [g for _, g in rest])
                    if rest and budget > 0 else {})
        self.num_primary_drafts += len(drafts)
        self.num_fallback_drafts += sum(1 for d in fallback.values() if d.token_ids)
        return {**drafts, **fallback}

    def max_drafts(self, num_spec_tokens: int) -> int:
        """The primary's chain, or the fallback's draft (a tree, if it drafts trees) within its budget."""
        budget = min(num_spec_tokens, self.fallback_num_spec_tokens)
        fallback = getattr(self.fallback, "max_drafts", None)
        return max(num_spec_tokens, fallback(budget) if fallback is not None else budget)

    def move_positions(self, request_id: str, src: list[int], dst: list[int]) -> None:
        self.fallback.move_positions(request_id, src, dst)   # NOTE: only the fallback drafts trees

    def free(self, request_id: str) -> None:
        self.primary.free(request_id)
        self.fallback.free(request_id)

    def reset_history(self) -> None:
        self.primary.reset_history()
        self.fallback.reset_history()

    def stats(self) -> dict[str, float]:
        return {**self.primary.stats(), **self.fallback.stats(),
                "spec/primary_drafts": self.num_primary_drafts, "spec/fallback_drafts": self.num_fallback_drafts}


@dataclass(slots=True)
class CascadeProposerConfig:
    """conf/engine/proposer/suffix_eagle.yaml, suffix_dflash.yaml: `primary` and `fallback` are proposer configs."""

    primary: Any = None
    fallback: Any = None
    fallback_num_spec_tokens: int = 2

    def kv_bytes_per_token(self, target: Any) -> int:
        """What both proposers keep per target KV slot."""
        return sum(part(target) for part in (getattr(self.primary, "kv_bytes_per_token", None),
                                             getattr(self.fallback, "kv_bytes_per_token", None)) if part is not None)

    def build(self, target: Any, kv: KVCacheManager) -> CascadeProposer:
        if self.primary is None or self.fallback is None:
            raise LabError("the cascade proposer needs engine.proposer.primary and engine.proposer.fallback",
                           "use engine/proposer=suffix_eagle, or set both to proposer configs")
        if self.fallback_num_spec_tokens < 0:
            raise LabError(f"engine.proposer.fallback_num_spec_tokens must be >= 0, got {self.fallback_num_spec_tokens}",
                           "use 0 (primary only) to num_spec_tokens")
        return CascadeProposer(self.primary.build(target, kv),
                               self.fallback.build(target, kv), self.fallback_num_spec_tokens)
