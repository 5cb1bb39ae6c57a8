"""conf/engine/proposer/ngram.yaml: prompt lookup needs no model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.request import Request
from lab.spec.ngram import NgramProposer
from lab.spec.proposer import Draft


class NgramDraftProposer:
    """NgramProposer behind the Proposer interface (deterministic: no distributions)."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int, max_n: int) -> None:
        self.lookup = NgramProposer(min_n, max_n)

    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        return {r.request_id: Draft(self.lookup.propose_one(r.all_token_ids, num_spec_tokens)) for r in requests}

    def free(self, request_id: str) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


@dataclass(slots=True)
class NgramProposerConfig:
    min_n: int = 1
    max_n: int = 4

    def build(self, target: object, num_blocks: int, block_size: int) -> NgramDraftProposer:
        return NgramDraftProposer(self.min_n, self.max_n)
