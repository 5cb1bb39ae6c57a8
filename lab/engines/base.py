"""Engine: the arrival-driven run loop shared by every engine; subclasses implement `step`.

Owns: waiting queue, admission at arrival times, per-request generators, failure isolation.
Ignores: tokenization and metrics.
"""

from __future__ import annotations

import hashlib
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from lab.engines.phases import PhaseTracker
from lab.errors import LabError
from lab.kv_cache import AttentionCache
from lab.request import Request, RequestStatus
from lab.runner import ModelRunner
from lab.sample import Sampler
from lab.sample.sampler import make_generator
from lab.sample.structured import GrammarCompiler


@dataclass(slots=True)
class RunResult:
    requests: list[Request]
    start_time: float      # perf_counter at the start of the run
    duration: float        # seconds from the first arrival to the last finish


class Engine(ABC):
    # NOTE: engines that take requests over time are admitted at each request's arrival time.
    supports_arrivals: bool = True
    # NOTE: engines that record each sampled token's logprobs (SamplingParams.logprobs); the others refuse such requests
    supports_logprobs: bool = False
    # NOTE: engines that apply SamplingParams' penalties, logit_bias, min_tokens and structured outputs
    # (lab/sample/logits_processors.py)
    supports_logits_processors: bool = False

    def __init__(self, runner: ModelRunner, name: str | None = None, seed: int = 0) -> None:
        self.runner = runner
        self.name = name or type(self).__name__
        self.seed = seed
        self.sampler = Sampler()
        self.waiting: deque[Request] = deque()
        self._generators: dict[str, torch.Generator] = {}
        self.phases = PhaseTracker(runner.device)
        self.step_hook: Callable[[], None] | None = None  # e.g. the profiler's step()
        self.peak_kv_reserved_bytes = 0
        self.peak_kv_used_bytes = 0
        self._grammar_compiler: GrammarCompiler | None = None   # built at the first structured-output request

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys + values of one token over all layers."""
        return self.runner.config.kv_bytes_per_token(self.runner.dtype.itemsize)

    def kv_usage(self) -> tuple[int, int]:
        """(bytes reserved for KV, bytes holding live tokens) right now; engines with a cache override."""
        return 0, 0

    def kv_cache_usage(self) -> float | None:
        """vLLM's `kv_cache_usage_perc`: the share of a fixed KV pool's blocks that requests hold (0-1); None
        where the cache has no fixed pool (it grows with the batch)."""
        return None

    def reset_caches(self) -> None:
        """Forget what earlier requests left behind that would serve a later one (prefix-cached KV,
        a proposer's token history): lab.run calls it after the warm-ups, which copy measured requests."""

    def reset_stats(self) -> None:
        """Forget what warm-up requests did to the counters."""
        self.phases = PhaseTracker(self.runner.device, self.phases.track_memory)
        self.peak_kv_reserved_bytes = self.peak_kv_used_bytes = 0

    def calibrate(self, max_batch: int) -> dict[int, float]:
        """Measure, before serving up to `max_batch` requests at once, what the engine prices by this machine (the
        goodput policy: a step's seconds by row count); caches and counters are left as if it had not run. -> what
        it measured; {} for engines that price nothing."""
        return {}

    def stats(self) -> dict[str, float]:
        """Engine-specific numbers merged into results.json (phases, KV bytes; subclasses add more)."""
        return {**self.phases.summary(), "kv/peak_reserved_bytes": self.peak_kv_reserved_bytes,
                "kv/peak_used_bytes": self.peak_kv_used_bytes}

    # -- request lifecycle ---------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        max_len = self.runner.max_model_len
        needed = request.num_prompt_tokens + request.sampling_params.max_tokens
        if request.num_prompt_tokens == 0:
            raise LabError(f"request {request.request_id}: empty prompt", "give every request at least one token")
        params = request.sampling_params
        if params.has_logits_processors and not self.supports_logits_processors:
            raise LabError(f"request {request.request_id}: engine {self.name} does not apply penalties, logit_bias, "
                           "min_tokens, allowed_token_ids, bad_words or structured outputs",
                           "use engine=ar, cb_slots, cb_paged or a speculative engine for them")
        named_token_ids = {"logit_bias": list(params.logit_bias or ()),
                           "allowed_token_ids": params.allowed_token_ids or [],
                           "bad_words": [t for word in params.bad_words_token_ids or () for t in word]}
        for name, token_ids in named_token_ids.items():
            if token_ids and max(token_ids) >= self.runner.vocab_size:
                raise LabError(f"request {request.request_id}: {name} names token {max(token_ids)}, outside the "
                               f"vocabulary (size {self.runner.vocab_size})", "use token ids the model has")
        if request.wants_logprobs and not self.supports_logprobs:
            raise LabError(f"request {request.request_id}: engine {self.name} does not compute logprobs",
                           "use engine=ar, cb_slots, cb_paged or a speculative engine for logprobs")
        if needed > max_len:
            raise LabError(
                f"request {request.request_id}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {needed} exceeds the model's context ({max_len})",
                "shorten the prompt, lower workload.max_tokens / workload.output_len, or raise model.max_model_len")
        if params.structured_outputs is not None and request.grammar is None:
            # NOTE: compiled here, so a constraint that does not compile is a bad request (the server's 400)
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.runner.tokenizer)
            request.grammar = self._grammar_compiler.compile(params.structured_outputs)

    def add_request(self, request: Request) -> None:
        self.validate(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort_request(self, request_id: str, error: str = "aborted") -> Request | None:
        """Abort one request wherever it is (waiting or running), freeing its KV; returns it if found."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return fail([request], error)[0]
        return self.abort_running_request(request_id, error)

    def abort_running_request(self, request_id: str, error: str) -> Request | None:
        """Engines that hold running requests override this to release one of them."""
        raise NotImplementedError(f"{self.name} cannot abort a running request")

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def step(self) -> list[Request]:
        """Advance the running requests; returns the requests that finished in this step."""

    @abstractmethod
    def abort_running(self, error: str) -> list[Request]:
        """Mark every request in flight as failed (after an exception in `step`); returns them."""

    def generator_for(self, request: Request) -> torch.Generator | None:
        """A per-request generator, so a request's samples do not depend on what it is batched with."""
        params = request.sampling_params
        if params.is_greedy:
            return None
        if request.request_id not in self._generators:
            seed = params.seed if params.seed is not None else request_seed(self.seed, request.request_id)
            self._generators[request.request_id] = make_generator(seed, self.runner.device)
        return self._generators[request.request_id]

    def execute_and_sample(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                           requests: list[Request]) -> list[int]:
        """One forward of a padded batch (B, T) -> a token per request from its last position. Where every request
        reads only the argmax (SamplingParams.needs_only_argmax), the head's greedy screen finds it without the logits
        (model.greedy_head), as in the continuous engines, so the ladder's engines are measured on the same head."""
        params = [r.sampling_params for r in requests]
        if self.runner.greedy_head and all(p.needs_only_argmax for p in params):
            return self.runner.execute(input_ids, positions, cache, greedy=True).tolist()              # (B,)
        logits = self.runner.execute(input_ids, positions, cache)                                      # (B, V)
        return self.sampler.sample(logits, params, [self.generator_for(r) for r in requests])

    def release_request_state(self, request_id: str) -> None:
        """Drop what the engine keeps per request once it has ended (its sampling generator); no-op if none."""
        self._generators.pop(request_id, None)

    # -- the run loop --------------------------------------------------------------------------
    def run(self, requests: list[Request], max_concurrency: int | None = None) -> RunResult:
        """Serve `requests`, each admitted at its arrival_time (seconds after the start).

        With `max_concurrency` (closed loop) at most that many requests are in flight; a request held
        back is sent when one finishes, and its latency clock starts then, as in vLLM's benchmark.
        """
        steps = self.serve(requests, max_concurrency)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def serve(self, requests: list[Request], max_concurrency: int | None = None) -> Generator[None, None, RunResult]:
        """`run` one step at a time: yields after every engine step, returns the RunResult. A caller may do other
        work between steps (lab/engines/interleave.py runs two engines' steps in turns)."""
        for request in requests:
            self.validate(request)
        pending = deque(sorted(requests, key=lambda r: r.arrival_time))
        start = time.perf_counter()
        for request in pending:
            request.arrival_time += start  # relative offsets -> this run's clock
        num_in_flight = 0
        while pending or self.has_unfinished_requests():
            now = time.perf_counter()
            while pending and pending[0].arrival_time <= now and (
                    max_concurrency is None or num_in_flight < max_concurrency):
                request = pending.popleft()
                if max_concurrency is not None:
                    request.arrival_time = max(request.arrival_time, now)  # NOTE: closed loop: sent when admitted
                self.add_request(request)
                num_in_flight += 1
            if not self.has_unfinished_requests():
                time.sleep(max(0.0, pending[0].arrival_time - time.perf_counter()))
                continue
            try:
                num_in_flight -= len(self.step())
            except Exception as exc:  # noqa: BLE001 - one bad step fails its requests, not the run
                num_in_flight -= len(self.abort_running(f"{type(exc).__name__}: {exc}"))
            if self.step_hook is not None:
                self.step_hook()
            reserved, used = self.kv_usage()
            self.peak_kv_reserved_bytes = max(self.peak_kv_reserved_bytes, reserved)
            self.peak_kv_used_bytes = max(self.peak_kv_used_bytes, used)
            yield
        end = max((r.finished_time or start for r in requests), default=start)
        for request in requests:
            self.release_request_state(request.request_id)
        return RunResult(requests, start, end - start)


def fail(requests: list[Request], error: str) -> list[Request]:
    for request in requests:
        request.finish(RequestStatus.FINISHED_ABORTED, error)
    return requests


def request_seed(engine_seed: int, request_id: str) -> int:
    """An unseeded request's sampling seed: the same in every process for the same engine seed and request id
    (hash() of a str is salted per process, which made `seed=0` runs sample differently each time)."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1   # NOTE: < 2**63, a valid torch seed


def take_generated(request: Request, token_ids: list[int], times: list[float], eos_token_ids: set[int],
                   source: str) -> None:
    """Append the tokens an outside generator (`source`: HF generate(), HF continuous batching) returned, stamped
    with the times it produced them, until the request finishes; one it left unfinished (fewer than max_tokens,
    no stop token) is failed with a clear error, never kept short."""
    for token_id, at in zip(token_ids, times):
        if request.append_output_token(int(token_id), eos_token_ids, now=at):
            break
    if not request.is_finished:
        fail([request], f"{source} returned {request.num_output_tokens} tokens, fewer than max_tokens "
                        f"{request.sampling_params.max_tokens} without a stop token")
