"""The workload interface and the sampling defaults every workload's requests share.

Owns: turning a workload description into Requests. Ignores: engines and timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from lab.errors import LabError
from lab.request import Request, SamplingParams
from lab.sample.structured import StructuredOutputsParams


@dataclass(slots=True)
class SamplingDefaults:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None   # each output token's logprob and the k most likely, into requests.jsonl
    prompt_logprobs: int | None = None   # the same for the prompt's tokens (no prefix-cache hits for them)
    repetition_penalty: float = 1.0      # lab/sample/logits_processors.py (ar, cb_*, speculative)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0                  # no stop token before this many output tokens (vLLM's)
    # NOTE: one of json (a schema), regex, choice, grammar, json_object: lab/sample/structured.py
    structured_outputs: dict[str, Any] | None = None

    def params(self, max_tokens: int, ignore_eos: bool) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=ignore_eos, logprobs=self.logprobs,
                              prompt_logprobs=self.prompt_logprobs, repetition_penalty=self.repetition_penalty,
                              frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                              min_tokens=min(self.min_tokens, max_tokens),
                              structured_outputs=self._structured_outputs())

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        if self.structured_outputs is None:
            return None
        unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
        if unknown:
            raise LabError(f"sampling.structured_outputs has unknown keys {sorted(unknown)}",
                           "set one of json, regex, choice, grammar, json_object (and disable_any_whitespace)")
        return StructuredOutputsParams(**self.structured_outputs)


class Workload(Protocol):
    name: str

    def build(self, tokenizer: Any | None, vocab_size: int, sampling: SamplingDefaults) -> list[Request]:
        """Requests with arrival_time as an offset in seconds from the start of the run."""
        ...
