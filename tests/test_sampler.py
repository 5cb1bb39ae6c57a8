"""Sampler: greedy is argmax; top-k, top-p and min-p keep exactly the tokens HF's warpers keep; seeds reproduce."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lab.engines.base import request_seed
from lab.errors import LabError
from lab.request import SamplingParams
from lab.sample import Sampler
from lab.models import native_gemv
from lab.sample.sampler import argmax_rows, filter_logits, make_generator


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert Sampler().sample(logits, [SamplingParams(), SamplingParams()], [None, None]) == [1, 0]


def test_top_k_keeps_k_largest() -> None:
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).nonzero().flatten().tolist()
    assert kept == [1, 2]


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=0.8)).nonzero().flatten().tolist()
    assert kept == [0, 1]
    kept_all_but_tail = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=0.9)).nonzero().flatten().tolist()
    assert kept_all_but_tail == [0, 1, 2]


def test_top_p_agrees_with_hf_warper() -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(0)) * 3
    for top_k, top_p in ((0, 0.9), (20, 1.0), (20, 0.7)):
        ours = filter_logits(logits[0], top_k=top_k, top_p=top_p)
        theirs = logits.clone()
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs[0])), f"top_k={top_k} top_p={top_p}"


def test_min_p_keeps_tokens_at_least_min_p_times_the_likeliest_as_hf_and_vllm() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    kept = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=1.0, min_p=0.2)).nonzero().flatten().tolist()
    assert kept == [0, 1, 2]   # 0.08 < 0.2 x 0.5
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(1)) * 3
    for min_p in (0.01, 0.1, 0.5):
        ours = filter_logits(logits[0], top_k=0, top_p=1.0, min_p=min_p)
        theirs = MinPLogitsWarper(min_p)(None, logits.clone())
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs[0])), min_p
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, min_p=0.2)
    draws = {Sampler().sample(probs.log()[None], [params], [generator])[0] for _ in range(300)}
    assert draws == {0, 1, 2}
    with pytest.raises(LabError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=1.5)


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(1, 1)
    params = SamplingParams(temperature=1.0)
    generator = make_generator(0, torch.device("cpu"))
    sampler = Sampler()
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sampler.sample(logits, [params], [generator])[0]] += 1
    expected = logits[0].softmax(-1) * 3000
    assert ((counts - expected).abs() < 5 * expected.sqrt() + 10).all(), f"counts {counts} vs expected {expected}"


def test_sampling_settings_that_would_break_a_step_are_refused_or_made_greedy() -> None:
    """vLLM's: a temperature under 1e-5 is greedy (logits / 1e-40 overflow to inf); NaN and out-of-range seeds
    are refused when the request is made, not when a batch is mid-step."""
    assert SamplingParams(temperature=1e-40).is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    for bad, message in [({"temperature": float("nan")}, "temperature must be a finite number"),
                         ({"temperature": float("inf")}, "temperature must be a finite number"),
                         ({"seed": 2**63}, "seed must be a 64-bit signed integer")]:
        with pytest.raises(LabError, match=message):
            SamplingParams(**bad)
    make_generator(SamplingParams(seed=-2**63).seed, torch.device("cpu"))   # the range's ends are valid torch seeds
    make_generator(SamplingParams(seed=2**63 - 1).seed, torch.device("cpu"))


def test_an_unseeded_requests_seed_is_the_same_in_every_process() -> None:
    """Python salts str hashes per process; the engine's per-request seed must not depend on it, or `seed=0` runs
    sample differently each time."""
    code = "from lab.engines.base import request_seed; print(request_seed(0, 'random-3'))"
    seeds = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": salt},
                            capture_output=True, text=True, check=True).stdout.strip() for salt in ("1", "2")}
    assert seeds == {str(request_seed(0, "random-3"))} and request_seed(0, "random-3") != request_seed(1, "random-3")


def test_argmax_rows_is_torch_argmax_on_every_edge() -> None:
    """The native argmax (two vectorised passes a row) returns torch.argmax(-1): the first of tied maxima, the first
    NaN where there is one, index 0 of an all -inf row, any row length and layout."""
    native = native_gemv.load_kernel() is not None
    generator = torch.Generator().manual_seed(0)
    nan_rows = torch.randn(3, 100, generator=generator)
    nan_rows[1, [50, 70]] = float("nan")
    nan_rows[2, 99] = float("nan")
    zeros = torch.zeros(2, 20)
    zeros[0, 3], zeros[1] = -0.0, -0.0
    cases = [torch.randn(7, 49152, generator=generator), torch.randn(3, 5, generator=generator),
             torch.full((2, 13), float("-inf")), torch.randint(0, 3, (50, 37), generator=generator).float(),
             nan_rows, zeros, torch.randn(5, 1000, generator=generator)[:, ::2],
             torch.randn(2, 3, 17, generator=generator),
             torch.tensor([float("inf"), 1.0, float("inf")]), torch.randn(4, 8, generator=generator)]
    for logits in cases:
        assert native_gemv.usable(logits) == native   # NOTE: the kernel's answer where it is built, not torch's
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))
