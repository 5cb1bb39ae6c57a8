"""shared_runner: the jobs of a sweep that one process runs one after another (a joblib worker's, the basic
launcher's) share the model they load, while what builds it stays the same (lab/run.py: `runner_key`), as the
crossover's 48 jobs do. Building it costs ~4 s a job here (reading the weights, packing the GGUF blocks, timing the
kernels) against ~0.3 s for an engine, and every cell a process runs then runs on the same kernel choices. Engines
never change their runner, so a shared one computes what a fresh one would.

The cache lives here, not in lab/run.py: `python -m lab.run` (make run) makes that module `__main__`, whose
functions joblib sends to its workers by value, each call with fresh globals, so a cache there never outlived its job.

Owns: the process's last runner, and loky's allowance for the worker that holds it. Ignores: how a runner is built
(the caller's `build`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import psutil

from lab.runner.model_runner import ModelRunner

LOKY_WORKER_GROWTH_BYTES = 2 << 30   # what a joblib worker holding a shared model may grow past its size with it

# NOTE: (what built it, the runner): the model the last sweep job in this process loaded
_last: tuple[str, ModelRunner] | None = None


def shared_runner(key: str, build: Callable[[], ModelRunner]) -> tuple[ModelRunner, bool]:
    """The runner the last job built if its key is `key`, else build() (the old one dropped first, so two models
    never sit in memory at once). -> (runner, whether reused)."""
    global _last
    if _last is not None and _last[0] == key:
        return _last[1], True
    _last = None
    runner = build()
    _last = (key, runner)
    keep_this_joblib_worker()
    return runner, False


def keep_this_joblib_worker() -> None:
    """loky (joblib's worker processes, the crossover's launcher) replaces a worker whose memory stands 300 MB above
    its size after its first call, a check against leaks, which a worker holding a shared model (~3 GB here) fails:
    every job would get a fresh worker and load the model again. In a worker (where loky's module is loaded) the
    allowance becomes the memory it holds now, the model in it, plus LOKY_WORKER_GROWTH_BYTES, whatever loky measured
    first: a sweep's jobs in one process do not grow past their first's peak by more than ~0.1 GB (48 crossover jobs:
    4.20 -> 4.32 GB), and a worker that does grow 2 GiB past the model is still replaced."""
    executor = sys.modules.get("joblib.externals.loky.process_executor")
    if executor is None or not getattr(executor, "_USE_PSUTIL", False):
        return   # NOTE: without psutil loky does not check at all
    allowance = psutil.Process().memory_info().rss + LOKY_WORKER_GROWTH_BYTES
    executor._MAX_MEMORY_LEAK_SIZE = max(executor._MAX_MEMORY_LEAK_SIZE, allowance)
