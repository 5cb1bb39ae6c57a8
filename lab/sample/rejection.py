"""RejectionSampler: verifies k draft tokens per request against the target's distributions, losslessly.

Greedy rows accept the longest prefix where the draft equals the target's argmax, then emit the target's
own token (the correction, or the bonus token after k accepts). Sampled rows accept draft token x with
probability min(1, p(x) / q(x)); at the first rejection they resample from normalise(max(0, p - q)); if
all k are accepted they sample a bonus token from p. The output then follows the target's distribution
exactly (Leviathan et al., 2023; Chen et al., 2023). A deterministic proposer (n-gram) has q one-hot.

Owns: acceptance math. Ignores: requests, caches and how drafts were made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.request import SamplingParams
from lab.sample.sampler import GreedyRows, Sampler, argmax_rows, filter_logits
from lab.spec.tree import walk_greedy


@dataclass(slots=True)
class VerifyResult:
    token_ids: list[int]        # accepted draft tokens + one target token: 1 .. k+1 tokens
    num_accepted: int           # accepted draft tokens (0 .. k)
    path: list[int] | None = None   # a tree's accepted drafts (their indices, root down); None: a chain's prefix


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (T, V) -> the distribution the plain sampler would draw from at each position, (T, V)."""
    scaled = logits.float() / params.temperature
    return torch.stack([filter_logits(row, params.top_k, params.top_p, params.min_p).softmax(-1) for row in scaled])


class RejectionSampler:
    def __init__(self) -> None:
        self.sampler = Sampler()

    def verify(self, target_logits: torch.Tensor | GreedyRows, draft_token_ids: list[int], params: SamplingParams,
               generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> VerifyResult:
        """target_logits (k+1, V) at the positions after each of the k drafts' predecessors (GreedyRows: their argmax,
        greedy params only); draft_probs (k, V) the proposer's distributions (None: deterministic proposer, q
        one-hot)."""
        k = len(draft_token_ids)
        if params.is_greedy:
            return self._verify_greedy(target_logits, draft_token_ids)
        p = target_probs(target_logits, params)                                   # (k+1, V)
        for i, token in enumerate(draft_token_ids):
            q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
            accept_prob = min(1.0, float(p[i, token]) / max(q_token, 1e-20))
            if torch.rand((), generator=generator, device=p.device).item() >= accept_prob:
                residual = p[i].clone()
                if draft_probs is None:
                    residual[token] = 0.0
                else:
                    residual = torch.clamp(residual - draft_probs[i].to(residual.dtype), min=0.0)
                total = residual.sum()
                if total <= 0:  # NOTE: p == q exactly; any sample from p is then correct
                    residual, total = p[i], p[i].sum()
                correction = int(torch.multinomial(residual / total, 1, generator=generator))
                return VerifyResult(draft_token_ids[:i] + [correction], i)
        bonus = int(torch.multinomial(p[k], 1, generator=generator))
        return VerifyResult(list(draft_token_ids) + [bonus], k)

    @staticmethod
    def verify_tree_greedy(target_logits: torch.Tensor | GreedyRows, draft_token_ids: list[int], parents: list[int]
                           ) -> VerifyResult:
        """A tree of drafts (lab/spec/tree.py), greedy: target_logits (1 + n, V) at the root and at every draft ->
        the longest path of drafts that are each the target's token after their parent, and the target's next."""
        path, target = walk_greedy(argmax_rows(target_logits).tolist(), draft_token_ids, parents)
        return VerifyResult([draft_token_ids[i] for i in path] + [target], len(path), path)

    @staticmethod
    def _verify_greedy(target_logits: torch.Tensor | GreedyRows, draft_token_ids: list[int]) -> VerifyResult:
        target_ids = argmax_rows(target_logits).tolist()                           # (k+1,)
        num_accepted = 0
        for draft, target in zip(draft_token_ids, target_ids):
            if draft != target:
                break
            num_accepted += 1
        return VerifyResult(list(draft_token_ids[:num_accepted]) + [target_ids[num_accepted]], num_accepted)
