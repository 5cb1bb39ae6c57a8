"""Token-length distributions for synthetic workloads: fixed, uniform (vLLM's range_ratio), normal,
lognormal, all seeded through the caller's numpy Generator and clipped to >= 1; and `from_dataset`,
the empirical lengths of a packaged prompt set.

Owns: drawing lengths. Ignores: token ids and requests.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lab.errors import LabError

DISTRIBUTIONS = ("fixed", "uniform", "normal", "lognormal", "dataset")


def fixed(mean: int, n: int) -> list[int]:
    return [max(1, int(mean))] * n


def uniform(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """Integers uniform in [mean(1-r), mean(1+r)], as vLLM's random dataset draws them."""
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def normal(rng: np.random.Generator, mean: int, std: float, n: int) -> list[int]:
    return np.clip(np.rint(rng.normal(mean, std, size=n)), 1, None).astype(int).tolist()


def lognormal(rng: np.random.Generator, mean: int, std: float, n: int) -> list[int]:
    """Lognormal with the given mean and standard deviation in tokens (not of the underlying normal).

    NOTE: parametrized by its own mean and std so `input_len` keeps meaning "average length" whichever
    distribution is picked; sigma^2 = ln(1 + std^2/mean^2) and mu = ln(mean) - sigma^2/2 give exactly that.
    """
    sigma = math.sqrt(math.log1p((std / mean) ** 2))
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), 1, None).astype(int).tolist()


def check_distribution(dist: str, std: float | None, side: str) -> None:
    """Fail early, at construction, with the config key to fix (`side` is "input" or "output")."""
    if dist not in DISTRIBUTIONS:
        raise LabError(f"workload.{side}_dist={dist!r} is not a length distribution",
                       f"use one of: {', '.join(DISTRIBUTIONS)}")
    if dist in ("normal", "lognormal") and (std is None or std <= 0):
        raise LabError(f"workload.{side}_dist={dist} needs a positive workload.{side}_std (tokens), got {std}",
                       f"set workload.{side}_std, e.g. to half of workload.{side}_len")


def sample(rng: np.random.Generator, dist: str, mean: int, n: int, range_ratio: float = 0.0,
           std: float | None = None) -> list[int]:
    """n lengths from one of the parametric distributions ("dataset" is drawn by `from_dataset`)."""
    if dist == "fixed":
        return fixed(mean, n)
    if dist == "uniform":
        return uniform(rng, mean, range_ratio, n)
    if dist == "normal" and std is not None:
        return normal(rng, mean, std, n)
    if dist == "lognormal" and std is not None:
        return lognormal(rng, mean, std, n)
    raise LabError(f"cannot sample lengths from dist={dist!r} with std={std}", "see lab/workloads/lengths.py")


def from_dataset(dataset: str, tokenizer: Any, n: int, seed: int) -> tuple[list[int], list[int]]:
    """Prompt and reference-output token lengths of n seeded-random records of a packaged prompt set.

    Pairs stay together, so when both sides come from the dataset their correlation is kept.
    """
    from lab.workloads.datasets import DatasetWorkload  # NOTE: lazy; datasets.py is the heavier module

    # NOTE: raw prompt text (no chat template): a synthetic prompt has no template around it either.
    workload = DatasetWorkload(dataset, num_prompts=n, seed=seed, max_tokens=None, use_chat_template=False)
    samples = workload.select(tokenizer)
    return [len(s.prompt_token_ids) for s in samples], [s.output_len for s in samples]
