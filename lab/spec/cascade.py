"""CascadeProposer (proposer=suffix_eagle, suffix_dflash, or any pair): a free proposer first, a model drafter where it
has nothing to say; or, with `graft` (proposer=suffix_dflash_tree), the free proposer's chain grafted onto the
drafter's tree.

Suffix decoding drafts only where earlier text makes a continuation likely, and then several tokens
for free; elsewhere it drafts nothing and the step is a plain decode. The fallback (a trained drafter,
EAGLE by default) drafts exactly those requests, with its own, shorter budget (a model draft costs time
and is less sure). Each request's draft comes from one proposer, so the rejection sampler sees one q per
token as before: deterministic for the primary (suffix), the drafter's for the fallback; lossless either way.

With `graft`, the fallback drafts every request, and where it drafts a tree (greedy requests) the primary's chain
joins it as one more branch (tree.graft_chain): the tree's least likely nodes make room for it (or, with
`graft_by_confidence`, each chain node competes with the tree's by the product of the primary's confidences down to
it), and the verify walks whichever path the target's text follows. Suffix decoding is right where text repeats (a
request's own earlier output, its prompt), a block drafter where it follows from the context's meaning, and a tree
holds both. A chain from the fallback (a sampling request) is routed as above. A chain as long as the grafted tree
would keep outranks all of it, so the fallback does not draft that request; the chain is verified alone, and with
num_spec_tokens above the tree's size it may run past it while the primary stays sure (`long_chain_min_confidence`:
text that repeats a whole sentence or list item).

The fallback is called only for some steps, so it must catch up on the tokens accepted meanwhile; EAGLE
and DFlash do (they keep the draft KV of every position fed real target features and run the rest).

Owns: routing requests between the two and merging their stats. Ignores: how either drafts.
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass
from typing import Any

import torch

from lab.errors import LabError
from lab.kv_cache.manager import KVCacheManager
from lab.request import Request
from lab.spec.feature_proposer import ConfidenceGate
from lab.spec.proposer import Draft, Proposer, check_num_spec_tokens
from lab.spec.tree import graft_chain


class CascadeProposer:
    def __init__(self, primary: Proposer, fallback: Proposer, fallback_num_spec_tokens: int,
                 graft: bool = False, long_chain_min_confidence: float = 0.0,
                 graft_by_confidence: bool = False) -> None:
        if primary.feature_layers:
            raise LabError("the cascade's primary proposer must not read target features",
                           "put the feature drafter (eagle, dflash) in engine.proposer.fallback")
        check_num_spec_tokens(fallback, fallback_num_spec_tokens, "engine.proposer.fallback_num_spec_tokens",
                              "the fallback", lowest=0)
        self.primary, self.fallback = primary, fallback
        self.fallback_num_spec_tokens = fallback_num_spec_tokens
        self.graft = graft
        if not 0.0 <= long_chain_min_confidence <= 1.0:
            raise LabError("engine.proposer.long_chain_min_confidence must be in [0, 1], got "
                           f"{long_chain_min_confidence}", "e.g. 0.3 (suffix decoding's own min_confidence), or 0 "
                           "to keep every draft up to num_spec_tokens")
        self.long_chain_min_confidence = long_chain_min_confidence
        self.graft_by_confidence = graft_by_confidence
        if graft and not getattr(fallback, "drafts_trees", False):
            raise LabError("engine.proposer.graft grafts the primary's chain onto the fallback's trees of drafts, but "
                           "this fallback drafts chains", "give the fallback trees (engine.proposer.fallback.tree_nodes "
                           "or tree_width; engine/proposer=suffix_dflash_tree), or set engine.proposer.graft=false")
        self.feature_layers = fallback.feature_layers
        # NOTE: set per step by the engine's goodput policy (its fallback verdict), where the primary alone is still a
        # cascade (can_pause_fallback); what the last propose left to the fallback, for that verdict
        self.fallback_paused = False
        self.last_fallback_ids: set[str] = set()
        self.last_fallback_s = 0.0
        self.num_primary_drafts = self.num_fallback_drafts = 0
        self.num_grafted_drafts = self.num_grafted_tokens = self.num_long_chain_tokens = 0

    def observe(self, slot_mapping: torch.Tensor, features: torch.Tensor) -> None:
        self.fallback.observe(slot_mapping, features)

    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        drafts = {rid: d for rid, d in self.primary.propose(requests, num_spec_tokens, generators).items()
                  if d.token_ids}
        budget = min(num_spec_tokens, self.fallback_num_spec_tokens)
        max_nodes = self.fallback.max_drafts(budget) if self.graft and budget > 0 else 0
        greedy = {r.request_id for r in requests if r.sampling_params.is_greedy}
        filled = self.filling_chains(drafts, greedy, max_nodes)
        for rid in filled:
            self._cut_long_chain(drafts[rid], max_nodes)
        # NOTE: a sampling request's fallback chain is dropped where the primary drafted, so it is not drafted either
        rest = [(r, g) for r, g in zip(requests, generators) if r.request_id not in drafts
                or (self.graft and r.request_id in greedy and r.request_id not in filled)]
        if not (self.fallback_paused and self.can_pause_fallback) and budget > 0:
            start = time.perf_counter()   # NOTE: on a GPU the drafter's kernels may still run after it returns
            fallback = self.fallback.propose([r for r, _ in rest], budget, [g for _, g in rest]) if rest else {}
            self.last_fallback_s = time.perf_counter() - start
            self.last_fallback_ids = {r.request_id for r, _ in rest}
        else:
            fallback, self.last_fallback_s, self.last_fallback_ids = {}, 0.0, set()
        if self.graft:
            fallback = self._grafted(drafts, fallback, max_nodes)
        self.num_primary_drafts += sum(1 for rid in drafts if rid not in fallback)
        self.num_fallback_drafts += sum(1 for d in fallback.values() if d.token_ids)
        return {**drafts, **fallback}

    @property
    def can_pause_fallback(self) -> bool:
        """Whether a step may draft with the primary alone: not with `graft`, where the primary's chains ride on the
        fallback's trees."""
        return not self.graft

    @staticmethod
    def filling_chains(chains: dict[str, Draft], greedy: set[str], max_nodes: int) -> set[str]:
        """The greedy requests whose chain fills a grafted tree's max_nodes (0: no graft): it outranks every node off
        it, so the graft would keep none of the fallback's tree, and the fallback need not draft one (GSM8K: 40 % of
        the 4-node graft's steps draft a full chain of 7)."""
        return {rid for rid, chain in chains.items() if rid in greedy and len(chain.token_ids) >= max_nodes > 0}

    def _cut_long_chain(self, chain: Draft, max_nodes: int) -> None:
        """A chain that fills the grafted tree's `max_nodes` is verified alone, up to num_spec_tokens. Its drafts
        past `max_nodes` are rows the tree would not have cost, so they stay only while the product of the primary's
        confidences is >= long_chain_min_confidence (a primary reporting none keeps them all)."""
        if len(chain.token_ids) <= max_nodes:
            return
        gate = ConfidenceGate(self.long_chain_min_confidence, always_draft=max_nodes)
        keep = len(chain.token_ids) if chain.confidence is None else gate.length(chain.confidence)
        self.num_long_chain_tokens += keep - max_nodes
        chain.fit(keep, keep)

    def _grafted(self, chains: dict[str, Draft], trees: dict[str, Draft], max_nodes: int) -> dict[str, Draft]:
        """The fallback's trees with the primary's chain of the same request grafted on (at most `max_nodes` nodes,
        the fallback's own tree size); its chains dropped where the primary drafted, so the primary's go instead."""
        out = {}
        for rid, tree in trees.items():
            chain = chains.get(rid)
            if tree.parents is None or not tree.token_ids:
                if chain is None and tree.token_ids:   # NOTE: a chain (a sampling request): routed as a cascade
                    out[rid] = tree
                continue
            if chain is not None:
                # NOTE: a tree without path probabilities ranks its nodes in depth-first order, as Draft.fit cuts it
                num_nodes = len(tree.token_ids)
                ranks = tree.path_probs or [1.0 - node / (num_nodes + 1) for node in range(num_nodes)]
                chain_probs = (list(itertools.accumulate(chain.confidence, operator.mul))
                               if self.graft_by_confidence and chain.confidence is not None
                               and tree.path_probs is not None else None)
                token_ids, parents, ranks, grafted = graft_chain(tree.token_ids, tree.parents, ranks,
                                                                 chain.token_ids, max_nodes, chain_probs)
                tree = Draft(token_ids, None, parents, path_probs=ranks if tree.path_probs is not None else None)
                self.num_grafted_drafts += grafted > 0
                self.num_grafted_tokens += grafted
            out[rid] = tree
        return out

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
        stats = {**self.primary.stats(), **self.fallback.stats(),
                 "spec/primary_drafts": self.num_primary_drafts, "spec/fallback_drafts": self.num_fallback_drafts}
        if self.graft:
            stats |= {"spec/grafted_drafts": self.num_grafted_drafts, "spec/grafted_tokens": self.num_grafted_tokens,
                      "spec/long_chain_tokens": self.num_long_chain_tokens}
        return stats


@dataclass(slots=True)
class CascadeProposerConfig:
    """conf/engine/proposer/suffix_eagle.yaml, suffix_dflash.yaml, suffix_dflash_tree.yaml: `primary` and `fallback`
    are proposer configs; `graft` grafts the primary's chain onto the fallback's trees instead of routing."""

    primary: Any = None
    fallback: Any = None
    fallback_num_spec_tokens: int = 2
    graft: bool = False
    long_chain_min_confidence: float = 0.0
    graft_by_confidence: bool = False

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
        return CascadeProposer(self.primary.build(target, kv), self.fallback.build(target, kv),
                               self.fallback_num_spec_tokens, self.graft, self.long_chain_min_confidence,
                               self.graft_by_confidence)
