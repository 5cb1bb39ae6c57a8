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

    def __init__(self, min_n: int, max_n: int, short_match_tokens: int | None = None, long_match_n: int = 3) -> None:
        self.lookup = NgramProposer(min_n, max_n, short_match_tokens, long_match_n)

    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        return {r.request_id: Draft(self.lookup.propose_one(r.all_token_ids, num_spec_tokens)) for r in requests}

    def free(self, request_id: str) -> None:
        pass

    def reset_history(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


@dataclass(slots=True)
class NgramProposerConfig:
    min_n: int = 1
    max_n: int = 4
    short_match_tokens: int | None = None   # matches shorter than long_match_n draft at most this many
    long_match_n: int = 3

    def build(self, target: object, kv: object) -> NgramDraftProposer:
        return NgramDraftProposer(self.min_n, self.max_n, self.short_match_tokens, self.long_match_n)
