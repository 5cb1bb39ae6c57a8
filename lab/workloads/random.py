"""RandomWorkload: synthetic prompts of random token ids, vLLM's `random` dataset.

Lengths are uniform in [L(1-r), L(1+r)] (vLLM's range_ratio; 0 = fixed). Seeded and reproducible.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lab.errors import LabError
from lab.request import Request
from lab.workloads.base import SamplingDefaults


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


class RandomWorkload:
    def __init__(self, num_prompts: int = 8, input_len: int = 128, output_len: int = 32, range_ratio: float = 0.0,
                 seed: int = 0, ignore_eos: bool = True, name: str = "random") -> None:
        if num_prompts < 1:
            raise LabError(f"workload.num_prompts must be >= 1, got {num_prompts}", "set workload.num_prompts=1 or more")
        if input_len < 1:
            raise LabError(f"workload.input_len must be >= 1, got {input_len}", "set workload.input_len=1 or more")
        if output_len < 1:
            raise LabError(f"workload.output_len must be >= 1, got {output_len}",
                           "set workload.output_len to a positive number of tokens")
        if not 0.0 <= range_ratio < 1.0:
            raise LabError(f"workload.range_ratio must be in [0, 1), got {range_ratio}", "use 0 for fixed lengths")
        self.name, self.num_prompts, self.input_len, self.output_len = name, num_prompts, input_len, output_len
        self.range_ratio, self.seed, self.ignore_eos = range_ratio, seed, ignore_eos

    def build(self, tokenizer: Any | None, vocab_size: int, sampling: SamplingDefaults) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        input_lens = sample_lengths(rng, self.input_len, self.range_ratio, self.num_prompts)
        output_lens = sample_lengths(rng, self.output_len, self.range_ratio, self.num_prompts)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        allowed = np.array([t for t in range(vocab_size) if t not in special])  # no EOS/BOS inside prompts
        requests = []
        for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
            token_ids = rng.choice(allowed, size=n_in).tolist()
            requests.append(Request(f"{self.name}-{i}", token_ids, sampling.params(n_out, self.ignore_eos)))
        return requests
