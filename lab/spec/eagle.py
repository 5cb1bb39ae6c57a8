"""EagleProposer (engine=eagle, proposer=eagle): EAGLE-style chain drafting in feature space.

Position i of the draft reads (target feature at i-1, embedding of token i); a feature is the target's
last hidden state after its final norm, so the target's LM head reads the draft's output directly. Each propose: one forward
catches a request up over the positions whose inputs are now all real (the tokens the target accepted
since the last draft and the last token), which predicts the feature at the last position and so the
first draft token; then k-1 single-token forwards feed each predicted feature back. The draft's KV of
positions with real inputs stays valid (DraftKV keeps the prefix whose tokens still match); the chain's
positions are recomputed next time.

With `tree_width` W > 1 (greedy batches) it drafts a tree instead, EAGLE-2's way at its simplest: each depth is
the greedy chain's next token (as long as the confidence gate lets the chain go on) and the most probable others
(by path probability: the product of the head's probabilities along the path, at least `tree_min_prob`) among the
top-W children of every node of the depth before, W nodes at most; each depth is one head forward over the whole
tree so far (every node seeing its ancestors only: SeqSlice.tree). W = 1, or tree_min_prob = 1, is the chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.drafters.eagle import EagleConfig, EagleDrafter
from lab.kv_cache.block_kv import BlockKVCache, SeqSlice
from lab.kv_cache.manager import KVCacheManager
from lab.request import Request
from lab.runner import ModelRunner
from lab.spec.draft_kv import DraftKV
from lab.spec.feature_proposer import (ConfidenceGate, DraftWeights, FeatureProposer, build_drafter,
                                       resolve_draft_weights, resolve_head_weights)
from lab.spec.proposer import Draft
from lab.spec.tree import ROOT, DraftTree


class EagleProposer(FeatureProposer):
    def __init__(self, target: ModelRunner, drafter: EagleDrafter, target_kv: KVCacheManager,
                 draft_vocab_size: int = 0, head_weights: DraftWeights = "fp32", gate: ConfidenceGate | None = None,
                 tree_width: int = 1, tree_min_prob: float = 0.0) -> None:
        super().__init__(target, drafter, target_kv, draft_vocab_size, head_weights, gate, tree_width, tree_min_prob)
        c, num_blocks, block_size = target.config, target_kv.num_blocks, target_kv.block_size
        # NOTE: the head's own KV (one layer), as many blocks as the target's; the native paged kernel for its
        # few-token steps (as the target's decode), SDPA otherwise.
        cache = BlockKVCache(1, c.num_kv_heads, c.head_dim, num_blocks, block_size, target.dtype, target.device,
                             backend="native")
        self.kv = DraftKV(cache, num_blocks, block_size)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.kv.free(request_id)

    def max_drafts(self, num_spec_tokens: int) -> int:
        """The most tokens a draft of `num_spec_tokens` positions holds: a beam of up to W nodes a depth."""
        return num_spec_tokens * self.tree_width

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "spec/draft_skipped_requests": self.kv.num_skipped}

    def _forward(self, seqs: list[SeqSlice], token_ids: list[int], prev_features: torch.Tensor,
                 every_row: bool = False) -> torch.Tensor:
        """One flat batch: tokens (N,) with the features before them (N, H) -> predicted features at each
        slice's last position (R, H), or with `every_row` at every token (N, H)."""
        self.kv.cache.begin_step(seqs)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)[None]            # (1, N)
        positions = self.kv.cache.index.positions[None]                                       # (1, N)
        hidden = self.drafter(self.target.embed_tokens(ids), prev_features[None], positions, self.kv.cache)
        self.num_forwards += 1
        if every_row:
            return hidden[0]                                                                  # (N, H)
        last_rows = torch.tensor([s.num_query_tokens for s in seqs], device=self.device).cumsum(0) - 1
        return hidden[0, last_rows]                                                           # (R, H)

    def _draft_trees(self, seqs: list[SeqSlice], features: torch.Tensor, depth: int) -> list[DraftTree]:
        """Each request's tree (see the module's docstring): seqs, the catch-up's slices; features (R, H), the
        predicted features at each request's last token (its first drafted position's)."""
        width, trees = self.tree_width, [DraftTree() for _ in seqs]
        chains: list[list[float]] = [[] for _ in seqs]   # the head's confidence along each greedy chain (the gate's)
        predicted: dict[int, torch.Tensor] = {}           # request row -> its nodes' predicted features (T, H)
        tokens, probs = self.candidates(self.head_scores(features), width)                    # (R, W) each
        self._grow(trees, chains, list(range(len(seqs))), [[ROOT] for _ in seqs], tokens.tolist(), probs.tolist())
        for _ in range(1, depth):
            live = [r for r, tree in enumerate(trees) if tree.frontier]
            if not live:
                break
            # NOTE: the whole tree so far in one forward per depth (its nodes' keys are recomputed, identically):
            # each node reads its parent's predicted feature (from the forward before), a first token the request's.
            step, ids, prev = [], [], []
            for r in live:
                tree, seq = trees[r], seqs[r]
                step.append(SeqSlice(seq.block_table, seq.num_context_tokens + seq.num_query_tokens,
                                     len(tree.token_ids), tuple(tree.parents[1:])))
                ids.extend(tree.token_ids)
                prev.append(torch.stack([features[r] if parent == ROOT else predicted[r][parent]
                                         for parent in tree.parents]))
            hidden = self._forward(step, ids, torch.cat(prev), every_row=True)                  # (N, H)
            rows, offset = [], 0
            for r in live:
                predicted[r] = hidden[offset:offset + len(trees[r].token_ids)]                  # (T_r, H)
                rows.extend(offset + node for node in trees[r].frontier)
                offset += len(trees[r].token_ids)
            tokens, probs = self.candidates(self.head_scores(hidden[rows]), width)             # (F, W) each
            self._grow(trees, chains, live, [trees[r].frontier for r in live], tokens.tolist(), probs.tolist())
        return trees

    def _grow(self, trees: list[DraftTree], chains: list[list[float]], live: list[int], parents: list[list[int]],
              tokens: list[list[int]], probs: list[list[float]]) -> None:
        """Add a level to each live request's tree: `parents[i]` its nodes expanded (ROOT: the first position),
        `tokens`/`probs` their top-W children and the head's probabilities of them, one row per parent, in order."""
        row = 0
        for r, nodes in zip(live, parents):
            tree, chain, candidates = trees[r], None, []
            for node in nodes:
                base = 1.0 if node == ROOT else tree.path_probs[node]
                candidates.extend((node, token, base * prob) for token, prob in zip(tokens[row], probs[row]))
                if node == tree.chain_tip and self.gate.length(chains[r] + [probs[row][0]]) > len(chains[r]):
                    chain = (node, tokens[row][0], base * probs[row][0])
                    chains[r].append(probs[row][0])
                row += 1
            tree.grow(candidates, self.tree_width, self.tree_min_prob, chain)

    def output_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """EAGLE's features are post-norm: the target's head reads the predicted feature directly."""
        return hidden

    def _prev_features(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Target features (after the final norm) at positions start-1 .. end-2, zeros before position 0:
        (end - start, H)."""
        rows = self.target.norm(self.store.read(request_id, max(0, start - 1), end - 1))
        if start == 0:
            rows = torch.cat((rows.new_zeros(1, self.store.dim), rows))
        return rows

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_spec_tokens: int,
                generators: list[torch.Generator | None]) -> dict[str, Draft]:
        if num_spec_tokens < 1 or not requests:
            return {}
        active, seqs, token_ids, prev = [], [], [], []
        for request, generator in zip(requests, generators):
            if not self.ready(request):
                continue
            context = request.all_token_ids
            # NOTE: room for the drafts fed back: a chain's k - 1, a tree's nodes down to depth k - 1
            seq = self.kv.catch_up(request.request_id, context, (num_spec_tokens - 1) * self.tree_width)
            if seq is None:
                continue
            active.append((request, generator))
            seqs.append(seq)
            token_ids.extend(context[seq.num_context_tokens:])
            prev.append(self._prev_features(request.request_id, seq.num_context_tokens, len(context)))
        if not active:
            return {}
        params, gens = [r.sampling_params for r, _ in active], [g for _, g in active]
        features = self._forward(seqs, token_ids, torch.cat(prev))                             # (R, H)
        if self.tree_width > 1 and all(p.is_greedy for p in params):
            trees = self._draft_trees(seqs, features, num_spec_tokens)
            out = {}
            for (request, _), tree in zip(active, trees):
                self.kv.commit(request.request_id, request.all_token_ids)
                token_ids, parents, path_probs = tree.depth_first()
                out[request.request_id] = Draft(token_ids, None, parents, path_probs=path_probs)
            return out
        drafted, probs, confidence, _ = self.pick(features, params, gens)
        tokens, dists, confidences = [[t] for t in drafted], [[q] for q in probs], [[c] for c in confidence]
        live = [row for row in range(len(active)) if self.gate.may_extend(confidences[row])]
        features = features[live]                                                              # (len(live), H)
        for i in range(1, num_spec_tokens):
            if not live:
                break   # NOTE: no chain can pass the confidence gate any more: no more drafter forwards
            step = [SeqSlice(seqs[r].block_table, seqs[r].num_context_tokens + seqs[r].num_query_tokens + i - 1, 1)
                    for r in live]
            features = self._forward(step, [tokens[r][-1] for r in live], features)
            drafted, probs, confidence, _ = self.pick(features, [params[r] for r in live], [gens[r] for r in live])
            for r, token, q, c in zip(live, drafted, probs, confidence):
                tokens[r].append(token)
                dists[r].append(q)
                confidences[r].append(c)
            kept = [j for j, r in enumerate(live) if self.gate.may_extend(confidences[r])]
            live, features = [live[j] for j in kept], features[kept]
        out = {}
        for row, (request, _) in enumerate(active):
            # NOTE: only positions fed real target features stay valid; the chain's are recomputed next time.
            self.kv.commit(request.request_id, request.all_token_ids)
            length = self.gate.length(confidences[row])
            if length:
                row_dists = dists[row][:length]
                out[request.request_id] = Draft(tokens[row][:length],
                                                None if row_dists[0] is None else torch.stack(row_dists),
                                                confidence=confidences[row][:length] if self.gate.active else None)
        return out


@dataclass(slots=True)
class EagleProposerConfig:
    """conf/engine/proposer/eagle.yaml. `checkpoint: null` drafts with a random-init head (tests only);
    draft_vocab_size: draft logits for the first N token ids only (0: all); weights: what the drafter's few-row
    products stream (auto, fp32, fp16, q8_0, q4_1, int8; feature_proposer.resolve_draft_weights); head_weights: what the
    draft head's stream (auto: as weights; resolve_head_weights); min_confidence, always_draft:
    the ConfidenceGate (draft while the product of the head's confidences stays >= min_confidence, the first
    always_draft positions regardless; lab/spec/feature_proposer.py);
    tree_width: draft a beam of at most tree_width nodes a depth, not only the chain (a tree; 1: a chain), a node
    off the chain only where its path probability is >= tree_min_prob."""

    checkpoint: str | None = "checkpoints/smollm2/eagle_mix.pt"
    seed: int = 0
    draft_vocab_size: int = 8192
    weights: str = "auto"
    head_weights: str = "auto"
    min_confidence: float = 0.0
    always_draft: int = 0
    tree_width: int = 1
    tree_min_prob: float = 0.0

    def kv_bytes_per_token(self, target: ModelRunner) -> int:
        """Kept per target KV slot: the token's target features (the last layer's hidden state) and the head's
        own KV (one layer of the target's shape)."""
        itemsize = target.dtype.itemsize
        return target.config.hidden_size * itemsize + target.config.kv_bytes_per_token(itemsize, num_layers=1)

    def build(self, target: ModelRunner, kv: KVCacheManager) -> EagleProposer:
        fresh = None
        if self.checkpoint is None:
            with torch.random.fork_rng():
                torch.manual_seed(self.seed)
                fresh = EagleDrafter(target.config, EagleConfig(), target.source.hf_config)
        weights = resolve_draft_weights(self.weights, target)
        drafter = build_drafter("eagle", target, self.checkpoint, fresh, weights)
        return EagleProposer(target, drafter, kv, self.draft_vocab_size,
                             resolve_head_weights(self.head_weights, weights),
                             ConfidenceGate(self.min_confidence, self.always_draft), self.tree_width,
                             self.tree_min_prob)
