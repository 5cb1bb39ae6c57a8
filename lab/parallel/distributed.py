"""Process groups for tensor parallelism, from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT): NCCL on CUDA (gloo on CPU) for the model's collectives, plus a gloo group for
small CPU-side messages (the engine loop's commands), which NCCL cannot carry.

Owns: init, the current context, teardown. Ignores: what is sharded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lab.errors import LabError

# NOTE: a follower rank waits in a collective while the server is idle; the default timeout would kill it.
IDLE_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    local_rank: int
    group: dist.ProcessGroup        # the model's collectives (all-reduce, all-gather)
    cpu_group: dist.ProcessGroup    # pickled Python objects between ranks

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


_context: ParallelContext | None = None


def init_distributed(expected_world_size: int | None = None) -> ParallelContext:
    """Join the process group torchrun set up (once per process); returns the context."""
    global _context
    if _context is not None:
        return _context
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise LabError("tensor parallelism needs torch.distributed's environment (RANK, WORLD_SIZE, ...)",
                       "start with torchrun: torchrun --nproc-per-node N -m lab.serve serve.tensor_parallel=N")
    world_size = int(os.environ["WORLD_SIZE"])
    if expected_world_size is not None and world_size != expected_world_size:
        raise LabError(f"serve.tensor_parallel={expected_world_size} but torchrun started {world_size} processes",
                       f"use torchrun --nproc-per-node {expected_world_size}")
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=IDLE_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if use_cuda else group
    _context = ParallelContext(dist.get_rank(), world_size, local_rank, group, cpu_group)
    return _context


def current() -> ParallelContext:
    if _context is None:
        raise LabError("torch.distributed is not initialised", "call lab.parallel.init_distributed() first")
    return _context


def destroy() -> None:
    global _context
    if _context is not None and dist.is_initialized():
        dist.destroy_process_group()
    _context = None
