"""The Proposer interface: draft `num_spec_tokens` tokens for each running request, cheaply.

Owns: the contract between the speculative engine and its drafters. A proposer returns, per request,
up to k draft tokens and (for a sampling proposer) the distributions it drew them from, so the
RejectionSampler can stay lossless; a deterministic proposer (n-gram) returns no distributions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from lab.errors import LabError
from lab.request import Request, SamplingParams
from lab.sample.rejection import target_probs
from lab.sample.sampler import argmax_rows
from lab.spec.tree import cut, depths, likeliest

if TYPE_CHECKING:   # NOTE: annotations only: this module stays free of the runner's and the caches' imports
    from lab.kv_cache.manager import KVCacheManager
    from lab.runner import ModelRunner


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None   # (len(token_ids), V) q distributions; None = deterministic (one-hot)
    parents: list[int] | None = None    # a tree of drafts (greedy only): each token's parent; None: a chain
    # NOTE: a chain's drafter confidence at each token (its distribution's largest probability; suffix decoding's: the
    # chosen continuation's count / (total + 1)), where the drafter computes it (a confidence gate,
    # engine.draft_policy=goodput, a cascade's long chain); None: not measured
    confidence: list[float] | None = None
    forced: bool = False                # the tokens a request's grammar forces (engine.grammar_drafts)
    # NOTE: a tree's path probability at each node (the drafter's probabilities multiplied down the path), where the
    # drafter computes it: a cut then keeps the likeliest nodes, not a depth-first prefix; None: not known
    path_probs: list[float] | None = None

    def fit(self, max_depth: int, max_tokens: int) -> None:
        """Keep what a step may verify for a request with room for `max_tokens` more tokens: a chain's first
        `max_depth`; a tree's nodes at most `max_depth` deep, and `max_tokens` of them, the likeliest where the path
        probabilities are known, else the first (a depth-first prefix, the chain first), so its keys never need
        more slots than the request's last token will."""
        if self.parents is None:
            self.token_ids = self.token_ids[:max_depth]
            if self.confidence is not None:
                self.confidence = self.confidence[:max_depth]
        else:
            keep = [depth <= max_depth for depth in depths(self.parents)]
            too_many = sum(keep) > max_tokens
            if too_many and self.path_probs is not None:
                # NOTE: the nodes too deep rank last, so the likeliest are all shallow enough
                ranks = [p if k else -1.0 for p, k in zip(self.path_probs, keep)]
                keep = likeliest(self.parents, ranks, max_tokens)
            elif too_many:   # NOTE: the first max_tokens shallow enough: a depth-first prefix of them
                seen = list(itertools.accumulate(keep))
                keep = [k and n <= max_tokens for k, n in zip(keep, seen)]
            self.token_ids, self.parents, self.path_probs = cut(self.token_ids, self.parents, self.path_probs, keep)


class Proposer(Protocol):
    # NOTE: target layers whose outputs the proposer reads (EAGLE, DFlash); () for the others. When set,
    # the engine captures them in every target forward and calls `observe(slot_mapping, features)`: features (N, F)
    # of the forward's rows, slot_mapping (N,) the flat KV slot each row's keys and values were stored at.
    feature_layers: tuple[int, ...]

    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        """Drafts continuing each request's `all_token_ids` (requests may get fewer or no tokens)."""
        ...

    def free(self, request_id: str) -> None:
        """The request finished or was aborted: release whatever the proposer holds for it."""
        ...

    def move_positions(self, request_id: str, src: list[int], dst: list[int]) -> None:
        """A tree's accepted path was verified at positions `src` and now stands at `dst`: move what the proposer
        observed there (only proposers that draft trees, `Draft.parents`, are asked)."""
        ...

    def reset_history(self) -> None:
        """Forget what finished requests taught it (after warm-ups, which copy measured requests)."""
        ...

    def stats(self) -> dict[str, float]:
        ...


def check_num_spec_tokens(proposer: object, num_spec_tokens: int, setting: str, who: str, lowest: int) -> None:
    """Refuse `setting` = num_spec_tokens beyond what `proposer` drafts in a step (its `max_num_spec_tokens`, for
    proposers that draft a fixed block: DFlash's block size - 1), rather than verify fewer than asked."""
    most = getattr(proposer, "max_num_spec_tokens", None)
    if most is not None and num_spec_tokens > most:
        raise LabError(f"{setting}={num_spec_tokens}, but {who} drafts at most {most} tokens a step (DFlash: its "
                       f"block size - 1)", f"set {setting} to {lowest}..{most}, or use a drafter trained with a "
                       f"larger drafter.block_size")


def pick_draft_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                      ) -> tuple[list[int], list[torch.Tensor | None]]:
    """logits (R, V), one row per request -> (a token per row, its q distribution or None when greedy)."""
    tokens, probs = [], []
    for row, p, generator in zip(logits, params, generators):
        if p.is_greedy:
            tokens.append(int(argmax_rows(row)))
            probs.append(None)
        else:
            q = target_probs(row[None], p)[0]                                        # (V,)
            tokens.append(int(torch.multinomial(q, 1, generator=generator)))
            probs.append(q)
    return tokens, probs


class ProposerConfig(Protocol):
    """A conf/engine/proposer/*.yaml target: plain settings in, a Proposer out once the target is known."""

    def build(self, target: ModelRunner, kv: KVCacheManager) -> Proposer:
        """`kv`: the target's KV cache manager: the block count and size a drafter's own KV mirrors, and the block
        tables a feature drafter keeps the target's features by (lab/spec/features.py)."""
        ...
