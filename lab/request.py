"""Request, its status and sampling parameters; the per-token timestamps every metric is built from.

Owns: token progress (`num_computed_tokens`), outputs, timestamps. Ignores: tensors, scheduling policy.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lab.errors import LabError


@dataclass(slots=True)
class SamplingParams:
    """vLLM's meanings: temperature 0 is greedy; top_k <= 0 and top_p == 1 disable those filters."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise LabError(f"max_tokens must be > 0, got {self.max_tokens}",
                           "set workload.max_tokens (or the request's max_tokens) to a positive integer")
        if self.temperature < 0:
            raise LabError(f"temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
        if not 0.0 < self.top_p <= 1.0:
            raise LabError(f"top_p must be in (0, 1], got {self.top_p}", "use 1.0 to disable nucleus sampling")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
    num_computed_tokens: int = 0       # tokens whose KV is in the cache (vLLM's token-progress model)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    spec_parents: list[int] | None = None   # a tree of drafts: each one's parent (lab/spec/tree.py); None: a chain
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

    def append_output_token(self, token_id: int, eos_token_ids: set[int], now: float | None = None) -> bool:
        """Record one generated token; returns True when the request has just finished."""
        self.output_token_ids.append(token_id)
        self.token_times.append(time.perf_counter() if now is None else now)
        params = self.sampling_params
        if not params.ignore_eos and (token_id in eos_token_ids or token_id in params.stop_token_ids):
            self.finish(RequestStatus.FINISHED_STOPPED)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(RequestStatus.FINISHED_LENGTH)
        return self.is_finished

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        self.status = status
        self.error = error
        self.finished_time = self.token_times[-1] if self.token_times else time.perf_counter()
