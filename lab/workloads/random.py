"""RandomWorkload: synthetic prompts of random token ids, vLLM's `random` dataset.

Input and output lengths each follow their own distribution (lengths.py): `uniform` in [L(1-r), L(1+r)]
(vLLM's range_ratio; r = 0, the default, is fixed), `fixed`, `normal` or `lognormal` with mean L and std
`*_std` tokens, or `dataset`: the prompt / reference-output lengths of a packaged prompt set. Seeded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lab.errors import LabError
from lab.request import Request
from lab.workloads import lengths
from lab.workloads.base import SamplingDefaults


class RandomWorkload:
    def __init__(self, num_prompts: int = 8, input_len: int = 128, output_len: int = 32, range_ratio: float = 0.0,
                 seed: int = 0, ignore_eos: bool = True, name: str = "random", input_dist: str = "uniform",
                 output_dist: str = "uniform", input_std: float | None = None, output_std: float | None = None,
                 dataset: str = "sharegpt") -> None:
        if num_prompts < 1:
            raise LabError(f"workload.num_prompts must be >= 1, got {num_prompts}", "set workload.num_prompts=1 or more")
        if input_len < 1:
            raise LabError(f"workload.input_len must be >= 1, got {input_len}", "set workload.input_len=1 or more")
        if output_len < 1:
            raise LabError(f"workload.output_len must be >= 1, got {output_len}",
                           "set workload.output_len to a positive number of tokens")
        if not 0.0 <= range_ratio < 1.0:
            raise LabError(f"workload.range_ratio must be in [0, 1), got {range_ratio}", "use 0 for fixed lengths")
        lengths.check_distribution(input_dist, input_std, "input")
        lengths.check_distribution(output_dist, output_std, "output")
        self.name, self.num_prompts, self.input_len, self.output_len = name, num_prompts, input_len, output_len
        self.range_ratio, self.seed, self.ignore_eos = range_ratio, seed, ignore_eos
        self.input_dist, self.output_dist, self.input_std, self.output_std = input_dist, output_dist, input_std, output_std
        self.dataset = dataset

    def sample_lengths(self, rng: np.random.Generator, tokenizer: Any | None) -> tuple[list[int], list[int]]:
        """Input and output lengths; the input side draws from `rng` first, as the original workload did."""
        measured: tuple[list[int], list[int]] = ([], [])
        if "dataset" in (self.input_dist, self.output_dist):
            if tokenizer is None:
                raise LabError(f"length dist `dataset` needs a tokenizer to measure {self.dataset}",
                               "use model=smollm2 or model=tiny, or another *_dist")
            measured = lengths.from_dataset(self.dataset, tokenizer, self.num_prompts, self.seed)
        n, ratio = self.num_prompts, self.range_ratio
        input_lens = (measured[0] if self.input_dist == "dataset"
                      else lengths.sample(rng, self.input_dist, self.input_len, n, ratio, self.input_std))
        output_lens = (measured[1] if self.output_dist == "dataset"
                       else lengths.sample(rng, self.output_dist, self.output_len, n, ratio, self.output_std))
        return input_lens, output_lens

    def build(self, tokenizer: Any | None, vocab_size: int, sampling: SamplingDefaults) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        input_lens, output_lens = self.sample_lengths(rng, tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        allowed = np.array([t for t in range(vocab_size) if t not in special])  # no EOS/BOS inside prompts
        requests = []
        for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
            token_ids = rng.choice(allowed, size=n_in).tolist()
            requests.append(Request(f"{self.name}-{i}", token_ids, sampling.params(n_out, self.ignore_eos)))
        return requests
