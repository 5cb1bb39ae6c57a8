"""SchedulerConfig and SchedulerOutput: the knobs of one scheduler and the plan of one step.

Owns: which requests advance this step and by how many tokens (vLLM's token-progress model: a prefill,
a prefill chunk and a decode are the same operation with different counts). Ignores: tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.errors import LabError
from lab.request import Request


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64               # requests running at once
    max_num_batched_tokens: int = 512    # tokens fed to one forward (the step's token budget)
    enable_chunked_prefill: bool = True  # split a long prompt over steps so decodes keep running

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise LabError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}",
                           "set engine.scheduler.max_num_seqs to a positive integer")
        if self.max_num_batched_tokens < 1:
            raise LabError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
                           "set engine.scheduler.max_num_batched_tokens to a positive integer")


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[Request] = field(default_factory=list)            # in scheduling order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_new_request_ids: list[str] = field(default_factory=list)  # admitted this step
    preempted_request_ids: list[str] = field(default_factory=list)     # newest first
    num_prefix_hit_tokens: int = 0                                     # KV reused at admission
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts fed this step
    scheduled_spec_parents: dict[str, list[int]] = field(default_factory=dict)    # those that are a tree's

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled.append(request)
        self.num_scheduled_tokens[request.request_id] = num_tokens

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted_request_ids)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def samples(self, request: Request) -> bool:
        """Does this step reach the request's last known token, so its logits give a new token?"""
        return request.num_computed_tokens + self.num_scheduled_tokens[request.request_id] >= request.num_tokens

    def num_spec_tokens(self, request: Request) -> int:
        return len(self.scheduled_spec_token_ids.get(request.request_id, ()))
