"""Scheduler: waiting and running queues, a token budget per step, chunked prefill, admission when the
KV manager can allocate, and preemption by recomputation (vLLM v1's policy).

Owns: which requests run, in what order, and how many tokens each advances. Ignores: the model and
tensor contents (it sees a KVCacheManager, which counts blocks).

Each step: running decodes first, then running prefill chunks, then waiting requests in arrival order,
while the budget (`max_num_batched_tokens`) and `max_num_seqs` allow. When a running request needs a
block and none is free, the newest running request not yet scheduled this step is preempted: its KV is
freed, `num_computed_tokens` reset to 0 while its generated tokens stay, and it goes to the front of
the waiting queue, so its recompute prefill later covers prompt + outputs. No admission in a step
that preempted. A request that could never fit is failed with the reason, never left waiting.
"""

from __future__ import annotations

import time
from collections import deque

from lab.errors import LabError
from lab.kv_cache.manager import NO_PREFIX, KVCacheManager
from lab.request import Request, RequestStatus
from lab.sample.logprobs import TokenLogprobs
from lab.sched.output import SchedulerConfig, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order: newest last
        self._failed: list[Request] = []          # rejected or stuck, handed back by the next update
        self.num_preemptions = 0
        self.max_running = 0

    # -- queues ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        # NOTE: engines raise this error in validate() before queueing; failing it here is the safeguard.
        error = self.never_fits(request)
        if error is not None:
            self._fail(request, str(error))
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def never_fits(self, request: Request) -> LabError | None:
        """Why this request can never run with this cache and budget (problem and fix), or None."""
        # NOTE: the last sampled token never needs KV, and a recompute prefill covers prompt + outputs.
        num_prompt, max_tokens = request.num_prompt_tokens, request.sampling_params.max_tokens
        max_kv_tokens = num_prompt + max_tokens - 1
        kv = self.kv_manager
        if not kv.can_fit(max_kv_tokens):
            return LabError(
                f"request {request.request_id}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs KV "
                f"for up to {max_kv_tokens} tokens, more than the whole KV cache holds ({kv.num_blocks} blocks of "
                f"{kv.block_size} tokens), so it could never run",
                "shorten the prompt or lower max_tokens, or give the engine a bigger cache "
                "(engine.kv_cache.num_blocks / kv_cache_memory_mb, or max_len for slots)")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and max_kv_tokens > budget:
            return LabError(
                f"request {request.request_id} may need a {max_kv_tokens}-token prefill, over "
                f"max_num_batched_tokens={budget} with chunked prefill off, so it could never run",
                "shorten the prompt or lower max_tokens, or set engine.scheduler.enable_chunked_prefill=true "
                "or raise engine.scheduler.max_num_batched_tokens")
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._failed)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:   # preempted earlier in this step
                continue
            num_uncomputed = request.num_tokens - request.num_computed_tokens
            # NOTE: drafts ride along with a decode's last token; the budget may cut some of them (a tree's
            # depth-first order keeps every cut a tree).
            num_spec = min(len(request.spec_token_ids), budget - 1) if num_uncomputed == 1 else 0
            num_new = min(num_uncomputed + num_spec, budget)
            if self._allocate_or_preempt(request, num_new, out):
                out.add(request, num_new)
                if num_spec > 0:
                    out.scheduled_spec_token_ids[request.request_id] = request.spec_token_ids[:num_spec]
                    if request.spec_parents is not None:
                        out.scheduled_spec_parents[request.request_id] = request.spec_parents[:num_spec]
                budget -= num_new
        if not out.preempted_request_ids:
            self._admit(out, budget)
        if out.is_empty and not self.running and self.waiting:
            # NOTE: unreachable when never_fits() is right; a safeguard so the run loop cannot spin.
            head = self.waiting.popleft()
            self._fail(head, f"request {head.request_id} could not be scheduled even with an empty cache")
        self.max_running = max(self.max_running, len(self.running))
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv_manager.allocate_slots(request, num_new):
            victim = next(r for r in reversed(self.running) if r.request_id not in out.num_scheduled_tokens)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv_manager.free(request)          # before the reset: free() reads num_computed_tokens
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_request_ids.append(request.request_id)
        self.num_preemptions += 1

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            # NOTE: as vLLM's, a request asking for prompt logprobs computes its whole prompt (cached KV has no logits)
            prefix = (NO_PREFIX if request.sampling_params.prompt_logprobs is not None
                      else self.kv_manager.find_cached_prefix(request))
            num_new = request.num_tokens - prefix.num_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv_manager.allocate_slots(request, num_new, prefix):
                break
            self.waiting.popleft()
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            self.running.append(request)
            out.add(request, num_new)
            out.scheduled_new_request_ids.append(request.request_id)
            out.num_prefix_hit_tokens += prefix.num_tokens
            budget -= num_new

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: dict[str, int | list[int]],
                           now: float | None = None, logprobs: dict[str, list[TokenLogprobs]] | None = None
                           ) -> list[Request]:
        """Advance every scheduled request by its tokens and append its sampled token(s) (with their logprobs,
        for the requests that asked); returns the requests that finished (and any failed since the last step),
        their KV freed.

        With speculation a request samples 1..k+1 tokens (accepted drafts + one target token); the KV of
        rejected drafts is rolled back by not counting it as computed (it is overwritten later)."""
        finished, self._failed = self._failed, []
        for request in out.scheduled:
            num_spec = out.num_spec_tokens(request)
            sampled = sampled_token_ids.get(request.request_id)
            tokens = [] if sampled is None else [sampled] if isinstance(sampled, int) else sampled
            num_rejected = num_spec - (len(tokens) - 1) if tokens else 0
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id] - num_rejected
            request.spec_token_ids, request.spec_parents = [], None
            token_logprobs = (logprobs or {}).get(request.request_id)
            for i, token_id in enumerate(tokens):
                if request.append_output_token(token_id, self.eos_token_ids, now,
                                               None if token_logprobs is None else token_logprobs[i]):
                    self.running.remove(request)
                    self.kv_manager.free(request)
                    finished.append(request)
                    break
        return finished

    def abort_running(self, error: str) -> list[Request]:
        """Fail every running request (after a failed step) and release its KV."""
        aborted, self.running = self.running, []
        for request in aborted:
            self.kv_manager.free(request)
            request.finish(RequestStatus.FINISHED_ABORTED, error)
        return aborted

    def abort_request(self, request_id: str, error: str) -> Request | None:
        """Abort one waiting or running request (e.g. its client left), releasing its KV."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.kv_manager.free(request)
                    request.finish(RequestStatus.FINISHED_ABORTED, error)
                    return request
        return None

    def _fail(self, request: Request, error: str) -> None:
        request.finish(RequestStatus.FINISHED_ABORTED, error)
        self._failed.append(request)

    def reset_stats(self) -> None:
        self.num_preemptions = self.max_running = 0

    def stats(self) -> dict[str, float]:
        return {"sched/num_preemptions": self.num_preemptions, "sched/max_running": self.max_running,
                "sched/max_num_seqs": self.config.max_num_seqs,
                "sched/max_num_batched_tokens": self.config.max_num_batched_tokens}
