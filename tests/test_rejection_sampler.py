"""Rejection sampling is lossless: greedy keeps the target's argmax path; sampled outputs follow the target
distribution exactly (chi-square on a small vocabulary, fixed seeds); n-gram lookup proposes continuations."""

from __future__ import annotations

import pytest
import torch

from lab.errors import LabError
from lab.request import SamplingParams
from lab.sample.rejection import RejectionSampler
from lab.sample.sampler import make_generator
from lab.spec.ngram import NgramProposer

# chi-square critical value for 4 degrees of freedom at p = 0.001
CHI2_CRIT_DF4 = 18.47


def test_greedy_accepts_the_matching_prefix_then_corrects() -> None:
    logits = torch.full((4, 6), -5.0)
    for position, token in enumerate([2, 3, 1, 5]):
        logits[position, token] = 5.0
    sampler = RejectionSampler()
    assert sampler.verify(logits, [2, 3, 1], SamplingParams(), None).token_ids == [2, 3, 1, 5]   # all + bonus
    partial = sampler.verify(logits, [2, 4, 1], SamplingParams(), None)
    assert (partial.token_ids, partial.num_accepted) == ([2, 3], 1)
    assert sampler.verify(logits, [0, 3, 1], SamplingParams(), None).token_ids == [2]


def _first_token_histogram(draft_probs: torch.Tensor | None, draft_token: int, p_logits: torch.Tensor,
                           num_samples: int) -> torch.Tensor:
    sampler, params = RejectionSampler(), SamplingParams(temperature=1.0)
    generator = make_generator(0, torch.device("cpu"))
    q_generator = make_generator(1, torch.device("cpu"))
    counts = torch.zeros(p_logits.shape[-1])
    target_logits = p_logits.expand(2, -1)
    for _ in range(num_samples):
        token = draft_token if draft_probs is None else int(torch.multinomial(draft_probs[0], 1, generator=q_generator))
        result = sampler.verify(target_logits, [token], params, generator, draft_probs)
        counts[result.token_ids[0]] += 1
    return counts


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_outputs_follow_the_target_distribution_with_a_random_draft() -> None:
    p_logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]])
    q = torch.tensor([[0.05, 0.5, 0.3, 0.05, 0.1]])       # a poor draft, far from p
    counts = _first_token_histogram(q, 0, p_logits, 6000)
    chi2 = _chi_square(counts, p_logits[0].softmax(-1))
    assert chi2 < CHI2_CRIT_DF4, f"chi-square {chi2:.1f} >= {CHI2_CRIT_DF4}: counts {counts.tolist()}"


def test_sampled_outputs_follow_the_target_distribution_with_a_deterministic_draft() -> None:
    p_logits = torch.tensor([[0.5, 1.5, -1.0, 0.3, 1.0]])
    counts = _first_token_histogram(None, 2, p_logits, 6000)  # always drafts an unlikely token
    chi2 = _chi_square(counts, p_logits[0].softmax(-1))
    assert chi2 < CHI2_CRIT_DF4, f"chi-square {chi2:.1f} >= {CHI2_CRIT_DF4}: counts {counts.tolist()}"


def test_draft_equal_to_target_is_always_accepted() -> None:
    p_logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    p = p_logits.softmax(-1)
    generator = make_generator(3, torch.device("cpu"))
    for _ in range(50):
        drafts = [int(torch.multinomial(p[i], 1, generator=generator)) for i in range(3)]
        result = RejectionSampler().verify(p_logits, drafts, SamplingParams(temperature=1.0), generator, p[:3])
        assert result.num_accepted == 3 and len(result.token_ids) == 4


def test_ngram_proposes_what_followed_the_last_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert proposer.propose_one(context, 3) == [8, 9, 1]
    assert proposer.propose_one([1, 2, 3], 2) == []
    assert proposer.propose_one([4, 1, 2, 4, 1, 3, 4, 1], 2) == [3, 4]  # most recent match wins


def test_ngram_drafts_fewer_tokens_on_short_matches() -> None:
    proposer = NgramProposer(min_n=1, max_n=4, short_match_tokens=1, long_match_n=3)
    assert proposer.propose_one([5, 6, 7, 8, 9, 1, 5, 6, 7], 4) == [8, 9, 1, 5]   # a 3-token match: k tokens
    assert proposer.propose_one([5, 6, 7, 8, 9, 1, 2, 6, 7], 4) == [8]            # a 2-token match: 1 token
    assert proposer.propose_one([3, 9, 9, 9, 8, 7], 4) == []
    with pytest.raises(LabError, match="short_match_tokens"):
        NgramProposer(short_match_tokens=0)
