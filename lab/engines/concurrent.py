"""ConcurrentEngine (`engine=concurrent`): naive concurrency. Up to `num_workers` requests are served at
once against the same weights, each by its own AR loop (ar.advance) over its own ContiguousKVCache;
no two requests ever share a forward, so they contend for the device instead of batching.

`mode: thread` runs the loops on a thread pool in this process. `mode: process` runs them in forked
worker processes: the weights are shared copy-on-write through fork, not loaded per process.

Owns: the worker pool, memory-budget admission (rejections are recorded, never silent), CUDA OOM
reporting, and the peak-memory reading used by the batching experiments. Ignores: batching.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.engines.ar import advance, start_request
from lab.engines.base import Engine, RunResult, fail
from lab.errors import LabError
from lab.request import Request, RequestStatus
from lab.runner import ModelRunner
from lab.sample import Sampler

MODES = ("thread", "process")


# -- memory readings and estimates ---------------------------------------------------------------------
def _status_mb(field: str) -> float | None:
    """A field of /proc/self/status (VmRSS, VmHWM) in MB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory of this process during a `with` block, and its RSS when the block began.

    NOTE: ru_maxrss never goes down, so in a Hydra sweep (jobs in one process) it carries the largest
    earlier job into every later one; VmHWM after clear_refs measures this run alone. Memory an earlier
    job left with the allocator still counts in both readings; their difference is this run's growth.
    """

    def __init__(self) -> None:
        self.peak_mb: float | None = None
        self.start_mb: float | None = None

    def __enter__(self) -> PeakRSS:
        self.peak_mb = None
        self._is_reset = reset_peak_rss()
        self.start_mb = _status_mb("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_mb = _status_mb("VmHWM") if self._is_reset else None

    def stats(self) -> dict[str, float]:
        if self.peak_mb is None or self.start_mb is None:
            return {}
        return {"memory/peak_rss_mb": self.peak_mb, "memory/start_rss_mb": self.start_mb}


def max_requests_within_budget(budget_mb: float, weights_mb: float, kv_mb_per_token: float,
                               context_len: int) -> int:
    """Largest number of concurrent requests of `context_len` tokens whose weights + KV fit the budget."""
    return max(0, int((budget_mb - weights_mb) // (kv_mb_per_token * context_len)))


# -- the worker: one request, start to finish ----------------------------------------------------------
@dataclass(slots=True)
class WorkerResult:
    request: Request                 # the worker's copy, finished (or aborted with `error`)
    is_oom: bool = False
    worker_pid: int = 0
    rss_growth_mb: float | None = None  # process workers: peak RSS above the worker's RSS at fork


def serve(runner: ModelRunner, request: Request, generator_state: torch.Tensor | None) -> WorkerResult:
    """Run one request to completion with its own cache; failures end the request, never the worker."""
    generator = None
    if generator_state is not None:
        generator = torch.Generator(device=runner.device)
        generator.set_state(generator_state)
    sampler, is_oom = Sampler(), False
    try:
        start_request(request)
        kv_cache = runner.allocate_kv_cache(1, request.num_prompt_tokens + request.sampling_params.max_tokens)
        while not advance(runner, sampler, request, kv_cache, generator):
            pass
    except torch.cuda.OutOfMemoryError as exc:
        is_oom = True
        request.finish(RequestStatus.FINISHED_ABORTED, f"CUDA out of memory: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported on the request
        request.finish(RequestStatus.FINISHED_ABORTED, f"{type(exc).__name__}: {exc}")
    return WorkerResult(request, is_oom, os.getpid())


_PROCESS_RUNNER: ModelRunner | None = None  # in a forked worker: the parent's runner, shared copy-on-write
_PROCESS_BASE_RSS_MB = 0.0


def _init_process_worker(runner: ModelRunner) -> None:
    global _PROCESS_RUNNER, _PROCESS_BASE_RSS_MB
    _PROCESS_RUNNER = runner
    # NOTE: GNU OpenMP is not fork-safe: a forked child that runs a multi-threaded op after the parent
    # used its thread pool hangs. Forked workers are therefore single-threaded, N workers share the cores.
    torch.set_num_threads(1)
    reset_peak_rss()
    _PROCESS_BASE_RSS_MB = _status_mb("VmRSS") or 0.0


def _serve_in_process(request: Request, generator_state: torch.Tensor | None) -> WorkerResult:
    result = serve(_PROCESS_RUNNER, request, generator_state)
    peak = _status_mb("VmHWM")
    result.rss_growth_mb = None if peak is None else max(0.0, peak - _PROCESS_BASE_RSS_MB)
    return result


# -- the engine -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _InFlight:
    request: Request
    kv_bytes: int


class ConcurrentEngine(Engine):
    def __init__(self, runner: ModelRunner, num_workers: int = 4, mode: str = "thread",
                 memory_budget_mb: float | None = None, poll_interval_s: float = 0.005,
                 name: str | None = None, seed: int = 0) -> None:
        super().__init__(runner, name or "concurrent", seed)
        if num_workers < 1:
            raise LabError(f"engine.num_workers must be >= 1, got {num_workers}", "set engine.num_workers=1 or more")
        if mode not in MODES:
            raise LabError(f"unknown engine.mode {mode!r}", f"use one of: {', '.join(MODES)}")
        if mode == "process" and runner.device.type == "cuda":
            raise LabError("engine.mode=process forks workers, and a forked child cannot use CUDA",
                           "use engine.mode=thread on CUDA")
        self.num_workers, self.mode, self.poll_interval_s = num_workers, mode, poll_interval_s
        self.memory_budget_mb = memory_budget_mb
        self.in_flight: dict[Future, _InFlight] = {}
        self.pool: Executor | None = None
        self.counters = {"num_rejected": 0, "num_oom": 0, "num_errors": 0}
        self.worker_rss_growth_mb: dict[int, float] = {}
        self.peak_rss = PeakRSS()

    def reset_stats(self) -> None:
        super().reset_stats()
        self.counters = dict.fromkeys(self.counters, 0)
        self.worker_rss_growth_mb.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self.in_flight) or bool(self.waiting)

    def run(self, requests: list[Request], max_concurrency: int | None = None) -> RunResult:
        with self.peak_rss, self._open_pool():
            return super().run(requests, max_concurrency)

    @contextmanager
    def _open_pool(self) -> Iterator[None]:
        if self.mode == "thread":
            # NOTE: OpenMP's thread count is per calling thread; give workers the one this process was set to.
            self.pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="lab-worker",
                                           initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),))
        else:
            self.pool = ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("fork"),
                                            initializer=_init_process_worker, initargs=(self.runner,))
            # NOTE: a fork pool starts every worker on its first task; do that before the run's clock starts.
            self.pool.submit(os.getpid).result()
        try:
            yield
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    # -- admission ----------------------------------------------------------------------------------------
    def _rejection(self, kv_bytes: int, num_tokens: int, reserved_bytes: int) -> str | None:
        """Why admitting a request needing `kv_bytes` now would not fit, or None if it fits."""
        mb = 2**20
        if self.memory_budget_mb is not None:
            weights = self.runner.weight_bytes
            in_flight = sum(f.kv_bytes for f in self.in_flight.values())
            if (weights + in_flight + kv_bytes) / mb > self.memory_budget_mb:
                return (f"rejected: engine.memory_budget_mb={self.memory_budget_mb:g} < weights {weights / mb:.1f} MB"
                        f" + KV in flight {in_flight / mb:.1f} MB ({len(self.in_flight)} requests) + this request's"
                        f" KV {kv_bytes / mb:.1f} MB ({num_tokens} tokens)")
        if self.runner.device.type == "cuda":
            # NOTE: workers dispatched in this round may not have allocated yet; count them as taken.
            free = torch.cuda.mem_get_info(self.runner.device)[0] - reserved_bytes
            if kv_bytes > free:
                return (f"rejected: this request's KV needs {kv_bytes / mb:.1f} MB but only {free / mb:.1f} MB "
                        f"of {self.runner.device} memory is free")
        return None

    def _admit(self) -> list[Request]:
        """Dispatch waiting requests to free workers; returns the ones rejected for memory."""
        rejected: list[Request] = []
        reserved = 0
        while self.waiting and len(self.in_flight) < self.num_workers:
            request = self.waiting.popleft()
            num_tokens = request.num_prompt_tokens + request.sampling_params.max_tokens
            kv_bytes = num_tokens * self.kv_bytes_per_token
            reason = self._rejection(kv_bytes, num_tokens, reserved)
            if reason is not None:
                self.counters["num_rejected"] += 1
                rejected += fail([request], reason)
                continue
            generator = self.generator_for(request)
            state = generator.get_state() if generator is not None else None
            # NOTE: the worker gets a copy, so a request aborted here is never written to by a late worker.
            copy = dataclasses.replace(request, output_token_ids=list(request.output_token_ids),
                                       token_times=list(request.token_times))
            if self.mode == "thread":
                future = self.pool.submit(serve, self.runner, copy, state)
            else:
                future = self.pool.submit(_serve_in_process, copy, state)
            request.status = RequestStatus.RUNNING
            self.in_flight[future] = _InFlight(request, kv_bytes)
            reserved += kv_bytes
        return rejected

    # -- the step: admit, then wait briefly for any worker to finish --------------------------------------
    def step(self) -> list[Request]:
        finished = self._admit()
        if self.in_flight:
            done, _ = wait(list(self.in_flight), timeout=self.poll_interval_s, return_when=FIRST_COMPLETED)
            finished += [self._complete(future) for future in done]
        return finished

    def _complete(self, future: Future) -> Request:
        request = self.in_flight.pop(future).request
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - e.g. a worker process died
            self.counters["num_errors"] += 1
            return fail([request], f"worker failed: {type(exc).__name__}: {exc}")[0]
        done = result.request
        for name in ("output_token_ids", "token_times", "num_computed_tokens", "first_scheduled_time",
                     "status", "error", "finished_time"):
            setattr(request, name, getattr(done, name))
        if result.is_oom:
            self.counters["num_oom"] += 1
        elif request.status is RequestStatus.FINISHED_ABORTED:
            self.counters["num_errors"] += 1
        if result.rss_growth_mb is not None:
            growth = self.worker_rss_growth_mb.get(result.worker_pid, 0.0)
            self.worker_rss_growth_mb[result.worker_pid] = max(growth, result.rss_growth_mb)
        return request

    def kv_usage(self) -> tuple[int, int]:
        """Each in-flight request holds a cache sized for prompt + max_tokens (its worker's progress is
        not visible from here, so reserved and used are both that)."""
        reserved = sum(f.kv_bytes for f in self.in_flight.values())
        return reserved, reserved

    def abort_running(self, error: str) -> list[Request]:
        for future in self.in_flight:
            future.cancel()
        aborted = fail([f.request for f in self.in_flight.values()], error)
        self.in_flight.clear()
        return aborted

    def stats(self) -> dict[str, float]:
        """Rejections, OOMs and memory of the run (slash-namespaced, merged into results.json)."""
        mb = 2**20
        out = {**super().stats(), **{f"concurrent/{k}": v for k, v in self.counters.items()}}
        out.update({"concurrent/num_workers": self.num_workers,
                    "memory/weights_mb": self.runner.weight_bytes / mb,
                    "memory/peak_estimated_mb": (self.runner.weight_bytes + self.peak_kv_reserved_bytes) / mb})
        if self.memory_budget_mb is not None:
            out["memory/budget_mb"] = self.memory_budget_mb
        out.update(self.peak_rss.stats())
        if self.worker_rss_growth_mb and "memory/peak_rss_mb" in out:
            # NOTE: forked workers share the weights; only what each grew past its RSS at fork is added.
            out["memory/peak_rss_mb"] += sum(self.worker_rss_growth_mb.values())
        return out
