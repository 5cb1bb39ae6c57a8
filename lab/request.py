"""Request, its status and sampling parameters; the per-token timestamps every metric is built from.

Owns: token progress (`num_computed_tokens`), outputs, timestamps. Ignores: tensors, scheduling policy.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lab.errors import LabError

if TYPE_CHECKING:
    from lab.sample.logprobs import TokenLogprobs
    from lab.sample.structured import RequestGrammar, StructuredOutputsParams

SAMPLING_EPS = 1e-5        # vLLM's: a temperature below it is greedy (dividing logits by it overflows)
SEED_RANGE = (-2**63, 2**63 - 1)   # vLLM's: a 64-bit signed seed
MAX_LOGPROBS = 20                  # vLLM's default max_logprobs (and OpenAI's top_logprobs limit)


@dataclass(slots=True)
class SamplingParams:
    """vLLM's meanings: temperature 0 is greedy; top_k <= 0 and top_p == 1 disable those filters."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0       # vLLM's: drop tokens less likely than min_p x the likeliest (after temperature); 0 is off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None   # None: none; k: each generated token's logprob and the k most likely (vLLM's)
    prompt_logprobs: int | None = None   # the same for every prompt token after the first (no prefix-cache hits)
    repetition_penalty: float = 1.0      # lab/sample/logits_processors.py: vLLM's meanings; 1 and 0 are off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (OpenAI's, -100 to 100)
    min_tokens: int = 0                  # no stop token (EOS, stop_token_ids) before this many output tokens
    allowed_token_ids: list[int] | None = None   # vLLM's: only these may be generated
    # NOTE: vLLM's bad_words, tokenized (the server does it, with and without a leading space): a word's last token
    # is banned wherever the output so far ends with the word's other tokens
    bad_words_token_ids: list[list[int]] | None = None
    # NOTE: a JSON schema, regex, choice or grammar the output must match (lab/sample/structured.py)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise LabError(f"max_tokens must be > 0, got {self.max_tokens}",
                           "set workload.max_tokens (or the request's max_tokens) to a positive integer")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise LabError(f"temperature must be a finite number >= 0, got {self.temperature}",
                           "use 0 for greedy decoding")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise LabError(f"top_p must be in (0, 1], got {self.top_p}", "use 1.0 to disable nucleus sampling")
        if not 0.0 <= self.min_p <= 1.0:
            raise LabError(f"min_p must be in [0, 1], got {self.min_p}", "use 0 to disable min-p sampling")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise LabError(f"allowed_token_ids must be a non-empty list of token ids >= 0, got "
                           f"{self.allowed_token_ids}", "list the token ids the output may use, or leave it unset")
        if self.bad_words_token_ids is not None and not all(self.bad_words_token_ids):
            raise LabError("bad_words must not hold an empty word", "list words of at least one token")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise LabError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                           "use 1.0 for none (above 1 discourages repeats)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise LabError(f"{name} must be between -2 and 2, got {value}", "use 0 for none (OpenAI's range)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise LabError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
                           "use 0 for none")
        bad_bias = {t: b for t, b in (self.logit_bias or {}).items() if t < 0 or not (-100.0 <= b <= 100.0)}
        if bad_bias:
            raise LabError(f"logit_bias must map token ids >= 0 to biases between -100 and 100, got {bad_bias}",
                           "use OpenAI's range")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise LabError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}",
                               "ask for at most 20 top logprobs per token (vLLM's max_logprobs)")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise LabError(f"seed must be a 64-bit signed integer, got {self.seed}",
                           f"use a seed in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_only_argmax(self) -> bool:
        """Greedy, with nothing that reads or changes the logits (processors, logprobs): a step of such requests
        needs only each row's argmax, which the head may find without the logits (model.greedy_head)."""
        return self.is_greedy and not self.has_logits_processors and self.logprobs is None

    @property
    def has_logits_processors(self) -> bool:
        """Anything lab/sample/logits_processors.py changes the logits for: penalties, logit_bias, min_tokens,
        structured outputs, allowed_token_ids and bad words."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.structured_outputs is not None
                or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))


def stop_ids(params: SamplingParams, eos_token_ids: set[int]) -> set[int]:
    """The token ids that end a request: its stop_token_ids, and EOS unless ignore_eos (vLLM's meaning)."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"    # EOS or a stop token
    FINISHED_LENGTH = "finished_length"      # reached max_tokens
    FINISHED_ABORTED = "finished_aborted"    # failed or rejected; `error` says why

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = 0.0          # seconds on the run's clock (time.perf_counter())
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)   # one per output token, if asked for
    # NOTE: one per prompt token once the prefill is done, if asked for; the first token's is None (nothing precedes it)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0       # tokens whose KV is in the cache (vLLM's token-progress model)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    spec_parents: list[int] | None = None   # a tree of drafts: each one's parent (lab/spec/tree.py); None: a chain
    grammar: RequestGrammar | None = None    # its structured outputs' matcher, compiled when the engine admits it
    first_scheduled_time: float | None = None
    num_preemptions: int = 0           # times the scheduler evicted it (its KV freed, recomputed on readmission)
    token_times: list[float] = field(default_factory=list)   # one timestamp per output token
    finished_time: float | None = None
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling_params.logprobs is not None or self.sampling_params.prompt_logprobs is not None

    def prompt_logprob_positions(self, start: int, num: int) -> range:
        """Of the positions [start, start + num) a forward computes, those whose logits give prompt logprobs not yet
        recorded (position p predicts prompt token p + 1); empty unless the request asked for them."""
        if self.sampling_params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + num, self.num_prompt_tokens - 1))

    def record_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """The logprobs of prompt tokens first + 1, first + 2, ... (from the logits at positions first, ...)."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)
        assert len(self.prompt_logprobs) == first + 1, (len(self.prompt_logprobs), first)
        self.prompt_logprobs.extend(entries)

    def append_output_token(self, token_id: int, eos_token_ids: set[int], now: float | None = None,
                            logprobs: TokenLogprobs | None = None) -> bool:
        """Record one generated token (and its logprobs, for a request that asked); returns True when the request
        has just finished."""
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        self.token_times.append(time.perf_counter() if now is None else now)
        params = self.sampling_params
        # NOTE: vLLM's meaning: ignore_eos skips the EOS check only; stop_token_ids still stop
        if (token_id in eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            self.finish(RequestStatus.FINISHED_STOPPED)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(RequestStatus.FINISHED_LENGTH)
        return self.is_finished

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        self.status = status
        self.error = error
        self.finished_time = self.token_times[-1] if self.token_times else time.perf_counter()
